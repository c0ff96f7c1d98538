"""The delta case of the benchmarks: real training synced as deltas against the same steps synced whole.

The trainer (this process) trains SmolLM2-135M-Instruct in float32 with AdamW on the few KB of real text the tests
ship (``tests/data/train_text.txt``, 256-token windows), at each learning rate of ``lrs`` for ``steps`` steps,
from the same initial weights. Two engine processes serve SmolLM2-135M's shapes in bfloat16 (the tensor engine of
``wsync serve --synthetic``: :mod:`bench.engine`); after each step the same weights are synced, back to back, in
an order alternated per step, to one engine by a client with deltas on and to the other by a client without
(bfloat16 on the wire, the clients' default digests): so every step has its delta and its whole sync, side by
side, on the same processes. Step 0 (the initial weights) is whole on both and not reported.

Per step: the share of elements whose bfloat16 value changed, the wire bytes of both, the delta's values and
positions bytes, the limit (the changed values plus one byte of position each), and each sync's time split
into the trainer's diff (copy to bfloat16 and encode: :attr:`~wsync_grpc.trainer.results.DeltaSummary.diff_seconds`)
and the sync's phases (prepare, broadcast, verify: the engine rebuilding and checking, apply).

Not run here (yet): the same over a rate-limited link between network namespaces, and vLLM (whose workers take no
deltas yet). Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
    }


def case_delta(h: Harness, steps: int, lrs: Sequence[float]) -> dict[str, Any]:
    """Run the case (see the module docstring); returns ``{"steps", "lrs": {lr: [row per step]}}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wsync_grpc.engines.models import ensure_smollm2_dir

    directory = ensure_smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt")["input_ids"][0]
    initial = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).state_dict()
    initial = {k: v.clone() for k, v in initial.items()}
    engines = h.start_engines("smollm2-shapes", 2, dtype="bfloat16")
    out: dict[str, Any] = {"steps": steps, "lrs": {}, "tokens": int(ids.numel()), "window": WINDOW}
    try:
        for lr in lrs:
            model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
            model.load_state_dict(initial)
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            rows: list[dict[str, Any]] = []
            with (
                TrainerClient([engines[0].grpc], delta=True, rpc_timeout_s=120) as delta,
                TrainerClient([engines[1].grpc], rpc_timeout_s=120) as whole,
            ):
                clients = {"delta": delta, "whole": whole}
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
                    order = ("delta", "whole") if step % 2 else ("whole", "delta")
                    for way in order:
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
    return out
