"""A sharded trainer in a fleet that keeps going: 2 FSDP2 ranks (real processes, gloo), 3 reference engines.

Under ``FleetPolicy.exclude(min_engines=2)`` an engine SIGKILLed mid-sync is left out and every trainer
rank runs the update again over the two others (rank 0 decides, an ``AGAIN`` round carries it), which
then serve the trainer's weights bit-exact; the killed engine, restarted on its port with its base
weights, is brought to the fleet's version by a collective ``catch_up``: by broadcast in the gather mode, and
through shared memory in the direct mode (every rank its own ring, no group formed for it). In both send modes.
In the direct mode another engine stalls meanwhile (stopped past the group timeout), which trainer rank 0 waits
out while the other rank waits for its next round.

The model is a tiny Llama with SmolLM2's tokenizer, so that the ranks and engines start in seconds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fsdp_ranks import LONG, explained, start_ranks
from support import ENV, free_port
from test_sharded_trainer import segments_held

from wsync_grpc.testing import EngineProcess, cli_command, spawn_process, stop_all

# Kills an engine at a moment rank 0 reports: `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

BUCKET_DELAY_S = 0.5
"""Rank 0 sleeps this long after each bucket (seconds), so that the kill lands before its next bucket."""

GROUP_TIMEOUT_S, RPC_TIMEOUT_S = 8.0, 20.0
"""The ranks' timeouts (seconds) in the stalled case: a collective's shorter than the stall, a Cancel's longer."""

STALL_S = 11.0
"""How long the stalled engine is stopped, in seconds: past the group timeout, within the Cancel's."""


def start_engine(model_dir: Path, port: int, tmp: Path, name: str) -> EngineProcess:
    """``wsync serve --engine reference --model DIR`` on a fixed ``port`` (a restart takes the same one)."""
    ready = tmp / f"{name}.port"
    ready.unlink(missing_ok=True)
    command = cli_command(
        "serve", "--engine", "reference", "--model", str(model_dir), "--port", str(port), "--port-file", str(ready)
    )
    return spawn_process(command, ready_file=ready, log=tmp / f"{name}.log", env=ENV, name=name)


@pytest.fixture
def model_dir(tmp_path: Path, make_tiny_llama: Any, smollm2_tokenizer: Any) -> Path:
    d = tmp_path / "tiny"
    make_tiny_llama(seed=0).save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def fleet(model_dir: Path, tmp_path: Path) -> Iterator[list[EngineProcess]]:
    engines = [start_engine(model_dir, free_port(), tmp_path, f"e{i}") for i in range(3)]
    yield engines
    stop_all(engines)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "catch_up", "stall_s"), [("gather", "broadcast", 0.0), ("direct", "shared_memory", STALL_S)]
)
def test_an_engine_killed_mid_sync_is_left_out_and_caught_up_after_its_restart(
    mode: str, catch_up: str, stall_s: float, model_dir: Path, fleet: list[EngineProcess], tmp_path: Path
) -> None:
    """``stall_s``: another engine is stopped (SIGSTOP) that long from the kill on, past the group timeout, so
    that trainer rank 0 waits on it (its Cancel) longer than a collective may take while the other rank waits
    for rank 0's next round: the ranks' rounds outlast rank 0's waits on the engines."""
    targets = [e.target for e in fleet]
    go = tmp_path / "catch-up"
    ranks = start_ranks(
        targets,
        *("--model", str(model_dir), "--steps", "2", "--modes", mode, "--min-engines", "2"),
        *("--bucket-bytes", str(512 << 10), "--progress", "--bucket-delay", str(BUCKET_DELAY_S)),
        *("--check", "checksums", "--catch-up-after", str(go), "--catch-up-transport", catch_up),
        *(("--group-timeout-s", str(GROUP_TIMEOUT_S), "--rpc-timeout-s", str(RPC_TIMEOUT_S)) if stall_s else ()),
    )
    first, second = (f"step-{s}-{mode}" for s in (1, 2))
    with explained(ranks):
        for r in ranks:
            synced = r.wait_for("synced", version=first)
            assert synced["engines"] == sorted(targets) and synced["attempts"] == 1, synced
        # The step's sync is under way: its first bucket is out, and rank 0 sleeps before its next one.
        ranks[0].wait_for("bucket", version=second, sent=1)
        victim, stalled = fleet[2], fleet[1]
        if stall_s:
            stalled.process.send_signal(signal.SIGSTOP)
        victim.kill()
        if stall_s:
            try:
                time.sleep(stall_s)
            finally:
                stalled.process.send_signal(signal.SIGCONT)
        for r in ranks:  # both ranks ran the update again over the two others, and got rank 0's result
            synced = r.wait_for("synced", version=second)
            assert synced["engines"] == sorted(targets[:2]), synced
            assert synced["excluded"] == [victim.target] and synced["attempts"] == 2, synced
        checked = ranks[0].wait_for("checked", version=second)
        assert checked["failures"] == [], checked  # bit-exact on the two that took part
        fleet[2] = start_engine(model_dir, int(victim.target.rsplit(":", 1)[1]), tmp_path, "e2-restarted")
        go.touch()
        for r in ranks:
            caught = r.wait_for("caught_up")
            assert caught["engines"] == [fleet[2].target], caught
            # Through shared memory no group was formed for it; by broadcast, one for it alone.
            assert (caught["init_seconds"] > 0) == (catch_up == "broadcast"), caught
        checked = [e for e in ranks[0].events if e["event"] == "checked" and e["version"] == second][-1]
        assert checked["failures"] == [], checked  # all three, the restarted one included, bit-exact
        codes = [r.wait(LONG) for r in ranks]
        assert codes == [0, 0], [r.stderr for r in ranks]
        if catch_up == "shared_memory":
            assert segments_held(fleet[2].pid) == 0  # the restarted engine's worker unmapped both ranks' rings
