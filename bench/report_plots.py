"""The report's plots: ``throughput.png`` (GB/s by model), ``buckets.png`` (sweep), ``fleet.png``, ``vllm_tail.png``,
``colocated.png``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report_colocated, report_fleet, report_vllm_tail
from bench.report_checks import LARGE_RATIO, PEAK_BUCKETS
from bench.report_stats import GB, MiB, ceiling_gbps, err, gbps, label, med, ratios

HEADROOM = 1.35
"""Throughput plot: y axis up to this times the fastest ceiling run (room for the legend)."""
DPI = 110


def _throughput(plt: Any, results: dict[str, Any], path: Path) -> None:
    models = results["models"]
    fig, ax = plt.subplots(figsize=(8, 5))
    order = sorted(models.items(), key=lambda kv: kv[1]["bytes"])
    xs = list(range(len(order)))
    series: dict[str, Callable[[dict[str, Any]], list[float]]] = {
        "ceiling (raw broadcast of the same bytes)": ceiling_gbps,
        "wsync, streaming apply": lambda m: gbps(m["bytes"], m["runs"]["streaming"]),
        "wsync, staged apply": lambda m: gbps(m["bytes"], m["runs"]["staged"]),
        "naive (JSON/HTTP + a broadcast per tensor)": lambda m: gbps(m["bytes"], m["runs"]["naive"]),
    }
    styles = ["k--o", "C0-o", "C1-s", "C3-^"]
    for (name, fn), style in zip(series.items(), styles, strict=True):
        meds, bars = err([fn(m) for _, m in order])
        ax.errorbar(xs, meds, yerr=bars, fmt=style, capsize=3, label=name)
    ticks = [
        f"{label(n)}\n{m['tensors']} tensors"
        if label(n).endswith(" GB")
        else f"{label(n)}\n{m['bytes'] / GB:.2f} GB, {m['tensors']} tensors"
        for n, m in order
    ]
    ax.set_xticks(xs, ticks)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("model (bf16), by size")
    ax.set_ylabel("GB/s (bytes of weights / end-to-end seconds)")
    ax.set_ylim(0, HEADROOM * max(max(ceiling_gbps(m)) for m in models.values()))
    title = f"Weight sync to one engine, {results['backend']} over loopback, {results['machine']['cpu']}"
    ax.set_title(title + "\nmedian of paired repetitions, bars: min-max", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _buckets(plt: Any, swept: dict[str, Any], path: Path) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (name, m) in enumerate(swept.items()):
        sw = m["sweep"]
        sizes = sw["sizes"]
        xs = [b / MiB for b in sizes]
        for mode, marker in (("streaming", "o"), ("staged", "s")):
            meds, bars = err([ratios(sw["runs"][f"{b}/{mode}"]) for b in sizes])
            style = f"C{i}-{marker}" if mode == "streaming" else f"C{i}--{marker}"
            a1.errorbar(xs, meds, yerr=bars, fmt=style, capsize=3, label=f"{label(name)}, {mode}")
        first = [sw["first"][f"{b}/streaming"]["peak_extra"] / MiB for b in sizes]
        later = [med([float(r["peak_extra"]) for r in sw["runs"][f"{b}/streaming"]]) / MiB for b in sizes]
        largest = [sw["first"][f"{b}/streaming"]["largest_bucket"] / MiB for b in sizes]
        a2.plot(xs, first, f"C{i}-o", label=f"{label(name)}, first sync")
        a2.plot(xs, later, f"C{i}:x", label=f"{label(name)}, later syncs")
        bound = [PEAK_BUCKETS * x for x in largest]
        a2.plot(xs, bound, f"C{i}--", lw=1, label=f"{label(name)}: {PEAK_BUCKETS:g} x largest bucket")
    all_sizes = sorted({b for m in swept.values() for b in m["sweep"]["sizes"]})
    a1.axhline(LARGE_RATIO, color="gray", ls=":", lw=1)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks([b / MiB for b in all_sizes], [f"{b // MiB}" for b in all_sizes])
        ax.set_xlabel("bucket size (MiB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    a1.set_ylabel("x ceiling (paired, median, min-max)")
    a1.set_ylim(0, 1.05)
    a1.set_title("end-to-end throughput / raw broadcast", fontsize=9)
    a2.set_ylabel("engine peak extra memory, streaming apply (MiB)")
    a2.set_title("engine memory during a streaming sync", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``throughput.png``, ``buckets.png`` (the sweep ran), ``fleet.png``, ``vllm_tail.png``, ``colocated.png``
    (their cases ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    models = results.get("models", {})
    if models:
        written.append(out_dir / "throughput.png")
        _throughput(plt, results, written[-1])
    swept = {n: m for n, m in models.items() if m.get("sweep")}
    if swept:
        written.append(out_dir / "buckets.png")
        _buckets(plt, swept, written[-1])
    if results.get("fleet"):
        written.append(out_dir / "fleet.png")
        report_fleet.plot(plt, results["fleet"], written[-1])
    if results.get("vllm_tail"):
        written.append(out_dir / "vllm_tail.png")
        report_vllm_tail.plot(plt, results["vllm_tail"], written[-1])
    if results.get("colocated"):
        written.append(out_dir / "colocated.png")
        report_colocated.plot(plt, results["colocated"], written[-1])
    return written
