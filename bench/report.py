"""Turn the suite's results into ``BENCHMARKS.md``, the PASS/FAIL checks and the plots.

The prose is ``bench/report_template.md``, filled with figures computed from
``results.json`` (:mod:`bench.report_prose`, :mod:`bench.report_analysis`);
tables come from :mod:`bench.report_tables`, targets from
:mod:`bench.report_checks`, plots from :mod:`bench.report_plots`. Every
figure is the median over the repetitions with (min-max); a ratio to the
ceiling is taken per repetition, between a wsync run and the ceiling run
made just before it, and its median reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import (
    digest_case,
    report_colocated,
    report_cuda_ipc,
    report_delta,
    report_detection,
    report_disk,
    report_fleet,
    report_ray,
    report_sharded,
    report_vllm,
    report_vllm_tail,
)
from bench import report_prose as prose
from bench.report_analysis import missed
from bench.report_checks import Check, checks
from bench.report_plots import plots
from bench.report_stats import cores
from bench.report_text import fill

__all__ = ["Check", "checks", "markdown", "plots", "write"]


def markdown(results: dict[str, Any], cks: list[Check]) -> str:
    """The full ``BENCHMARKS.md``: the sections the run has, in order, separated by blank lines."""
    parts = [prose.header(results), prose.method(), prose.machine(results), prose.targets(cks)]
    if "models" in results:
        parts.append(prose.models(results))
    if "moe" in results:
        parts.append(prose.many_tensors(results))
    if "fanout" in results:
        parts.append(prose.fanout(results))
    if "control" in results:
        parts.append(prose.control(results))
    if "models" in results:
        parts.append(prose.memory(results))
        if any(m.get("sweep") for m in results["models"].values()):
            parts.append(prose.sweep(results))
    if results.get("fleet"):
        parts.append(report_fleet.section(results["fleet"], cores(results)))
    if results.get("disk"):
        parts.append(report_disk.section(results["disk"]))
    if results.get("digests"):
        parts.append(digest_case.section(results["digests"]))
    if results.get("sharded"):
        parts.append(report_sharded.section(results["sharded"]))
    if results.get("detection"):
        parts.append(report_detection.section(results["detection"]))
    if results.get("profile"):
        parts.append(prose.profile(results))
    if results.get("vllm"):
        parts.append(report_vllm.section(results["vllm"]))
    if results.get("vllm_tail"):
        parts.append(report_vllm_tail.section(results["vllm_tail"]))
    if results.get("colocated"):
        parts.append(report_colocated.section(results["colocated"]))
    if results.get("cuda_ipc"):
        parts.append(report_cuda_ipc.section(results["cuda_ipc"]))
    if results.get("delta"):
        parts.append(report_delta.section(results["delta"]))
    if results.get("ray"):
        parts.append(report_ray.section(results["ray"]))
    analysis = missed(results, cks)
    if analysis:
        parts.append(fill("s8", analysis="\n\n".join(analysis)))
    parts.append(prose.reproduce(results))
    return "\n\n".join(parts) + "\n"


def write(results: dict[str, Any], out: Path, plot_dir: Path) -> list[Check]:
    """Write ``out`` (markdown) and the plots; return the checks."""
    cks = checks(results)
    plots(results, plot_dir)
    out.write_text(markdown(results, cks))
    return cks
