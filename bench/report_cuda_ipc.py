"""The CUDA IPC section of ``BENCHMARKS.md`` and its check (results of :mod:`bench.cuda_ipc_case`, run on a GPU).

``python -m bench.report_cuda_ipc FILE`` puts a GPU run's results (``make gpu-bench``'s ``GPU_BENCH_OUT``) into
``bench/results.json`` as its ``cuda_ipc`` case, keeping every other case, and writes ``BENCHMARKS.md`` and the plots
again (:func:`bench.report.write`). ``make bench`` keeps the case as it is: this host has no GPU to run it.

Times in seconds in the results, milliseconds in the table; GB/s are 10^9 bytes of weights per second of sync.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.report_stats import GB

PHASES = (("prepare", "Prepare"), ("broadcast", "transfer"), ("pack", "of it packing"), ("verify", "verify"))
"""The phases the table gives beside the total, and their columns' names."""


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def section(c: dict[str, Any]) -> str:
    """The markdown section: per configuration and apply mode, a sync's total and phases against the copy."""
    copy_s = c["copy_seconds"]
    lines = [
        "## CUDA IPC on one GPU",
        "",
        f"Run on a machine with one GPU by `make gpu-bench` (`bench/cuda_ipc_case.py`), not by `make bench`: "
        f"{c['device']}, PyTorch {c['torch']}, CUDA {c['cuda']}, on {c['date']}. One engine (`wsync serve --engine "
        "reference --device cuda:0 --dtype bfloat16`, another process) and the trainer on the same GPU, a model of "
        f"SmolLM2-135M's shapes in bfloat16 ({c['bytes'] / GB:.2f} GB, {c['tensors']} tensors); per configuration "
        f'and apply mode {c["syncs"]} syncs by `transport="cuda_ipc"`, every tensor changed before each, the last '
        "checked bit-exact against the engine's checksums. Times in ms: the median of the syncs after the first "
        "(p95, max), and the first apart (the engine opens the trainer's ring then). Transfer is the first bucket "
        "packed to the last acknowledged, packing the trainer's share of it; `x copy` is a device-to-device copy of "
        f"the same bytes ({_ms(copy_s)} ms, {c['bytes'] / copy_s / GB:.0f} GB/s) over the sync's median.",
        "",
        "| configuration | apply | buckets | sync ms (p95, max) | first ms | "
        + " | ".join(f"{name} ms" for _, name in PHASES)
        + " | complete ms | GB/s | x copy |",
        "|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|",
    ]
    for key, cfg in c["configs"].items():
        name = key.split("/")[0]
        s = cfg["steady"]
        total = s["total"]
        lines.append(
            f"| {name} | {cfg['mode']} | {cfg['buckets']} | {_ms(total['median'])} ({_ms(total['p95'])}, "
            f"{_ms(total['max'])}) | {_ms(cfg['first']['total'])} | "
            + " | ".join(_ms(s[p]["median"]) for p, _ in PHASES)
            + f" | {_ms(s['complete']['median'])} | {c['bytes'] / total['median'] / GB:.1f} | "
            f"{copy_s / total['median']:.3f} |"
        )
    d = c["configs"].get("defaults/streaming")
    if d is not None:
        s = d["steady"]
        control = s["prepare"]["median"] + s["complete"]["median"]
        lines += [
            "",
            f"At the defaults (streaming), the Prepare and Complete calls take {_ms(control)} ms of a "
            f"{_ms(s['total']['median'])} ms sync and the transfer {_ms(s['broadcast']['median'])} ms, of which "
            f"{_ms(s['pack']['median'])} ms is the trainer packing: the bytes themselves would cross the GPU's memory "
            f"in {_ms(copy_s)} ms. What is left is per tensor and per call, not per byte: each of the "
            f"{c['tensors']} tensors is copied into the ring and out of it by a copy of its own (a kernel launch and "
            "the Python around it, on both sides), and the Prepare and Complete calls are gRPC round trips to the "
            "engine process, as on CPU. Digests copy every bucket to the host on both sides to hash it, which is why "
            "the client leaves them off for tensors on a GPU.",
        ]
    return "\n".join(lines)


def checks(c: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)``: every configuration's last sync bit-exact on the GPU."""
    exact = [k for k, cfg in c["configs"].items() if cfg.get("bit_exact")]
    return [
        (
            f"colocated, CUDA IPC on one GPU ({c['device']}): every configuration's syncs bit-exact",
            f"{len(exact)} of {len(c['configs'])} configurations",
            len(exact) == len(c["configs"]),
        )
    ]


def main(argv: list[str] | None = None) -> int:
    """Merge a GPU run's results (see the module) and write the report; exit status 0."""
    from bench import report

    parser = argparse.ArgumentParser(prog="report_cuda_ipc", description="Put a GPU run's results in BENCHMARKS.md.")
    parser.add_argument("results", type=Path, help="make gpu-bench's GPU_BENCH_OUT")
    parser.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--plots", type=Path, default=Path("bench"))
    args = parser.parse_args(argv)
    stored = args.plots / "results.json"
    results = json.loads(stored.read_text())
    results["cuda_ipc"] = json.loads(args.results.read_text())
    stored.write_text(json.dumps(results, indent=1) + "\n")
    for ck in report.write(results, args.out, args.plots):
        if ck.kind == "cuda_ipc":
            print(f"{'PASS' if ck.passed else 'FAIL'}  {ck.target}: {ck.measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
