"""The issue's targets and how a run measured against them (the report's PASS/FAIL table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench import (
    report_colocated,
    report_cuda_ipc,
    report_delta,
    report_detection,
    report_disk,
    report_fleet,
    report_sharded,
    report_vllm,
    report_vllm_tail,
)
from bench.report_stats import GB, label, med, mib, ratios, secs

LARGE_MODEL_BYTES = GB
"""Models of at least this size must reach :data:`LARGE_RATIO` of the ceiling."""
LARGE_RATIO = 0.90
"""Target for models of at least :data:`LARGE_MODEL_BYTES`: median paired ratio to the ceiling."""
SMALL_MODEL = "smollm2-shapes"
"""The small model with a target of its own."""
SMALL_RATIO = 0.75
"""Target for :data:`SMALL_MODEL`: median paired ratio to the ceiling."""
MOE_SPEEDUP = 3.0
"""Target for the many-tensor MoE, flattened layout: times faster than the naive way."""
PREPARE_LIMITS = {"dense-32b": 0.020, "moe-100k": 2.0}
"""Control-plane model -> target Prepare-to-ready time at the default bucket size, seconds."""
PEAK_BUCKETS = 2.5
"""Target for the streaming apply: engine peak extra memory / the largest planned bucket."""
MODES = ("streaming", "staged")
MOE_WAYS = ("flattened/streaming", "flattened/staged", "individual/staged")
"""The MoE case's wsync runs compared with the naive way."""


@dataclass(frozen=True)
class Check:
    """One target of issue 5 and how the run measured against it.

    ``kind`` (``ratio``, ``moe``, ``naive``, ``prepare`` or ``memory``) and
    ``model`` say what it is about, for the analysis of missed targets.
    """

    target: str
    measured: str
    passed: bool
    kind: str = ""
    model: str = ""


def _ratio_checks(models: dict[str, Any]) -> list[Check]:
    out = []
    for name, m in models.items():
        if m["bytes"] >= LARGE_MODEL_BYTES:
            want = LARGE_RATIO
        elif name == SMALL_MODEL:
            want = SMALL_RATIO
        else:
            continue
        for mode in MODES:
            ratio = med(ratios(m["runs"][mode]))
            target = f"{label(name)}, {mode}: >= {want:.2f} x ceiling"
            out.append(Check(target, f"{ratio:.2f} x", ratio >= want, "ratio", name))
    return out


def _moe_checks(moe: dict[str, Any]) -> list[Check]:
    out = []
    naive = med(secs(moe["runs"]["naive"]))
    for mode in MODES:
        t = med(secs(moe["runs"][f"flattened/{mode}"]))
        target = f"{label('moe-20k')}, flattened {mode}: >= {MOE_SPEEDUP:g} x faster than naive"
        out.append(Check(target, f"{naive / t:.1f} x", naive >= MOE_SPEEDUP * t, "moe", "moe-20k"))
    return out


def slower_than_naive(results: dict[str, Any]) -> tuple[list[tuple[str, str, float]], int]:
    """Every wsync way slower than the naive way, as (model, way, naive time / wsync time), and how many compared."""
    slower = []
    compared = 0
    cases: list[tuple[str, dict[str, Any], tuple[str, ...]]]
    cases = [(name, m["runs"], MODES) for name, m in results.get("models", {}).items()]
    if results.get("moe"):
        cases.append(("moe-20k", results["moe"]["runs"], MOE_WAYS))
    for name, runs, ways in cases:
        naive = med(secs(runs["naive"]))
        for way in ways:
            compared += 1
            t = med(secs(runs[way]))
            if t > naive:
                slower.append((name, way, naive / t))
    return slower, compared


def _naive_check(results: dict[str, Any]) -> list[Check]:
    slower, compared = slower_than_naive(results)
    if not compared:
        return []
    shown = ", ".join(f"{label(name)} {way} ({x:.2f} x)" for name, way, x in slower)
    measured = "slower on: " + shown if slower else f"faster in all {compared} comparisons"
    return [Check("wsync not slower than naive on any case", measured, not slower, "naive")]


def limit_text(limit: float) -> str:
    """A Prepare time limit as the targets show it: ``20 ms``, ``2 s``."""
    return f"{limit * 1e3:.0f} ms" if limit < 1 else f"{limit:.0f} s"


def _prepare_checks(results: dict[str, Any]) -> list[Check]:
    out = []
    control = results.get("control", {})
    default = str(results.get("default_bucket_bytes"))
    for name, limit in PREPARE_LIMITS.items():
        c = control.get(name)
        if c and default in c["by_bucket"]:
            t = med(c["by_bucket"][default]["runs"]["prepare"])
            shown = f"{t * 1e3:.1f} ms" if limit < 1 else f"{t:.2f} s"
            target = f"Prepare-to-ready, {c['tensors']:,} tensors: <= {limit_text(limit)}"
            out.append(Check(target, f"{shown} (median)", t <= limit, "prepare", name))
    return out


def worst_peak(results: dict[str, Any]) -> tuple[float, str, str]:
    """Largest streaming peak extra memory / largest bucket of any run: (ratio, model, where)."""
    worst, model, where = 0.0, "", ""
    default_bytes = int(results["default_bucket_bytes"])
    for name, m in results.get("models", {}).items():
        runs: list[tuple[int, dict[str, Any]]] = [(default_bytes, m["first_streaming"])]
        runs += [(default_bytes, r) for r in m["runs"]["streaming"]]
        for b in m.get("sweep", {}).get("sizes", []):
            runs += [(int(b), m["sweep"]["first"][f"{b}/streaming"])]
            runs += [(int(b), r) for r in m["sweep"]["runs"][f"{b}/streaming"]]
        for size, r in runs:
            x = r["peak_extra"] / r["largest_bucket"]
            if x >= worst:
                worst, model = x, name
                where = f"{label(name)}, {mib(size)} buckets, largest {mib(r['largest_bucket'])}"
    return worst, model, where


def _memory_check(results: dict[str, Any]) -> list[Check]:
    if not results.get("models"):
        return []
    worst, model, where = worst_peak(results)
    target = f"streaming apply: engine peak extra memory <= {PEAK_BUCKETS:g} x bucket, any model size"
    measured = f"at most {worst:.2f} x the largest bucket ({where})"
    return [Check(target, measured, worst <= PEAK_BUCKETS, "memory", model)]


def checks(results: dict[str, Any]) -> list[Check]:
    """The issue's targets, evaluated on ``results``."""
    out = _ratio_checks(results.get("models", {}))
    if results.get("moe"):
        out += _moe_checks(results["moe"])
    out += _naive_check(results)
    out += _prepare_checks(results)
    out += _memory_check(results)
    if results.get("fleet"):
        out += [Check(t, m, ok, "fleet", "tiny") for t, m, ok in report_fleet.checks(results["fleet"])]
    if results.get("disk"):
        out += [Check(t, m, ok, "disk", results["disk"]["model"]) for t, m, ok in report_disk.checks(results["disk"])]
    if results.get("sharded"):
        out += [Check(t, m, ok, "sharded", "smollm2") for t, m, ok in report_sharded.checks(results["sharded"])]
    if results.get("vllm"):
        out += [Check(t, m, ok, "vllm", "smollm2") for t, m, ok in report_vllm.checks(results["vllm"])]
    if results.get("vllm_tail"):
        tail = report_vllm_tail.checks(results["vllm_tail"])
        out += [Check(t, m, ok, "vllm_tail", "smollm2") for t, m, ok in tail]
    if results.get("detection"):
        d = results["detection"]
        out += [Check(t, m, ok, "detection", d["model"]) for t, m, ok in report_detection.checks(d)]
    if results.get("colocated"):
        colocated = report_colocated.checks(results["colocated"])
        out += [Check(t, m, ok, "colocated", "colocated") for t, m, ok in colocated]
    if results.get("cuda_ipc"):
        out += [Check(t, m, ok, "cuda_ipc", "smollm2") for t, m, ok in report_cuda_ipc.checks(results["cuda_ipc"])]
    if results.get("delta"):
        out += [Check(t, m, ok, "delta", "smollm2") for t, m, ok in report_delta.checks(results["delta"])]
    return out
