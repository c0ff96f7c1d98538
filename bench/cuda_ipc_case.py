"""The CUDA IPC case of the benchmarks, run on a machine with one GPU: ``make gpu-bench``
(``python -m bench.cuda_ipc_case --out FILE``), then ``python -m bench.report_cuda_ipc FILE`` here to put it in
``bench/results.json`` and ``BENCHMARKS.md``.

``make bench`` cannot run it on a host without a GPU: its figures are those of the last GPU run merged, with the
device they came from. It needs what :mod:`wsync_grpc.tools.cuda_ipc_check` needs (that module's packages, from a
plain checkout with ``PYTHONPATH=.:generated``), and :func:`bench.colocated_case.p95`.

One engine (``wsync serve --engine reference --device cuda:0 --dtype bfloat16``, another process, serving the
check's model: SmolLM2-135M's shapes, randomly initialized, 269 MB in bfloat16) and the trainer (this process, the
same model on the same GPU). Per configuration of the client (:data:`CONFIGS`) and apply mode, :data:`SYNCS` syncs
by ``transport="cuda_ipc"``, every tensor changed before each, the last one checked bit-exact against the engine's
``GetWeightChecksums``; the first sync of a configuration is kept apart (the engine opens the trainer's ring then),
the others give the median, p95 and max of each phase of
:class:`~wsync_grpc.trainer.results.SyncResult`. The ceiling: a device-to-device copy of the same bytes
(``Tensor.copy_``, median of :data:`~wsync_grpc.tools.cuda_ipc_check.COPY_REPEATS`).

Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "one bucket": {"ramp_bytes": 0},
    "16 MiB buckets": {"bucket_bytes": 16 << 20, "ramp_bytes": 0},
    "digests": {"digests": True},
}
"""The client's settings of each configuration (``TrainerClient`` keywords): its defaults on a GPU (1 GiB buckets,
ramped from 32 MiB; no digests), one bucket (no ramp), 16 MiB buckets, and the defaults with bucket digests
(hashed on the host: each bucket copied there on both sides)."""

MODES: tuple[Literal["streaming", "staged"], ...] = ("streaming", "staged")
"""The apply modes, each run per configuration."""

SYNCS = 6
"""Syncs per configuration and mode, the first kept apart."""

PHASES = ("plan", "prepare", "broadcast", "pack", "verify", "complete", "total")
"""The :class:`~wsync_grpc.trainer.results.SyncResult` times recorded (``<phase>_seconds``), seconds."""


def _spread(xs: list[float]) -> dict[str, float]:
    """Median, p95 (:func:`bench.colocated_case.p95`) and max of ``xs``."""
    from bench.colocated_case import p95

    return {"median": statistics.median(xs), "p95": p95(xs), "max": max(xs)}


def run(workdir: Path, device_name: str = "cuda:0", transport: str = "cuda_ipc") -> dict[str, Any]:
    """The case (see the module); its results. ``device_name`` and ``transport`` are the case's (``"cuda:0"``,
    ``"cuda_ipc"``); another pair (``"cpu"``, ``"shared_memory"``) runs the same steps on a host without a GPU, to
    check the script itself.

    Raises:
        RuntimeError: the engine failed, or a configuration's last sync was not bit-exact.
    """
    import torch

    from wsync_grpc.tools import cuda_ipc_check as check
    from wsync_grpc.trainer import TrainerClient

    with check.colocated_pair(workdir, device_name) as (model, target):
        configs: dict[str, Any] = {}
        nbytes = 0
        for name, settings in CONFIGS.items():
            with TrainerClient([target], device=device_name, **settings) as client:
                for mode in MODES:
                    syncs = []
                    for i in range(SYNCS):
                        check.next_version(model)
                        r = client.sync(
                            model.named_parameters(),
                            f"{name}-{mode}-{i}",
                            apply_mode=mode,
                            transport=transport,  # type: ignore[arg-type]
                        )
                        syncs.append({p: getattr(r, f"{p}_seconds") for p in PHASES} | {"buckets": r.bucket_count})
                        nbytes = r.payload_bytes
                    check.check_served(client, target, model, f"{name}, {mode}")
                    configs[f"{name}/{mode}"] = {
                        "settings": settings,
                        "mode": mode,
                        "buckets": syncs[-1]["buckets"],
                        "first": syncs[0],
                        "steady": {p: _spread([s[p] for s in syncs[1:]]) for p in PHASES},
                        "bit_exact": True,
                    }
                    print(f"{name}, {mode}: {configs[f'{name}/{mode}']['steady']['total']}", flush=True)
        copy_s = check.copy_seconds(nbytes, torch.device(device_name))
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if device_name.startswith("cuda") else device_name,
        "transport": transport,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bytes": nbytes,
        "tensors": len(list(model.parameters())),  # the tied output embedding once, as a sync sends it
        "copy_seconds": copy_s,
        "syncs": SYNCS,
        "configs": configs,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the case and write its results as JSON to ``--out``; exit status 0, or 4 without a CUDA device."""
    parser = argparse.ArgumentParser(prog="cuda_ipc_case", description="The CUDA IPC benchmark, on one GPU.")
    parser.add_argument("--out", type=Path, required=True, help="the results' JSON file")
    parser.add_argument("--cpu", action="store_true", help="check the script on a host without a GPU (shared memory)")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("cuda_ipc_case: no CUDA device: torch.cuda.is_available() is false (it needs one GPU)", file=sys.stderr)
        return 4
    with tempfile.TemporaryDirectory(prefix="wsync-cuda-ipc-case-") as tmp:
        results = run(Path(tmp), *(("cpu", "shared_memory") if args.cpu else ()))
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
