"""The report's tables, each a list of markdown lines computed from ``results.json``."""

from __future__ import annotations

from typing import Any

from bench.profile import GROUPS, PYTHON
from bench.report_stats import (
    GB,
    ceiling_gbps,
    col,
    control_label,
    gbps,
    label,
    med,
    mib,
    ratios,
    rng,
    secs,
)

THREAD_GROUPS = (PYTHON, *GROUPS.values())
"""The profile's thread groups, Python threads first."""
SIDES = ("trainer", "engine")


def fanout_model(results: dict[str, Any]) -> str | None:
    """The model of the fan-out case: the one of the model case with the same size, if any."""
    sizes = {int(f["bytes"]) for f in results.get("fanout", {}).values()}
    return next((n for n, m in results.get("models", {}).items() if int(m["bytes"]) in sizes), None)


def machine(results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    bg = results.get("background_cores", {})
    lines = [
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']} |",
        f"| memory | {m['memory']} |",
        f"| OS | {m['os']} |",
        f"| Python / torch / grpcio | {m['python']} / {m['torch']} / {m['grpcio']} |",
        f"| torch intra-op threads | {m['torch threads']} |",
        f"| CUDA | {m['cuda']} |",
        f"| collective backend | {results['backend']} over loopback TCP (every process on this host) |",
        f"| repetitions | {results['reps']} per figure, after a warm-up |",
        f"| default bucket / ramp / solo threshold | {mib(results['default_bucket_bytes'])} / "
        f"{mib(results['default_ramp_bytes'])} / {mib(int(results.get('solo_bytes', 0)))} |",
        f"| load average before / after | {results['load_before'][0]:.2f} / {results['load_after'][0]:.2f} |",
    ]
    if bg:
        shown = ", ".join(f"{k} {v:.2f}" for k, v in bg.items())
        lines.append(f"| other processes' CPU, mean cores per case | {shown} |")
    return lines


def targets(cks: list[Any]) -> list[str]:
    return [
        "| target | measured | |",
        "|---|---|---|",
        *[f"| {c.target} | {c.measured} | {'PASS' if c.passed else 'FAIL'} |" for c in cks],
    ]


def throughput(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | size | tensors | ceiling GB/s | wsync streaming GB/s | x ceiling | wsync staged GB/s "
        "| x ceiling | naive GB/s | wsync / naive (streaming, staged) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        n = m["bytes"]
        runs = m["runs"]
        naive = med(secs(runs["naive"]))
        speedups = ", ".join(f"{naive / med(secs(runs[mode])):.1f} x" for mode in ("streaming", "staged"))
        lines.append(
            f"| {label(name)} | {n / GB:.2f} GB | {m['tensors']} | {rng(ceiling_gbps(m))} "
            f"| {rng(gbps(n, runs['streaming']))} | {rng(ratios(runs['streaming']))} "
            f"| {rng(gbps(n, runs['staged']))} | {rng(ratios(runs['staged']))} "
            f"| {rng(gbps(n, runs['naive']))} | {speedups} |"
        )
    return lines


def breakdown(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | apply | total ms | ceiling ms | plan ms | Prepare ms | broadcast ms | of which packing ms "
        "| Complete ms | of which verify ms | of which apply ms | buckets | CPU s: wsync / ceiling |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        for mode in ("streaming", "staged"):
            runs = m["runs"][mode]

            def ms(key: str, runs: list[dict[str, Any]] = runs) -> str:
                if any(key not in r for r in runs):  # results of a run before the key existed
                    return "-"
                return f"{med(col(runs, key)) * 1e3:.0f}"

            lines.append(
                f"| {label(name)} | {mode} | {ms('seconds')} | {ms('raw')} | {ms('plan')} | {ms('prepare')} "
                f"| {ms('broadcast')} | {ms('pack')} | {ms('complete')} | {ms('verify')} | {ms('apply')} "
                f"| {runs[0]['buckets']} | {med(col(runs, 'cpu')):.2f} / {med(col(runs, 'raw_cpu')):.2f} |"
            )
    return lines


MOE_WAY_NAMES = {
    "flattened/streaming": "wsync, flattened, streaming apply",
    "flattened/staged": "wsync, flattened, staged apply",
    "individual/staged": "wsync, individual (one broadcast per tensor), staged",
    "naive": "naive: JSON over HTTP + one broadcast per tensor",
}


def moe(results: dict[str, Any]) -> list[str]:
    moe = results["moe"]
    n = moe["bytes"]
    naive = med(secs(moe["runs"]["naive"]))
    ceiling = [n / float(r["raw"]) / GB for k in moe["runs"] for r in moe["runs"][k]]
    lines = [
        f"{label('moe-20k')}: {moe['tensors']:,} tensors, {n / GB:.2f} GB (bf16); ceiling {rng(ceiling)} GB/s.",
        "",
        "| way | seconds | GB/s | x ceiling | speed-up over naive |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, way in MOE_WAY_NAMES.items():
        runs = moe["runs"][k]
        t = med(secs(runs))
        lines.append(
            f"| {way} | {rng(secs(runs), '{:.3f}')} | {rng(gbps(n, runs))} | {rng(ratios(runs))} | {naive / t:.1f} x |"
        )
    return lines


def fanout(results: dict[str, Any]) -> list[str]:
    lines = [
        "| engines | ceiling s | wsync streaming s | x ceiling | wsync staged s | x ceiling "
        "| bytes delivered per second, streaming |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[tuple[int, int, dict[str, list[dict[str, Any]]]]] = []
    one = results.get("models", {}).get(fanout_model(results) or "")
    if one:
        rows.append((1, one["bytes"], {"streaming": one["runs"]["streaming"], "staged": one["runs"]["staged"]}))
    for k, f in results["fanout"].items():
        rows.append((int(k), f["bytes"], f["runs"]))
    for n, nbytes, runs in rows:
        ceiling = [float(r["raw"]) for mode in runs for r in runs[mode]]
        delivered = [n * g for g in gbps(nbytes, runs["streaming"])]
        lines.append(
            f"| {n} | {rng(ceiling, '{:.3f}')} | {rng(secs(runs['streaming']), '{:.3f}')} "
            f"| {rng(ratios(runs['streaming']))} | {rng(secs(runs['staged']), '{:.3f}')} "
            f"| {rng(ratios(runs['staged']))} | {rng(delivered)} GB/s |"
        )
    return lines


def control(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | buckets (size) | protobuf: messages, bytes, largest message | wsync Prepare ms (engine side) "
        "| JSON body bytes | JSON over HTTP ms | planning ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in results["control"].items():
        for b, v in c["by_bucket"].items():
            prep = v["runs"]["prepare"]
            ready = v["runs"]["ready"]
            lines.append(
                f"| {control_label(results, name)} | {v['buckets']:,} ({mib(int(b))}) "
                f"| {v['proto_messages']:,}, {v['proto_bytes'] / 1e6:.2f} MB, "
                f"{v['proto_largest_message'] / 1e3:.1f} kB "
                f"| {rng(prep, '{:.1f}', 1e3)} ({med(ready) * 1e3:.1f}) | {c['json_bytes'] / 1e6:.2f} MB "
                f"| {rng(c['json_runs'], '{:.1f}', 1e3)} | {v['plan_seconds'] * 1e3:.0f} |"
            )
    return lines


def _memory_row(name: str, bucket: int, mode: str, first: dict[str, Any], later: list[dict[str, Any]]) -> str:
    peaks = col(later, "peak_extra")
    kept = med([float(r["rss_before"]) + float(r["kept"]) for r in later]) - float(first["rss_before"])
    largest = int(first["largest_bucket"])
    return (
        f"| {label(name)} | {mib(bucket)} ({mib(largest)}) | {mode} | {mib(first['peak_extra'])} "
        f"| {first['peak_extra'] / largest:.2f} | {mib(med(peaks))} (max {mib(max(peaks))}) | {mib(kept)} "
        f"| {first['seconds']:.3f} | {rng(secs(later), '{:.3f}')} |"
    )


def memory(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | bucket (largest planned) | apply | first sync: peak extra | x largest bucket "
        "| later syncs: peak extra | kept between syncs | first sync s | later syncs s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    default = results["default_bucket_bytes"]
    for name, m in results["models"].items():
        for mode in ("streaming", "staged"):
            lines.append(_memory_row(name, default, mode, m[f"first_{mode}"], m["runs"][mode]))
    for name, m in results["models"].items():
        sw = m.get("sweep")
        if not sw:
            continue
        for b in sw["sizes"]:
            if b == default:
                continue
            for mode in ("streaming", "staged"):
                lines.append(_memory_row(name, b, mode, sw["first"][f"{b}/{mode}"], sw["runs"][f"{b}/{mode}"]))
    naive = [f"{label(n)} {mib(med(col(m['runs']['naive'], 'peak_extra')))}" for n, m in results["models"].items()]
    lines += ["", "Naive way, peak extra engine memory per sync (fresh tensors for every request): " + ", ".join(naive)]
    return lines


def sweep(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | bucket | buckets | streaming x ceiling | staged x ceiling | streaming s | staged s "
        "| streaming first-sync peak extra |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        sw = m.get("sweep")
        if not sw:
            continue
        for b in sw["sizes"]:
            st, sg = sw["runs"][f"{b}/streaming"], sw["runs"][f"{b}/staged"]
            lines.append(
                f"| {label(name)} | {mib(b)} | {st[0]['buckets']} | {rng(ratios(st))} | {rng(ratios(sg))} "
                f"| {rng(secs(st), '{:.3f}')} | {rng(secs(sg), '{:.3f}')} "
                f"| {mib(sw['first'][f'{b}/streaming']['peak_extra'])} |"
            )
    return lines


def cpu(run: dict[str, Any]) -> float:
    """CPU seconds per run of trainer and engine together, from the profile case."""
    return sum(float(v) for side in SIDES for v in run.get(side, {}).values())


def _short(fn: str) -> str:
    """``name (dir/file.py)`` -> ``name`` (file.py)."""
    name, _, where = fn.partition(" (")
    file = where.rstrip(")").rsplit("/", 1)[-1]
    return f"`{name}` ({file})" if file else f"`{name}`"


def profile(results: dict[str, Any]) -> list[str]:
    """Section 7: per-thread CPU per run (ceiling vs wsync)."""
    head = " | ".join(f"{side}: {g}" for side in SIDES for g in THREAD_GROUPS)
    out = [
        f"| model | run | wall ms | {head} | CPU ms, both | cores busy |",
        "|---|---|---:|" + "---:|" * (2 * len(THREAD_GROUPS)) + "---:|---:|",
    ]
    for name, m in results["profile"].items():
        for kind, run in m["runs"].items():
            cells = " | ".join(
                f"{float(run.get(side, {}).get(g, 0.0)) * 1e3:.0f}" for side in SIDES for g in THREAD_GROUPS
            )
            wall = float(run["seconds"])
            way = "ceiling" if kind == "ceiling" else f"wsync {kind}"
            out.append(
                f"| {label(name)} | {way} | {wall * 1e3:.0f} | {cells} | {cpu(run) * 1e3:.0f} | {cpu(run) / wall:.2f} |"
            )
    return out


def py_spy(results: dict[str, Any]) -> list[str]:
    """Section 7: py-spy's top functions per profiled model and apply mode (empty without samples)."""
    spy = [(name, mode, d) for name, m in results["profile"].items() for mode, d in m.get("py_spy", {}).items()]
    if not spy:
        return []
    out = ["| model | apply | trainer: top functions | engine: top functions |", "|---|---|---|---|"]
    for name, mode, d in spy:
        cols = [
            ", ".join(f"{_short(f)} {share:.0%}" for f, share in d[side]["top"][:3]) or "no samples" for side in SIDES
        ]
        out.append(f"| {label(name)} | {mode} | {cols[0]} | {cols[1]} |")
    return out
