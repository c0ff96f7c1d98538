"""The delta case of the benchmarks: real training synced as deltas against the same steps synced whole.

The trainer (this process) trains SmolLM2-135M-Instruct in float32 with AdamW on the few KB of real text the tests
ship (``tests/data/train_text.txt``, 256-token windows), at each learning rate of ``lrs`` for ``steps`` steps,
from the same initial weights. Three engine processes serve SmolLM2-135M's shapes in bfloat16 (the tensor engine of
``wsync serve --synthetic``: :mod:`bench.engine`); after each step the same weights are synced, back to back, in
an order rotated per step, to one engine by a client with deltas on (its defaults: it falls back to whole syncs
while deltas cost more, ``delta_fallback``), to another by a client that sends a delta at every sync
(``delta_fallback=False``: the "forced" delta) and to the third by a client without (bfloat16 on the wire, the
clients' default digests): so every step has its delta and its whole sync, side by side, on the same processes.
Step 0 (the initial weights) is whole on all three and not reported.

Per step: the share of elements whose bfloat16 value changed, the wire bytes of both, the delta's values and
positions bytes, the limit (the changed values plus one byte of position each), and each sync's time split
into the trainer's diff (copy to bfloat16 and encode: :attr:`~wsync_grpc.trainer.results.DeltaSummary.diff_seconds`)
and the sync's phases (prepare, broadcast, verify: the engine rebuilding and checking, apply).

Last, if ``vllm_rounds``: one vLLM engine (``wsync serve --engine vllm``, SmolLM2-135M-Instruct served in
bfloat16) and a client with deltas on whose every other sync is whole (``delta_anchor_every=1``; no fallback): the
float32 checkpoint with about 1% of every matrix moved before each sync, staged, while a request streams tokens;
per sync, its wall time and the tokens/s and longest gap between two tokens of the stream during it, delta against
whole.

Then, if ``link_steps`` (root and ``ip netns`` needed; recorded as not run otherwise): the same training at lr
1e-6 for that many steps, the two engines each in a network namespace of its own (``wsync serve --synthetic``
there), reached over a veth pair whose host side is rate-limited by ``tc`` (a token bucket of ``LINK_RATE``),
as between hosts on a slower link: per step, the delta and the whole sync's time over it.

Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wsync_grpc.trainer import SyncResult, TrainerClient

if TYPE_CHECKING:
    from bench.run import Harness

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "train_text.txt"
WINDOW = 256
"""Tokens per training step."""


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _timing(r: SyncResult) -> dict[str, Any]:
    """A sync's bytes and phases (seconds); a delta's diff and entry sizes."""
    d = r.delta
    return {
        "wire_bytes": r.wire_bytes,
        "total_s": r.total_seconds,
        "diff_s": d.diff_seconds if d is not None else 0.0,
        "phases": r.phases,
        "delta": bool(d is not None and d.base_version),
        "values_bytes": d.values_bytes if d is not None else 0,
        "positions_bytes": d.positions_bytes if d is not None else 0,
        "changed": d.changed_elements if d is not None else 0,
        "elements": d.total_elements if d is not None else 0,
        "whole_bytes": d.whole_bytes if d is not None else r.payload_bytes,
        "fell_back": bool(d is not None and d.fell_back),
    }


def _vllm(rounds: int) -> dict[str, Any]:
    """The vLLM part (see the module docstring): ``{"syncs": [{"delta", "wall_s", "tokens_per_s", "max_gap_s",
    "wire_bytes"}, ...]}``, the first two (whole, then delta) a warm-up kept apart."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from bench.vllm_case import STREAM_TOKENS, _during, _engine
    from wsync_grpc.engines.models import ensure_smollm2_dir
    from wsync_grpc.testing_vllm import GenerateStream

    model_dir = ensure_smollm2_dir()
    state = load_file(str(model_dir / "model.safetensors"))
    ids = list(AutoTokenizer.from_pretrained(str(model_dir))("The history of the printing press")["input_ids"])
    g = torch.Generator().manual_seed(0)
    syncs: list[dict[str, Any]] = []
    with (
        _engine(model_dir) as (proc, http),
        TrainerClient([proc.target], group_timeout_s=120, delta=True, delta_anchor_every=1, delta_fallback=False) as c,
    ):
        for i in range(2 * rounds + 2):
            for t in state.values():
                if t.dim() == 2:
                    t[torch.rand(t.shape, generator=g) < 0.01] += 0.02 * t.std()
            stream = GenerateStream(http, str(model_dir), ids, STREAM_TOKENS // 4)
            stream.start()
            while len(stream.arrivals) < 10 and stream.is_alive():
                time.sleep(0.005)
            start = time.monotonic()
            r = c.sync(state.items(), f"vllm-{i}", dtype=torch.bfloat16)
            end = time.monotonic()
            stream.join(600)
            d = r.delta
            syncs.append(
                {
                    "delta": bool(d is not None and d.base_version),
                    "wall_s": end - start,
                    "wire_bytes": r.wire_bytes,
                    "phases": r.phases,
                    "total_s": r.total_seconds,
                    "init_s": r.init_seconds,
                    "diff_s": d.diff_seconds if d is not None else 0.0,
                    **_during(stream.arrivals, start, end),
                }
            )
            _say(
                f"delta vllm sync {i}: {'delta' if syncs[-1]['delta'] else 'whole'}, {end - start:.2f} s, "
                f"{syncs[-1]['tokens_per_s']:.1f} tokens/s"
            )
    return {"syncs": syncs, "warmup": 2}


LINK_RATE = "2gbit"
"""The rate of the rate-limited link (``tc`` token bucket on the host's side of each veth pair)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@contextlib.contextmanager
def _namespaces(count: int) -> Iterator[list[tuple[str, str, str]]]:
    """``count`` network namespaces, each with a rate-limited veth pair to the host: ``(namespace, host address,
    namespace address)``; all removed at the end."""
    run = secrets.token_hex(2)
    net = 200 + secrets.randbelow(50)
    made: list[tuple[str, str]] = []
    out: list[tuple[str, str, str]] = []
    try:
        for i in range(count):
            ns, host_if, ns_if = f"wsync-bench-{run}-{i}", f"wb{run}h{i}", f"wb{run}n{i}"
            prefix = f"10.{net}.{i}"
            _ip("netns", "add", ns)
            made.append((ns, host_if))
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns)
            _ip("addr", "add", f"{prefix}.1/24", "dev", host_if)
            _ip("link", "set", host_if, "up")
            _ip("-n", ns, "addr", "add", f"{prefix}.2/24", "dev", ns_if)
            _ip("-n", ns, "link", "set", ns_if, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"{prefix}.1")
            subprocess.run(
                [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    host_if,
                    "root",
                    "tbf",
                    "rate",
                    LINK_RATE,
                    "burst",
                    "1mb",
                    "latency",
                    "100ms",
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )
            out.append((ns, f"{prefix}.1", f"{prefix}.2"))
        yield out
    finally:
        for ns, host_if in made:
            _ip("link", "del", host_if, check=False)
            _ip("netns", "del", ns, check=False)


def _link(
    h: Harness, directory: Path, initial: dict[str, torch.Tensor], ids: torch.Tensor, steps: int
) -> dict[str, Any]:
    """The rate-limited link part (see the module docstring): ``{"rate", "rows": [{"delta", "whole"}, ...]}``."""
    from transformers import AutoModelForCausalLM

    from wsync_grpc.testing import child_env, cli_command, spawn_process, stop_all, wait_all

    if shutil.which("ip") is None or shutil.which("tc") is None or os.geteuid() != 0:
        return {"error": "needs root, ip and tc"}
    rows: list[dict[str, Any]] = []
    with _namespaces(2) as links:
        procs = []
        try:
            for i, (ns, host, addr) in enumerate(links):
                port_file = h.tmp / f"link-engine-{i}.port"
                command = cli_command(
                    "serve",
                    "--synthetic",
                    "smollm2-shapes",
                    "--dtype",
                    "bfloat16",
                    "--host",
                    addr,
                    "--port",
                    "0",
                    "--port-file",
                    str(port_file),
                    "--insecure",
                    "--allow-master",
                    f"{host}/32",
                )
                procs.append(
                    spawn_process(
                        ["ip", "netns", "exec", ns, *command],
                        ready_file=port_file,
                        log=h.tmp / f"link-engine-{i}.log",
                        env=child_env(),
                        cwd=ROOT,
                        wait=False,
                        name=f"link-engine-{i}",
                        host=addr,
                    )
                )
            wait_all(procs)
            model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
            model.load_state_dict(initial)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            with (
                TrainerClient([procs[0].target], master_address="auto", delta=True, rpc_timeout_s=300) as delta,
                TrainerClient([procs[1].target], master_address="auto", rpc_timeout_s=300) as whole,
            ):
                clients = {"delta": delta, "whole": whole}
                for c in clients.values():
                    c.sync(model.named_parameters(), "link-0", dtype=torch.bfloat16)
                for step in range(1, steps + 1):
                    start = (WINDOW // 2 * step) % max(1, ids.numel() - WINDOW)
                    window = ids[start : start + WINDOW].unsqueeze(0)
                    model(input_ids=window, labels=window).loss.backward()
                    opt.step()
                    opt.zero_grad()
                    row: dict[str, Any] = {"step": step}
                    for way in ("delta", "whole") if step % 2 else ("whole", "delta"):
                        r = clients[way].sync(model.named_parameters(), f"link-{step}", dtype=torch.bfloat16)
                        row[way] = _timing(r)
                    rows.append(row)
                    _say(
                        f"delta over {LINK_RATE} step {step}: {row['delta']['total_s'] + row['delta']['diff_s']:.2f} s "
                        f"against {row['whole']['total_s']:.2f} s"
                    )
        finally:
            stop_all(procs, grace_s=3)
    return {"rate": LINK_RATE, "rows": rows}


def case_delta(
    h: Harness, steps: int, lrs: Sequence[float], vllm_rounds: int = 0, link_steps: int = 0
) -> dict[str, Any]:
    """Run the case (see the module docstring); returns ``{"steps", "lrs": {lr: [row per step]}, "vllm"}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wsync_grpc.engines.models import ensure_smollm2_dir

    directory = ensure_smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt")["input_ids"][0]
    initial = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).state_dict()
    initial = {k: v.clone() for k, v in initial.items()}
    engines = h.start_engines("smollm2-shapes", 3, dtype="bfloat16")
    out: dict[str, Any] = {"steps": steps, "lrs": {}, "tokens": int(ids.numel()), "window": WINDOW}
    try:
        for lr in lrs:
            model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
            model.load_state_dict(initial)
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            rows: list[dict[str, Any]] = []
            with (
                TrainerClient([engines[0].grpc], delta=True, rpc_timeout_s=120) as delta,
                TrainerClient([engines[1].grpc], delta=True, delta_fallback=False, rpc_timeout_s=120) as forced,
                TrainerClient([engines[2].grpc], rpc_timeout_s=120) as whole,
            ):
                clients = {"delta": delta, "forced": forced, "whole": whole}
                for c in clients.values():
                    c.sync(model.named_parameters(), f"lr{lr:g}-0", dtype=torch.bfloat16)
                for step in range(1, steps + 1):
                    start = (WINDOW // 2 * step) % max(1, ids.numel() - WINDOW)
                    window = ids[start : start + WINDOW].unsqueeze(0)
                    t0 = time.monotonic()
                    loss = model(input_ids=window, labels=window).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    train_s = time.monotonic() - t0
                    row: dict[str, Any] = {"step": step, "loss": float(loss), "train_s": train_s}
                    ways = ("delta", "forced", "whole")
                    for way in ways[step % 3 :] + ways[: step % 3]:  # each client first, second and last in turn
                        r = clients[way].sync(model.named_parameters(), f"lr{lr:g}-{step}", dtype=torch.bfloat16)
                        row[way] = _timing(r)
                    rows.append(row)
                    d = row["delta"]
                    _say(
                        f"delta lr {lr:g} step {step}: {100 * d['changed'] / max(1, d['elements']):.2f}% changed, "
                        f"{d['wire_bytes'] / 1e6:.1f} MB of {row['whole']['wire_bytes'] / 1e6:.1f} MB, "
                        f"{d['total_s']:.2f} s (+{d['diff_s']:.2f} s diff) against {row['whole']['total_s']:.2f} s"
                    )
            out["lrs"][f"{lr:g}"] = rows
    finally:
        h.stop(engines)
    if link_steps:
        try:
            out["link"] = _link(h, directory, initial, ids, link_steps)
        except Exception as e:  # recorded: the report says what stopped it
            out["link"] = {"error": repr(e)[:400]}
    if vllm_rounds:
        try:
            out["vllm"] = _vllm(vllm_rounds)
        except Exception as e:  # recorded: the report says what stopped it
            out["vllm"] = {"error": repr(e)[:400]}
    return out
