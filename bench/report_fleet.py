"""The fleet section of ``BENCHMARKS.md``, its targets and plot (results of :func:`bench.fleet_case.case_fleet`).

Every figure per fleet size is the median (min-max) over the timed syncs (or, for the group's
formation, over the repetitions). Growth with the fleet size N is a least-squares line through the
medians, ``intercept + slope * N``; the extrapolation to :data:`EXTRAPOLATE_TO` engines reads that line.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SLOPE_MS = 10.0
"""Target: the control-plane cost per sync (everything but the wire) grows by at most this much per engine, ms."""
LINEAR_SLACK = 1.25
"""Target: at the largest fleet, the control-plane cost at most this times the line fitted on the smaller ones."""
THREADS_SLACK = 4
"""Target: the trainer's threads at the largest fleet at most this many more than with one engine."""
EXTRAPOLATE_TO = 256
"""The fleet size the report extrapolates to."""
DPI = 110

Run = dict[str, Any]


def syncs(d: dict[str, Any], n: int) -> list[Run]:
    """Every timed sync at fleet size ``n``."""
    return [s for rep in d["runs"][str(n)] for s in rep["syncs"]]


def counts(d: dict[str, Any]) -> list[int]:
    return sorted(int(n) for n in d["runs"])


def control(s: Run) -> float:
    """A sync's control-plane cost: the call's wall time less the wire (the broadcast), in seconds."""
    return float(s["seconds"]) - float(s["broadcast"])


QUANTITIES: dict[str, tuple[str, Callable[[dict[str, Any], int], list[float]]]] = {
    "init": ("group formation, `init(force=True)`", lambda d, n: [float(r["init"]) for r in d["runs"][str(n)]]),
    "init_first": ("first `init` (engines free)", lambda d, n: [float(r["init_first"]) for r in d["runs"][str(n)]]),
    "prepare": ("Prepare fan-out", lambda d, n: [float(s["prepare"]) for s in syncs(d, n)]),
    "wire": ("the wire (broadcast)", lambda d, n: [float(s["broadcast"]) for s in syncs(d, n)]),
    "verify": ("Complete, verifying phase", lambda d, n: [float(s["verify"]) for s in syncs(d, n)]),
    "apply": ("Complete, applying phase", lambda d, n: [float(s["apply"]) for s in syncs(d, n)]),
    "sync": ("whole sync (wall time of the call)", lambda d, n: [float(s["seconds"]) for s in syncs(d, n)]),
    "control": ("control plane per sync (sync less the wire)", lambda d, n: [control(s) for s in syncs(d, n)]),
    "cpu": ("trainer CPU per sync", lambda d, n: [float(s["cpu"]) for s in syncs(d, n)]),
    "engines_cpu": ("engines' CPU per sync, all engines", lambda d, n: [float(s["engines_cpu"]) for s in syncs(d, n)]),
    "threads_idle": ("trainer threads, idle", lambda d, n: [float(s["threads_idle"]) for s in syncs(d, n)]),
    "threads_peak": ("trainer threads, peak in a sync", lambda d, n: [float(s["threads_peak"]) for s in syncs(d, n)]),
}  # fmt: skip
"""key -> (label, the values at fleet size N); times in seconds, threads as counts."""


def medians(d: dict[str, Any], key: str) -> list[float]:
    """The median of quantity ``key`` at each fleet size, in :func:`counts` order."""
    return [statistics.median(QUANTITIES[key][1](d, n)) for n in counts(d)]


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through ``(xs, ys)``: ``(intercept, slope)``; a flat line through one point."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def fit2(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares parabola through ``(xs, ys)``: ``(a, b, c)`` of ``a + b x + c x^2`` (3 points at least)."""
    m = [[sum(x ** (i + j) for x in xs) for j in range(3)] for i in range(3)]
    v = [sum(y * x**i for x, y in zip(xs, ys, strict=True)) for i in range(3)]
    for col in range(3):  # Gauss-Jordan elimination with partial pivoting
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[piv], v[col], v[piv] = m[piv], m[col], v[piv], v[col]
        for r in range(3):
            if r != col and m[col][col]:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
                v[r] -= f * v[col]
    a, b, c = (v[i] / m[i][i] if m[i][i] else 0.0 for i in range(3))
    return a, b, c


def line(d: dict[str, Any], key: str) -> tuple[float, float]:
    """The fitted ``(intercept, slope)`` of quantity ``key`` over every fleet size."""
    return fit([float(n) for n in counts(d)], medians(d, key))


def out_of_sample(d: dict[str, Any], key: str) -> tuple[float, float] | None:
    """Quantity ``key`` at the largest fleet and the line fitted on the smaller ones predicts there (>= 2 needed)."""
    ns = counts(d)
    ys = medians(d, key)
    if len(ns) < 3:
        return None
    a, b = fit([float(n) for n in ns[:-1]], ys[:-1])
    return ys[-1], a + b * ns[-1]


def exclusion_ratio(d: dict[str, Any]) -> tuple[float, float, float, float] | None:
    """Median over the rounds: (excluding sync, normal sync, init(force=True), excluding / (normal + init))."""
    rounds = d.get("exclusion", {}).get("rounds")
    if not rounds:
        return None
    ex = [float(r["excluded"]["seconds"]) for r in rounds]
    normal = [float(r["normal"]["seconds"]) for r in rounds]
    init = [float(r["init"]) for r in rounds]
    ratio = [e / (s + i) for e, s, i in zip(ex, normal, init, strict=True)]
    return statistics.median(ex), statistics.median(normal), statistics.median(init), statistics.median(ratio)


def checks(d: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)``: linear growth and slope of the control plane, threads, exclusion."""
    ns = counts(d)
    lo, hi = ns[0], ns[-1]
    out: list[tuple[str, str, bool]] = []
    _, slope = line(d, "control")
    out.append(
        (f"fleet: control plane per sync (all but the wire) grows <= {SLOPE_MS:g} ms per engine ({lo}-{hi} engines)",
         f"{slope * 1e3:.1f} ms per engine", slope * 1e3 <= SLOPE_MS)
    )  # fmt: skip
    oos = out_of_sample(d, "control")
    if oos is not None:
        got, want = oos
        out.append(
            (f"fleet: control plane at {hi} engines <= {LINEAR_SLACK:g} x the line fitted on "
             f"{', '.join(map(str, ns[:-1]))} (at most linear)",
             f"{got * 1e3:.0f} ms vs {want * 1e3:.0f} ms", got <= LINEAR_SLACK * want)
        )  # fmt: skip
    for key, what in (("threads_idle", "idle"), ("threads_peak", "peak during a sync")):
        ys = medians(d, key)
        out.append(
            (f"fleet: trainer threads ({what}) at {hi} engines <= {THREADS_SLACK} more than at {lo}",
             f"{ys[0]:.0f} -> {ys[-1]:.0f}", ys[-1] - ys[0] <= THREADS_SLACK)
        )  # fmt: skip
    ex = exclusion_ratio(d)
    if ex is not None:
        excluded, normal, init, ratio = ex
        out.append(
            ("fleet: a sync that excludes a dead engine <= a normal sync + one init(force=True)",
             f"{excluded * 1e3:.0f} ms vs {normal * 1e3:.0f} + {init * 1e3:.0f} ms ({ratio:.2f} x)", ratio <= 1.0)
        )  # fmt: skip
    return out


def _rng(xs: Sequence[float], scale: float = 1e3, fmt: str = "{:.0f}") -> str:
    vals = [x * scale for x in xs]
    return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def _table(d: dict[str, Any]) -> list[str]:
    keys = ["init_first", "init", "prepare", "wire", "verify", "apply", "sync", "control", "cpu", "engines_cpu"]
    lines = [
        "| engines | " + " | ".join(QUANTITIES[k][0] + " ms" for k in keys) + " | trainer threads idle / peak |",
        "|---:|" + "---:|" * (len(keys) + 1),
    ]
    for n in counts(d):
        cells = [_rng(QUANTITIES[k][1](d, n), fmt="{:.1f}" if k == "wire" else "{:.0f}") for k in keys]
        idle = QUANTITIES["threads_idle"][1](d, n)
        peak = QUANTITIES["threads_peak"][1](d, n)
        threads = f"{statistics.median(idle):.0f} / {statistics.median(peak):.0f} ({min(peak):.0f}-{max(peak):.0f})"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {threads} |")
    return lines


def _fits(d: dict[str, Any]) -> list[str]:
    ns = counts(d)
    lines = [
        f"| quantity | intercept | per engine | at {ns[-1]} engines: measured / line of {', '.join(map(str, ns[:-1]))} "
        f"| at {EXTRAPOLATE_TO} engines (line) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in (
        "control",
        "init",
        "init_first",
        "prepare",
        "verify",
        "apply",
        "cpu",
        "engines_cpu",
        "threads_idle",
        "threads_peak",
    ):
        a, b = line(d, key)
        oos = out_of_sample(d, key)
        threads = key.startswith("threads")
        scale, unit = (1.0, "") if threads else (1e3, " ms")
        fmt = "{:.1f}"
        at = a + b * EXTRAPOLATE_TO
        at_text = f"{at:.0f}" if threads else (f"{at:.2f} s" if at >= 1 else f"{at * 1e3:.0f} ms")
        oos_text = "" if oos is None else f"{oos[0] * scale:.0f} / {oos[1] * scale:.0f}{unit}"
        lines.append(
            f"| {QUANTITIES[key][0]} | {fmt.format(a * scale)}{unit} | {fmt.format(b * scale)}{unit} | {oos_text} "
            f"| {at_text} |"
        )
    return lines


def _exclusion(d: dict[str, Any]) -> list[str]:
    e = d.get("exclusion", {})
    if not e.get("rounds"):
        why = e.get("skipped") or e.get("error") or "not run"
        return [
            f"**Excluding a dead engine: not measured in this run** ({why}). The case's hook "
            "(`bench/fleet_case.py`, `exclusion`) runs, at the largest fleet with `FleetPolicy.exclude`, "
            "rounds of: a normal sync and an `init(force=True)`, then one engine SIGKILLed and the next sync timed, "
            "checked against the normal sync plus the re-formation."
        ]
    ex = exclusion_ratio(d)
    assert ex is not None
    rounds = e["rounds"]
    lines = [
        f"**Excluding a dead engine** ({e['engines']} engines, `FleetPolicy.exclude`, {len(rounds)} rounds, one "
        "more engine SIGKILLed between two syncs in each): the sync after the kill leaves the dead engine out and "
        "forms the group again over the survivors. Milliseconds:",
        "",
        "| round | normal sync | `init(force=True)` | sync excluding the dead engine (excluded) "
        "| of which forming the group | next sync | excluding / (normal + init) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        normal, init, excl, after = (r["normal"]["seconds"], r["init"], r["excluded"]["seconds"], r["after"]["seconds"])
        names = ", ".join(r["excluded"].get("excluded", [])) or "none reported"
        lines.append(
            f"| {i} | {normal * 1e3:.0f} | {init * 1e3:.0f} | {excl * 1e3:.0f} ({names}) "
            f"| {r['excluded']['init'] * 1e3:.0f} | {after * 1e3:.0f} "
            f"| {excl / (normal + init):.2f} |"
        )
    lines += ["", f"Median ratio: {ex[3]:.2f} x (target: at most 1)."]
    if e.get("error"):
        lines[-1] += f" The rounds stopped early: {e['error']}"
    return lines


THREADS_WHY = (
    "Every call the trainer makes to the engines runs on one asyncio loop thread (`wsync-streams`, "
    "`trainer/streams.py`) over one `grpc.aio` channel per engine: the lease (`KeepAlive`) and held `Watch` "
    "streams as tasks, the fan-out calls (GetStatus, Init, Prepare, Complete, Cancel) as coroutines gathered "
    "on it, so nothing the trainer does starts a thread per engine. The rest of the process's threads "
    "(gRPC's and gloo's native threads, the trainer's store) do not grow with the fleet."
)
"""Where the trainer's threads per engine come from (as measured on this code; see the section)."""


def missed(d: dict[str, Any], failed: Sequence[str]) -> str:
    """Section 8's paragraph for the fleet targets missed (``failed``: their target texts)."""
    ns = counts(d)
    idle, peak = medians(d, "threads_idle"), medians(d, "threads_peak")
    _, idle_b = line(d, "threads_idle")
    _, peak_b = line(d, "threads_peak")
    lines = ["### Fleet", "", "Missed: " + "; ".join(failed) + " (figures and their growth: the fleet section)."]
    if any("threads" in t for t in failed):
        lines += [
            "",
            f"Trainer threads from {ns[0]} to {ns[-1]} engines: idle {idle[0]:.0f} -> {idle[-1]:.0f} ({idle_b:.1f} "
            f"per engine), during a sync {peak[0]:.0f} -> {peak[-1]:.0f} ({peak_b:.1f} per engine). " + THREADS_WHY,
        ]
    return "\n".join(lines)


def _init_text(d: dict[str, Any]) -> str:
    """How forming the group grows with N: on the line, or faster (then a parabola's reading too) and why."""
    ns = counts(d)
    hi, big = ns[-1], EXTRAPOLATE_TO
    xs = [float(n) for n in ns]
    parts = []
    superlinear = False
    for key, what in (("init", "`init(force=True)`"), ("init_first", "the first `init`")):
        a, b = line(d, key)
        oos = out_of_sample(d, key)
        text = f"{what} {a + b * big:.0f} s on the line ({b * 1e3:.0f} ms per engine)"
        if oos is not None and oos[0] > LINEAR_SLACK * oos[1]:
            superlinear = True
            qa, qb, qc = fit2(xs, medians(d, key))
            text += (
                f", but it grows faster than a line here: the line of the smaller fleets predicted {oos[1]:.1f} s "
                f"at {hi} engines and {oos[0]:.1f} s was measured; a parabola through the medians reads "
                f"{(qa + qb * big + qc * big**2) / 60:.0f} minutes at {big}"
            )
        parts.append(text)
    out = "Forming the group: " + "; ".join(parts) + "."
    force, first = (
        statistics.median(QUANTITIES["init"][1](d, hi)),
        statistics.median(QUANTITIES["init_first"][1](d, hi)),
    )
    out += (
        f" At {hi} engines the forced re-formation takes {force - first:.1f} s more than the first one "
        f"({(force - first) / hi * 1e3:.0f} ms per engine): it first frees the engines from the old group "
        "(`Membership._free_all`: `Leave` fanned out to every engine at once), each engine dropping its gloo group."
    )
    if superlinear:
        out += (
            f" The rest grows with the pairs of ranks: gloo connects every rank of the group to every other "
            f"through the trainer's one TCP store, {(hi + 1) * hi // 2} connections at {hi} engines, "
            f"{(big + 1) * big // 2} at {big}, all made here by processes sharing the host's cores."
        )
    return out


def section(d: dict[str, Any], cores: str = "2") -> str:
    """The markdown section: what ran, the figures per fleet size, the fitted lines, the extrapolation."""
    ns = counts(d)
    hi = ns[-1]
    rss = statistics.median(d["engine_rss_bytes"]) / 2**20
    control_a, control_b = line(d, "control")
    cpu_a, cpu_b = line(d, "cpu")
    idle_a, idle_b = line(d, "threads_idle")
    peak_a, peak_b = line(d, "threads_peak")
    big = EXTRAPOLATE_TO
    sync_n = len(syncs(d, hi))
    lines = [
        f"## Fleet: {ns[0]} to {hi} engines",
        "",
        f"{hi} engine processes on this host (`wsync serve --synthetic {d['preset']}`: a 2-layer Llama-shaped "
        f"model, {d['tensors']} tensors, {d['model_bytes'] / 1e6:.2f} MB in bf16, so the wire is a small part of "
        f"a sync; {rss:.0f} MiB resident each, one OpenMP thread each; started in {d['start_seconds']:.0f} s). "
        f"Each of {d['reps']} repetitions walks the fleet sizes {', '.join(map(str, ns))} in turn on the first N "
        "of them: a fresh `TrainerClient` (real gRPC, one gloo group of N + 1 ranks), its first `init` (timed: "
        "the engines are free, the last client's close made them leave) and a warm-up sync, then"
        f" a timed `init(force=True)` and {d['syncs_per_rep']} timed staged syncs, each with "
        "every value changed; the client is closed before the next size. Phases are `SyncResult`'s: Prepare "
        "fan-out (first Prepare to the last reply), the wire (`broadcast_seconds`), Complete's verifying phase "
        "(it also waits for every engine to have received the last bucket) and applying phase. The control plane "
        "is the call's wall time less the wire. The trainer's CPU is this process's (every thread, from psutil; "
        "the thread sampler's own CPU taken out), the engines' the sum over the N engine processes. Threads are "
        f"the trainer process's OS threads ({d['threads_without_client']} before any client existed): idle "
        f"{d['settle_seconds'] * 1e3:.0f} ms after a sync, and the most seen during one (sampled every "
        f"{d['sample_seconds'] * 1e3:.0f} ms). Median (min-max) "
        f"over the {sync_n} timed syncs per size ({d['reps']} repetitions for `init`)"
        + (f", measured {d['measured']} (`--cases fleet`)" if d.get("measured") else "")
        + ":",
        "",
        *_table(d),
        "",
        f"Each quantity as a least-squares line through the medians, `intercept + per engine x N`, read at {big} "
        "engines; the third column tests the line out of sample (fitted without the largest fleet):",
        "",
        *_fits(d),
        "",
        f"**Extrapolation to {big} engines.** On the lines, a sync's control plane costs "
        f"{(control_a + control_b * big):.1f} s ({control_b * 1e3:.1f} ms per engine), the trainer's CPU per sync "
        f"{(cpu_a + cpu_b * big):.2f} s ({cpu_b * 1e3:.2f} ms per engine), and the trainer holds "
        f"{idle_a + idle_b * big:.0f} threads idle ({idle_b:.1f} per engine) and "
        f"{peak_a + peak_b * big:.0f} during a sync ({peak_b:.1f} per engine). "
        + _init_text(d)
        + " What the extrapolation assumes:",
        "",
        f"- Every process is on this host and shares its {cores} cores: with N engines, N + 1 Python processes "
        "serve the fan-out on 2 cores, so the engines' own handling of Prepare and Complete (gRPC, validation, "
        "the receive and the apply) is serialized here, where on a real fleet each engine runs it on its own "
        "host, in parallel. The wall-time slopes above are therefore upper bounds; what stays serial on a real "
        "fleet is the trainer's side, whose CPU per engine is the `trainer CPU` slope.",
        "- The wire is gloo over loopback (one host, no network), for a 0.3 MB model. NCCL's broadcast across "
        "nodes is not measured here: its time depends on the interconnect, the topology and the model's size, "
        "not on this control plane, and is added to the figures above. NCCL's communicator set-up at 256 ranks "
        "(part of `init` there) is not measured either.",
        "- The group's rendezvous is the trainer's TCP store and gloo's connections between all ranks of the "
        "group, on loopback; across hosts each connection also pays a network round trip.",
        f"- Growth stays linear beyond {hi} engines: a term that grows faster (all-pairs connections at group "
        f"formation, a per-engine cost that rises with the load) is small at {hi} and would dominate at {big}; "
        "the out-of-sample column shows how well a line fitted on fewer engines predicted the largest fleet.",
        "- Trainer threads: the lines are those of the client measured. " + THREADS_WHY,
        "",
        *_exclusion(d),
        "",
        "![fleet scaling](bench/fleet.png)",
    ]
    return "\n".join(lines)


def _series(ax: Any, d: dict[str, Any], keys: Sequence[str], lines: Sequence[str]) -> None:
    ns = counts(d)
    for i, key in enumerate(keys):
        values = [[v * 1e3 for v in QUANTITIES[key][1](d, n)] for n in ns]
        meds = [statistics.median(v) for v in values]
        bars = [[m - min(v) for m, v in zip(meds, values, strict=True)],
                [max(v) - m for m, v in zip(meds, values, strict=True)]]  # fmt: skip
        ax.errorbar(ns, meds, yerr=bars, fmt=f"C{i}o", capsize=3, label=QUANTITIES[key][0])
        if key in lines:
            a, b = line(d, key)
            ax.plot([0, ns[-1]], [a * 1e3, (a + b * ns[-1]) * 1e3], f"C{i}--", lw=1,
                    label=f"line: {a * 1e3:.0f} + {b * 1e3:.1f} ms x N")  # fmt: skip
    ax.set_xlabel("engines (N)")
    ax.set_ylabel("ms (median, bars: min-max)")


def plot(plt: Any, d: dict[str, Any], path: Path) -> None:
    """``fleet.png``: a sync's phases, the group's formation and the trainer's threads by fleet size."""
    ns = counts(d)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.5))
    _series(a1, d, ("control", "prepare", "verify", "apply", "wire"), ("control",))
    a1.set_title("a sync's phases by fleet size (control plane: the sync less the wire)", fontsize=9)
    _series(a2, d, ("init", "init_first"), ("init", "init_first"))
    a2.set_title("forming the group by fleet size", fontsize=9)
    for i, key in enumerate(("threads_idle", "threads_peak")):
        a3.plot(ns, medians(d, key), f"C{i}-o", label=QUANTITIES[key][0])
    a3.set_xlabel("engines (N)")
    a3.set_ylabel("OS threads of the trainer process")
    a3.set_title("trainer threads by fleet size", fontsize=9)
    for ax in (a1, a2, a3):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
