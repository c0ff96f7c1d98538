"""The CUDA IPC benchmark's report (``bench/report_cuda_ipc.py``): a GPU run's results merged into the stored ones
keep every other case, render their section and target, and a configuration that was not bit-exact fails it.

Results shaped as :func:`bench.cuda_ipc_case.run` writes them; times in seconds, sizes in bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench import cuda_ipc_case, report_cuda_ipc

ROOT = Path(__file__).resolve().parents[2]


def config(total: float, exact: bool = True) -> dict[str, Any]:
    phases = {p: total / 10 for p in cuda_ipc_case.PHASES} | {"total": total}
    return {
        "settings": {}, "mode": "streaming", "buckets": 6, "bit_exact": exact,
        "first": phases | {"buckets": 6},
        "steady": {p: {"median": v, "p95": v, "max": v} for p, v in phases.items()},
    }  # fmt: skip


def run(*configs: dict[str, Any]) -> dict[str, Any]:
    return {
        "date": "2026-11-27", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0",
        "transport": "cuda_ipc", "bytes": 269030016, "tensors": 272, "copy_seconds": 2e-4, "syncs": 6,
        "configs": {f"c{i}/streaming": c for i, c in enumerate(configs)},
    }  # fmt: skip


def test_a_configuration_that_is_not_bit_exact_fails_the_target() -> None:
    assert [ok for _, _, ok in report_cuda_ipc.checks(run(config(0.03), config(0.04)))] == [True]
    [(target, measured, ok)] = report_cuda_ipc.checks(run(config(0.03), config(0.04, exact=False)))
    assert not ok and measured == "1 of 2 configurations" and "NVIDIA H100" in target


def test_a_gpu_run_merged_keeps_the_other_cases_and_is_reported(tmp_path: Path) -> None:
    shutil.copy(ROOT / "bench" / "results.json", tmp_path / "results.json")
    before = json.loads((tmp_path / "results.json").read_text())
    (tmp_path / "gpu.json").write_text(json.dumps(run(config(0.032))))
    out = tmp_path / "BENCHMARKS.md"
    assert report_cuda_ipc.main([str(tmp_path / "gpu.json"), "--out", str(out), "--plots", str(tmp_path)]) == 0
    after = json.loads((tmp_path / "results.json").read_text())
    assert {k: v for k, v in after.items() if k != "cuda_ipc"} == {k: v for k, v in before.items() if k != "cuda_ipc"}
    text = out.read_text()
    section = text[text.index("## CUDA IPC on one GPU") :]
    assert "| c0 | streaming | 6 | 32.0 (32.0, 32.0) |" in section and "| 8.4 | 0.006 |" in section
    assert "CUDA IPC on one GPU (NVIDIA H100 80GB HBM3): every configuration's syncs bit-exact | 1 of 1" in text
