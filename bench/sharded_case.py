"""The sharded-trainer case of the benchmarks: FSDP2 ranks syncing into one engine, each way side by side.

One reference engine process serving SmolLM2-135M (fp32, 538 MB) and, for M = 1 and 2, M trainer
ranks (:mod:`bench.sharded_rank`, real FSDP2 over gloo on this host) that run, in every repetition
and back to back: the raw gloo broadcast of the same bytes between the ranks (the ceiling, M >= 2),
the ``gather`` and ``direct`` modes of :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient`,
and the way users do it today (``gather_all``: every parameter gathered, then one sync). Each rank
reports, per run, the wall time (seconds), its peak memory above its resident memory before the
run (bytes) and the bytes it sent (bytes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wsync_grpc.group.process_group import free_port
from wsync_grpc.testing import spawn_engine

ROOT = Path(__file__).resolve().parent.parent


def _run_ranks(target: str, world: int, reps: int, bucket_bytes: int) -> list[dict[str, Any]]:
    """Start ``world`` ranks of :mod:`bench.sharded_rank`, wait for them; their JSON lines."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.sharded_rank", f"--rank={r}", f"--world={world}",
             f"--master-port={port}", f"--target={target}", f"--reps={reps}", f"--bucket-bytes={bucket_bytes}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a sharded benchmark rank failed ({p.returncode}): {err[-3000:]}")
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def case_sharded(reps: int, bucket_bytes: int = 32 << 20) -> dict[str, Any]:
    """Run the case; ``{"rows": [...], "date": ...}`` (one row per way, rank count, rank and repetition)."""
    tmp = Path(tempfile.mkdtemp(prefix="wsync-bench-sharded-"))
    engine = spawn_engine(["--engine", "reference"], port_file=tmp / "port", log=tmp / "engine.log", name="ref")
    try:
        rows: list[dict[str, Any]] = []
        for world in (1, 2):
            print(f"[{time.strftime('%H:%M:%S')}] sharded: {world} trainer rank(s)", flush=True)
            rows += _run_ranks(engine.target, world, reps, bucket_bytes)
    finally:
        engine.stop()
    return {"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "bucket_bytes": bucket_bytes}
