"""Numbers for the report: medians, ranges, ratios, units and model labels, all from ``results.json``.

Every figure is the median over the repetitions with (min-max); a ratio to
the ceiling is taken per repetition, between a wsync run and the ceiling run
made just before it, and its median reported.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

from bench.common import model_shape
from wsync_grpc.engines.synthetic import tensor_shapes

MiB = 1 << 20
GB = 1e9
"""The report's GB (bytes of weights per second are GB/s of this)."""

_NAMES = {"smollm2-shapes": "SmolLM2-135M shapes"}
"""Display names of presets whose key is not a size or a tensor count."""


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def rng(xs: Sequence[float], fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """``median (min-max)`` of ``xs`` times ``scale``."""
    vals = [x * scale for x in xs]
    return f"{fmt.format(med(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def secs(runs: Sequence[dict[str, Any]]) -> list[float]:
    return [float(r["seconds"]) for r in runs]


def col(runs: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Field ``key`` of every run, as floats."""
    return [float(r[key]) for r in runs]


def ratios(runs: Sequence[dict[str, Any]]) -> list[float]:
    """Per repetition: ceiling time / this run's time (the fraction of the ceiling reached)."""
    return [float(r["raw"]) / float(r["seconds"]) for r in runs]


def gbps(nbytes: int, runs: Sequence[dict[str, Any]], key: str = "seconds") -> list[float]:
    return [nbytes / float(r[key]) / GB for r in runs]


def ceiling_gbps(m: dict[str, Any]) -> list[float]:
    """Ceiling throughput of every paired run of a model, GB/s."""
    return [m["bytes"] / float(r["raw"]) / GB for k in m["runs"] for r in m["runs"][k]]


def err(vals: Sequence[Sequence[float]]) -> tuple[list[float], list[list[float]]]:
    """Medians and (below, above) error-bar lengths to min and max, for matplotlib."""
    meds = [med(v) for v in vals]
    below = [md - min(v) for md, v in zip(meds, vals, strict=True)]
    above = [max(v) - md for md, v in zip(meds, vals, strict=True)]
    return meds, [below, above]


def mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"


def label(name: str, tensors: int | None = None) -> str:
    """How the report names model ``name``: ``1gb`` -> ``1 GB``; with ``tensors``, their count in brackets."""
    if name in _NAMES:
        return _NAMES[name]
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)gb", name):
        return f"{m[1]} GB"
    if m := re.fullmatch(r"dense-(\d+)b", name):
        return f"{m[1]}B dense" + (f" ({tensors:,} tensors)" if tensors else "")
    if m := re.fullmatch(r"moe-(\w+)", name):
        return f"MoE ({tensors:,} tensors)" if tensors else f"MoE, {m[1]} tensors"
    return name


def control_label(results: dict[str, Any], name: str) -> str:
    """Label of a control-plane model, with its tensor count from the run."""
    return label(name, int(results.get("control", {}).get(name, {}).get("tensors", 0)) or None)


# ----------------------------------------------------------------------------- the host


def cores(results: dict[str, Any]) -> str:
    """The host's core count, as ``bench.common.machine_info`` recorded it (``?`` when it did not)."""
    m = re.search(r"(\d+) cores?\b", str(results.get("machine", {}).get("cpu", "")))
    return m[1] if m else "?"


def memory_bytes(results: dict[str, Any]) -> float:
    """The host's memory from the machine record (``<x> GiB``, from ``machine_info``) in bytes; 0 if unknown."""
    m = re.fullmatch(r"([\d.]+) GiB", str(results.get("machine", {}).get("memory", "")))
    return float(m[1]) * (1 << 30) if m else 0.0


BUSY_CORES = 0.005
"""Mean cores taken by other processes from which a case counts as shared (the least the table shows as non-zero)."""


def shared(results: dict[str, Any]) -> bool:
    """Whether other processes took measurable CPU during any case."""
    return any(float(v) >= BUSY_CORES for v in results.get("background_cores", {}).values())


# ----------------------------------------------------------------------------- model layouts


def tensor_sizes(name: str, nbytes: int, count: int) -> list[tuple[str, int]]:
    """``(tensor name, bytes)`` of model ``name`` from its synthetic shapes, if they add up to the run's model.

    Empty when the shapes no longer match ``nbytes`` and ``count`` (a preset
    changed since the run) or the model is unknown.
    """
    try:
        shapes = tensor_shapes(model_shape(name))
    except KeyError:
        return []
    numel = [math.prod(s) for _, s in shapes]
    if len(shapes) != count or not numel or nbytes % sum(numel):
        return []
    esize = nbytes // sum(numel)
    return [(n, k * esize) for (n, _), k in zip(shapes, numel, strict=True)]
