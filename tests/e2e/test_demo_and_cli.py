"""The main job and the command line, run as a user runs them (separate processes).

The demos start engines of their own: starting them, and shutting them down cleanly on SIGTERM, is part of
what ``make demo`` (and ``demo-fsdp``, ``demo-vllm``) promises, so they cannot use the shared engines.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ENV, ROOT, join_as_trainer, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.group.process_group import free_port
from wsync_grpc.testing import spawn_engine

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
def test_demo_one_step_syncs_smollm2_into_two_engines(transport: str) -> None:
    steps = "2" if transport == "broadcast" else "1"  # the second step's sync is a delta
    r = subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.demo", "--steps", steps, "--transport", transport],
        capture_output=True,
        text=True,
        timeout=540,
        env=ENV,
        cwd=ROOT,
    )
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    assert f"all checks passed: {steps} steps synced into 2 engines, bit-exact" in out
    assert out.count("all 272 tensor checksums match") == 2 * int(steps)
    assert out.count("greedy (step-1): same") == 2
    assert out.count("stopped (exit 0)") == 2  # engines shut down cleanly on SIGTERM
    assert re.search(r"sync step-1: \d+ buckets, 269\.0 MB to 2 engines", out), out[-3000:]  # bfloat16, whole
    assert "step-1: sent whole, 269.0 MB" in out
    if steps == "2":
        assert out.count("greedy (step-2): same") == 2
        delta = re.search(r"step-2: delta against step-1: ([\d.]+) MB of 269\.0 MB whole, saved ([\d.]+) MB", out)
        assert delta is not None, out[-3000:]
        sent, saved = float(delta.group(1)), float(delta.group(2))
        assert 0 < sent < 269.0 / 2 and abs(sent + saved - 269.0) < 0.2, delta.group(0)
    phases = re.search(r"phases \(s\): plan [\d.]+, prepare ([\d.]+), broadcast ([\d.]+), verify ([\d.]+), apply", out)
    assert phases is not None, out[-3000:]


@pytest.mark.slow
def test_demo_fsdp_two_ranks_train_and_sync_into_two_engines() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.demo_fsdp", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=540,
        env=ENV,
        cwd=ROOT,
    )
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    assert "all checks passed: 2 FSDP2 ranks, 2 steps, modes gather,direct, 2 engines, bit-exact" in out
    for step in (1, 2):  # once in each mode: both ranks return the sync's result; rank 0 checked both engines
        for mode in ("gather", "direct"):
            for rank in (0, 1):
                assert re.search(rf"rank {rank}: step-{step}-{mode}: loss [\d.]+, \d+ buckets, 538\.1 MB", out), out
            assert f"rank 0: step-{step}-{mode}: checksums and greedy answers match on every engine" in out
    losses = [float(x) for x in re.findall(r"rank 0: step-\d-gather: loss ([\d.]+)", out)]
    assert losses[1] < losses[0]  # the ranks really train
    assert out.count("stopped (exit 0)") == 2


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_vllm_two_steps_into_two_vllm_engines() -> None:
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    r = subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.demo_vllm", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=580,
        env=ENV,
        cwd=ROOT,
    )
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    assert "all checks passed: 2 steps synced into 2 vLLM engines, bit-exact" in out
    assert out.count("all 272 checksums match (bfloat16)") == 4
    first = re.search(r"first answer: (.*)", out)
    last = re.search(r"last answer:  (.*)", out)
    assert first and last and first.group(1) != last.group(1)


def _wsync(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_cli_serve_status_pause_resume_and_sigterm(tmp_path: Path) -> None:
    """An engine of its own: the test ends it with SIGTERM."""
    engine = spawn_engine(
        ["--synthetic", "tiny"], port_file=tmp_path / "port", log=subprocess.PIPE, env=ENV, timeout_s=60
    )
    proc = engine.process
    try:
        target = engine.target
        st = json.loads(_wsync("status", "--target", target).stdout)
        assert st["state"] == "LIFECYCLE_STATE_UNINITIALIZED" and st["paused"] is False
        assert st["engine"]["tensor_count"] == 20
        paused = json.loads(_wsync("pause", "--mode", "keep", "--target", target).stdout)
        assert paused["mode"] == "PAUSE_MODE_KEEP" and paused["already_paused"] is False
        again = json.loads(_wsync("pause", "--mode", "keep", "--target", target).stdout)
        assert again["already_paused"] is True  # idempotent
        assert json.loads(_wsync("status", "--target", target).stdout)["paused"] is True
        resumed = json.loads(_wsync("resume", "--target", target).stdout)
        assert resumed["was_paused"] is True
        bad = _wsync("leave", "--target", "127.0.0.1:1", "--timeout", "2")
        assert bad.returncode == 1 and "UNAVAILABLE" in bad.stderr
        sums = json.loads(_wsync("checksums", "model.norm.weight", "--target", target).stdout)
        assert len(sums["checksums"][0]["sha256"]) == 64
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, out
        assert "listening on 127.0.0.1:" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_cli_watch_shows_engines_and_the_update_in_flight() -> None:
    """``wsync watch`` over two engines: one line per engine per round, the update's buckets as they arrive,
    and an engine that does not answer named without stopping the others."""
    with tensor_server("tiny") as (srv, _, stub):
        trainer = join_as_trainer(stub)
        try:
            spec = pb.BucketSpec(index=0, size_bytes=128)
            spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64], offset_bytes=0)
            header = pb.PrepareHeader(weight_version="step-7", bucket_count=1, total_bytes=128)
            stub.Prepare(iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=10)
            dead = f"127.0.0.1:{free_port('127.0.0.1')}"
            r = _wsync("watch", srv.address, dead, "--count", "2", "--interval", "0.1", "--json", "--timeout", "3")
            assert r.returncode == 0, r.stderr
            lines = [json.loads(x) for x in r.stdout.splitlines()]
            assert [x["target"] for x in lines] == [srv.address, dead] * 2
            live = lines[0]
            assert live["state"] == "LIFECYCLE_STATE_RECEIVING"
            assert live["update"]["weight_version"] == "step-7" and live["update"]["buckets_expected"] == 1
            assert lines[1]["error"] == "UNAVAILABLE"
            people = _wsync("watch", srv.address, "--count", "1")
            assert people.returncode == 0, people.stderr
            line = people.stdout.strip()
            assert line.startswith(srv.address) and "RECEIVING" in line and "update=step-7 0/1 buckets" in line
            bars = _wsync("watch", srv.address, "--bars", "--count", "2", "--interval", "0.1")
            assert bars.returncode == 0, bars.stderr
            assert f"{srv.address} RECEIVING version=- update=step-7 0/1 buckets" in bars.stdout, bars.stdout
            assert "0.00/128B" in bars.stdout or "0/128" in bars.stdout, bars.stdout  # the bytes, as a bar
        finally:
            stub.Cancel(pb.CancelRequest(), timeout=10)
            trainer.destroy()  # type: ignore[attr-defined]
