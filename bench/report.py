"""Turn the suite's results into ``BENCHMARKS.md``, the PASS/FAIL checks and the plots.

Every figure is the median over the repetitions with (min-max); a ratio to
the ceiling is taken per repetition, between a wsync run and the ceiling run
made just before it, and its median reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.profile import GROUPS, PYTHON

MiB = 1 << 20
GB = 1e9

MODEL_LABELS = {
    "smollm2-shapes": "SmolLM2-135M shapes",
    "0.25gb": "0.25 GB",
    "1gb": "1 GB",
    "4gb": "4 GB",
    "moe-20k": "MoE, 20k tensors",
    "dense-32b": "32B dense (579 tensors)",
    "moe-100k": "MoE (99,925 tensors)",
}


@dataclass(frozen=True)
class Check:
    """One target of issue 5 and how the run measured against it."""

    target: str
    measured: str
    passed: bool


# ----------------------------------------------------------------------------- numbers


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _rng(xs: Sequence[float], fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """``median (min-max)`` of ``xs`` times ``scale``."""
    vals = [x * scale for x in xs]
    return f"{fmt.format(_med(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def _secs(runs: Sequence[dict[str, Any]]) -> list[float]:
    return [float(r["seconds"]) for r in runs]


def _ratios(runs: Sequence[dict[str, Any]]) -> list[float]:
    """Per repetition: ceiling time / this run's time (the fraction of the ceiling reached)."""
    return [float(r["raw"]) / float(r["seconds"]) for r in runs]


def _gbps(nbytes: int, runs: Sequence[dict[str, Any]], key: str = "seconds") -> list[float]:
    return [nbytes / float(r[key]) / GB for r in runs]


def _ceiling_gbps(m: dict[str, Any]) -> list[float]:
    """Ceiling throughput of every paired run of a model, GB/s."""
    return [m["bytes"] / float(r["raw"]) / GB for k in m["runs"] for r in m["runs"][k]]


def _err(vals: Sequence[Sequence[float]]) -> tuple[list[float], list[list[float]]]:
    """Medians and (below, above) error-bar lengths to min and max, for matplotlib."""
    meds = [_med(v) for v in vals]
    below = [md - min(v) for md, v in zip(meds, vals, strict=True)]
    above = [max(v) - md for md, v in zip(meds, vals, strict=True)]
    return meds, [below, above]


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"


def _label(name: str) -> str:
    return MODEL_LABELS.get(name, name)


# ----------------------------------------------------------------------------- checks


def checks(results: dict[str, Any]) -> list[Check]:
    """The issue's targets, evaluated on ``results``."""
    out: list[Check] = []
    models = results.get("models", {})
    for name, m in models.items():
        for mode in ("streaming", "staged"):
            ratio = _med(_ratios(m["runs"][mode]))
            if m["bytes"] >= 1e9:
                out.append(Check(f"{_label(name)}, {mode}: >= 0.90 x ceiling", f"{ratio:.2f} x", ratio >= 0.90))
            elif name == "smollm2-shapes":
                out.append(Check(f"{_label(name)}, {mode}: >= 0.75 x ceiling", f"{ratio:.2f} x", ratio >= 0.75))
    moe = results.get("moe")
    if moe:
        naive = _med(_secs(moe["runs"]["naive"]))
        for mode in ("streaming", "staged"):
            t = _med(_secs(moe["runs"][f"flattened/{mode}"]))
            target = f"{_label('moe-20k')}, flattened {mode}: >= 3 x faster than naive"
            out.append(Check(target, f"{naive / t:.1f} x", naive >= 3 * t))
    slower = []
    compared = 0
    for name, m in models.items():
        naive = _med(_secs(m["runs"]["naive"]))
        for mode in ("streaming", "staged"):
            compared += 1
            t = _med(_secs(m["runs"][mode]))
            if t > naive:
                slower.append(f"{_label(name)} {mode} ({naive / t:.2f} x)")
    if moe:
        naive = _med(_secs(moe["runs"]["naive"]))
        for k in ("flattened/streaming", "flattened/staged", "individual/staged"):
            compared += 1
            t = _med(_secs(moe["runs"][k]))
            if t > naive:
                slower.append(f"{_label('moe-20k')} {k} ({naive / t:.2f} x)")
    if compared:
        measured = "slower on: " + ", ".join(slower) if slower else f"faster in all {compared} comparisons"
        out.append(Check("wsync not slower than naive on any case", measured, not slower))
    control = results.get("control", {})
    default = str(results.get("default_bucket_bytes"))
    for name, limit in (("dense-32b", 0.020), ("moe-100k", 2.0)):
        c = control.get(name)
        if c and default in c["by_bucket"]:
            t = _med(c["by_bucket"][default]["runs"]["prepare"])
            shown = f"{t * 1e3:.1f} ms" if limit < 1 else f"{t:.2f} s"
            want = f"{limit * 1e3:.0f} ms" if limit < 1 else f"{limit:.0f} s"
            out.append(Check(f"Prepare-to-ready, {c['tensors']:,} tensors: <= {want}", f"{shown} (median)", t <= limit))
    worst = 0.0
    where = ""
    for name, m in models.items():
        default_bytes = int(results["default_bucket_bytes"])
        runs: list[tuple[int, dict[str, Any]]] = [(default_bytes, m["first_streaming"])]
        runs += [(default_bytes, r) for r in m["runs"]["streaming"]]
        for b in m.get("sweep", {}).get("sizes", []):
            runs += [(int(b), m["sweep"]["first"][f"{b}/streaming"])]
            runs += [(int(b), r) for r in m["sweep"]["runs"][f"{b}/streaming"]]
        for size, r in runs:
            x = r["peak_extra"] / r["largest_bucket"]
            if x >= worst:
                worst, where = x, f"{_label(name)}, {_mib(size)} buckets, largest {_mib(r['largest_bucket'])}"
    if models:
        out.append(
            Check(
                "streaming apply: engine peak extra memory <= 2.5 x bucket, any model size",
                f"at most {worst:.2f} x the largest bucket ({where})",
                worst <= 2.5,
            )
        )
    return out


# ----------------------------------------------------------------------------- markdown


def _machine(results: dict[str, Any]) -> list[str]:
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
        f"| default bucket / ramp / solo threshold | {_mib(results['default_bucket_bytes'])} / "
        f"{_mib(results['default_ramp_bytes'])} / {_mib(int(results.get('solo_bytes', 0)))} |",
        f"| load average before / after | {results['load_before'][0]:.2f} / {results['load_after'][0]:.2f} |",
    ]
    if bg:
        shown = ", ".join(f"{k} {v:.2f}" for k, v in bg.items())
        lines.append(f"| other processes' CPU, mean cores per case | {shown} |")
    return lines


def _throughput_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | size | tensors | ceiling GB/s | wsync streaming GB/s | x ceiling | wsync staged GB/s "
        "| x ceiling | naive GB/s | wsync / naive (streaming, staged) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        n = m["bytes"]
        runs = m["runs"]
        ceiling = _ceiling_gbps(m)
        naive = _med(_secs(runs["naive"]))
        speedups = ", ".join(f"{naive / _med(_secs(runs[mode])):.1f} x" for mode in ("streaming", "staged"))
        lines.append(
            f"| {_label(name)} | {n / GB:.2f} GB | {m['tensors']} | {_rng(ceiling)} "
            f"| {_rng(_gbps(n, runs['streaming']))} | {_rng(_ratios(runs['streaming']))} "
            f"| {_rng(_gbps(n, runs['staged']))} | {_rng(_ratios(runs['staged']))} "
            f"| {_rng(_gbps(n, runs['naive']))} | {speedups} |"
        )
    return lines


def _breakdown_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | apply | total ms | ceiling ms | Prepare ms | broadcast ms | of which packing ms "
        "| Complete ms | of which apply ms | buckets | CPU s: wsync / ceiling |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        for mode in ("streaming", "staged"):
            runs = m["runs"][mode]

            def ms(key: str, runs: list[dict[str, Any]] = runs) -> str:
                return f"{_med([float(r[key]) for r in runs]) * 1e3:.0f}"

            lines.append(
                f"| {_label(name)} | {mode} | {ms('seconds')} | {ms('raw')} | {ms('prepare')} | {ms('broadcast')} "
                f"| {ms('pack')} | {ms('complete')} | {ms('apply')} | {runs[0]['buckets']} "
                f"| {_med([float(r['cpu']) for r in runs]):.2f} / {_med([float(r['raw_cpu']) for r in runs]):.2f} |"
            )
    return lines


def _moe_table(results: dict[str, Any]) -> list[str]:
    moe = results["moe"]
    n = moe["bytes"]
    naive = _med(_secs(moe["runs"]["naive"]))
    names = {
        "flattened/streaming": "wsync, flattened, streaming apply",
        "flattened/staged": "wsync, flattened, staged apply",
        "individual/staged": "wsync, individual (one broadcast per tensor), staged",
        "naive": "naive: JSON over HTTP + one broadcast per tensor",
    }
    ceiling = [n / float(r["raw"]) / GB for k in moe["runs"] for r in moe["runs"][k]]
    lines = [
        f"{_label('moe-20k')}: {moe['tensors']:,} tensors, {n / GB:.2f} GB (bf16); ceiling {_rng(ceiling)} GB/s.",
        "",
        "| way | seconds | GB/s | x ceiling | speed-up over naive |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, label in names.items():
        runs = moe["runs"][k]
        t = _med(_secs(runs))
        lines.append(
            f"| {label} | {_rng(_secs(runs), '{:.3f}')} | {_rng(_gbps(n, runs))} | {_rng(_ratios(runs))} "
            f"| {naive / t:.1f} x |"
        )
    return lines


def _fanout_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| engines | ceiling s | wsync streaming s | x ceiling | wsync staged s | x ceiling "
        "| bytes delivered per second, streaming |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[tuple[int, int, dict[str, list[dict[str, Any]]]]] = []
    one = results.get("models", {}).get("1gb")
    if one:
        rows.append((1, one["bytes"], {"streaming": one["runs"]["streaming"], "staged": one["runs"]["staged"]}))
    for k, f in results["fanout"].items():
        rows.append((int(k), f["bytes"], f["runs"]))
    for n, nbytes, runs in rows:
        ceiling = [float(r["raw"]) for mode in runs for r in runs[mode]]
        delivered = [n * g for g in _gbps(nbytes, runs["streaming"])]
        lines.append(
            f"| {n} | {_rng(ceiling, '{:.3f}')} | {_rng(_secs(runs['streaming']), '{:.3f}')} "
            f"| {_rng(_ratios(runs['streaming']))} | {_rng(_secs(runs['staged']), '{:.3f}')} "
            f"| {_rng(_ratios(runs['staged']))} | {_rng(delivered)} GB/s |"
        )
    return lines


def _control_table(results: dict[str, Any]) -> list[str]:
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
                f"| {_label(name)} | {v['buckets']:,} ({_mib(int(b))}) "
                f"| {v['proto_messages']:,}, {v['proto_bytes'] / 1e6:.2f} MB, "
                f"{v['proto_largest_message'] / 1e3:.1f} kB "
                f"| {_rng(prep, '{:.1f}', 1e3)} ({_med(ready) * 1e3:.1f}) | {c['json_bytes'] / 1e6:.2f} MB "
                f"| {_rng(c['json_runs'], '{:.1f}', 1e3)} | {v['plan_seconds'] * 1e3:.0f} |"
            )
    return lines


def _memory_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | bucket (largest planned) | apply | first sync: peak extra | x largest bucket "
        "| later syncs: peak extra | kept between syncs | first sync s | later syncs s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, bucket: int, mode: str, first: dict[str, Any], later: list[dict[str, Any]]) -> str:
        peaks = [float(r["peak_extra"]) for r in later]
        kept = _med([float(r["rss_before"]) + float(r["kept"]) for r in later]) - float(first["rss_before"])
        largest = int(first["largest_bucket"])
        return (
            f"| {_label(name)} | {_mib(bucket)} ({_mib(largest)}) | {mode} | {_mib(first['peak_extra'])} "
            f"| {first['peak_extra'] / largest:.2f} | {_mib(_med(peaks))} (max {_mib(max(peaks))}) | {_mib(kept)} "
            f"| {first['seconds']:.3f} | {_rng(_secs(later), '{:.3f}')} |"
        )

    default = results["default_bucket_bytes"]
    for name, m in results["models"].items():
        for mode in ("streaming", "staged"):
            lines.append(row(name, default, mode, m[f"first_{mode}"], m["runs"][mode]))
    for name, m in results["models"].items():
        sw = m.get("sweep")
        if not sw:
            continue
        for b in sw["sizes"]:
            if b == default:
                continue
            for mode in ("streaming", "staged"):
                lines.append(row(name, b, mode, sw["first"][f"{b}/{mode}"], sw["runs"][f"{b}/{mode}"]))
    naive = []
    for name, m in results["models"].items():
        naive.append(f"{_label(name)} {_mib(_med([float(r['peak_extra']) for r in m['runs']['naive']]))}")
    lines += ["", "Naive way, peak extra engine memory per sync (fresh tensors for every request): " + ", ".join(naive)]
    return lines


def _sweep_table(results: dict[str, Any]) -> list[str]:
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
                f"| {_label(name)} | {_mib(b)} | {st[0]['buckets']} | {_rng(_ratios(st))} | {_rng(_ratios(sg))} "
                f"| {_rng(_secs(st), '{:.3f}')} | {_rng(_secs(sg), '{:.3f}')} "
                f"| {_mib(sw['first'][f'{b}/streaming']['peak_extra'])} |"
            )
    return lines


def _sweep_summary(results: dict[str, Any]) -> list[str]:
    """What the sweep says about the default, from this run's numbers."""
    default = results["default_bucket_bytes"]
    lines = []
    for name, m in results["models"].items():
        sw = m.get("sweep")
        if not sw:
            continue
        counts: dict[int, list[int]] = {}
        for b in sw["sizes"]:
            counts.setdefault(int(sw["runs"][f"{b}/streaming"][0]["buckets"]), []).append(int(b))
        for same in counts.values():
            if len(same) > 1:
                lines.append(
                    f"- {_label(name)}: " + " and ".join(_mib(b) for b in same) + " plan the same buckets for this "
                    "model (the ramp and its largest tensors decide), so the gap between their rows is noise."
                )
        for mode in ("streaming", "staged"):
            meds = {b: _med(_ratios(sw["runs"][f"{b}/{mode}"])) for b in sw["sizes"]}
            best = max(meds, key=lambda b: meds[b])
            shown = ", ".join(f"{_mib(b)} {v:.2f}" for b, v in meds.items())
            note = f"; the default {_mib(default)} reaches {meds[default]:.2f}" if default in meds else ""
            lines.append(f"- {_label(name)}, {mode}: x ceiling by bucket size {shown} (best {_mib(best)}{note}).")
    return [
        *lines,
        "",
        "Throughput depends little on the bucket size once the first pack and the last apply are short (the "
        "ramp), and differences between sizes are of the order of the run-to-run noise of this host; the "
        "smallest buckets pay a per-bucket cost (one collective and one receiver hand-off each). The default is "
        "decided by what the buckets hold: tensors of at least the solo threshold travel alone whatever the "
        "bucket size, so the bucket size only bounds how small tensors are packed. Larger buckets mean fewer "
        "collectives (each costs a few hundred microseconds with gloo here) and fewer Prepare entries; the "
        "price is memory: two buckets on the trainer while packing, two on an engine with streaming apply "
        "(section 5); lower it where that memory is short.",
    ]


_GROUPS = (PYTHON, *GROUPS.values())


def _cpu(run: dict[str, Any]) -> float:
    """CPU seconds per run of trainer and engine together, from the profile case."""
    return sum(float(v) for side in ("trainer", "engine") for v in run.get(side, {}).values())


def _short(fn: str) -> str:
    """``name (dir/file.py)`` -> ``name`` (file.py)."""
    name, _, where = fn.partition(" (")
    file = where.rstrip(")").rsplit("/", 1)[-1]
    return f"`{name}` ({file})" if file else f"`{name}`"


def _profile_tables(results: dict[str, Any]) -> list[str]:
    """Section 7: per-thread CPU per run (ceiling vs wsync) and py-spy's top functions."""
    prof = results["profile"]
    head = " | ".join(f"{side}: {g}" for side in ("trainer", "engine") for g in _GROUPS)
    out = [
        f"| model | run | wall ms | {head} | CPU ms, both | cores busy |",
        "|---|---|---:|" + "---:|" * (2 * len(_GROUPS)) + "---:|---:|",
    ]
    for name, m in prof.items():
        for kind, run in m["runs"].items():
            cells = " | ".join(
                f"{float(run.get(side, {}).get(g, 0.0)) * 1e3:.0f}" for side in ("trainer", "engine") for g in _GROUPS
            )
            wall = float(run["seconds"])
            label = "ceiling" if kind == "ceiling" else f"wsync {kind}"
            out.append(
                f"| {_label(name)} | {label} | {wall * 1e3:.0f} | {cells} | {_cpu(run) * 1e3:.0f} | "
                f"{_cpu(run) / wall:.2f} |"
            )
    spy = [(name, mode, d) for name, m in prof.items() for mode, d in m.get("py_spy", {}).items()]
    if spy:
        out += [
            "",
            "py-spy (`record --nonblocking`, 200 Hz, the same number of syncs again): the Python functions the "
            "samples of busy Python threads end in, with their share (native code they call counts as theirs: "
            "`pack_bucket`'s `memmove`, `load_weights`' copies).",
            "",
            "| model | apply | trainer: top functions | engine: top functions |",
            "|---|---|---|---|",
        ]
        for name, mode, d in spy:
            cols = [
                ", ".join(f"{_short(f)} {share:.0%}" for f, share in d[side]["top"][:3]) or "no samples"
                for side in ("trainer", "engine")
            ]
            out.append(f"| {_label(name)} | {mode} | {cols[0]} | {cols[1]} |")
    return out


def _share(d: dict[str, Any], side: str, fn: str) -> float:
    """py-spy share of function ``fn`` (by name) on ``side``, 0 when absent."""
    return sum(float(share) for f, share in d.get(side, {}).get("top", []) if f.split(" (")[0] == fn)


def _profile_findings(results: dict[str, Any]) -> list[str]:
    """One line per profiled model and apply mode: extra CPU, what it is, and the bound it sets."""
    out = []
    for name, m in results.get("profile", {}).items():
        ceil = m["runs"]["ceiling"]
        for mode in ("streaming", "staged"):
            run = m["runs"].get(mode)
            if run is None:
                continue
            spy = m.get("py_spy", {}).get(mode, {})
            tp = float(run["trainer"].get(PYTHON, 0.0))
            ep = float(run["engine"].get(PYTHON, 0.0))
            pack = tp * _share(spy, "trainer", "pack_bucket")
            apply = ep * _share(spy, "engine", "TensorEngine.load_weights")
            gloo_extra = sum(
                float(run[side].get(g, 0.0)) - float(ceil[side].get(g, 0.0))
                for side in ("trainer", "engine")
                for g in _GROUPS[1:]
            )
            wall_ratio = float(ceil["seconds"]) / float(run["seconds"])
            out.append(
                f"- {_label(name)}, {mode}: {_cpu(run) * 1e3:.0f} ms of CPU per sync against the ceiling's "
                f"{_cpu(ceil) * 1e3:.0f} ms, with {_cpu(run) / float(run['seconds']):.2f} and "
                f"{_cpu(ceil) / float(ceil['seconds']):.2f} of the 2 cores busy; CPU ratio "
                f"{_cpu(ceil) / _cpu(run):.2f}, wall-time ratio {wall_ratio:.2f}. The extra: packing on the trainer "
                f"about {pack * 1e3:.0f} ms, copies into the served tensors on the engine about {apply * 1e3:.0f} ms "
                f"(py-spy shares of the Python threads' {tp * 1e3:.0f} and {ep * 1e3:.0f} ms), gloo's threads "
                f"{gloo_extra * 1e3:+.0f} ms."
            )
    return out


def _analysis(results: dict[str, Any], cks: list[Check]) -> list[str]:
    """Why each missed target is missed, by how much, and what would close it (numbers from this run)."""
    out: list[str] = []
    models = results.get("models", {})
    failed = [c for c in cks if not c.passed]
    ratio_miss = [c for c in failed if "x ceiling" in c.target]
    bg = results.get("background_cores", {})
    if ratio_miss:
        out += [
            "### Throughput against the ceiling",
            "",
            "Missed: " + "; ".join(f"{c.target.split(':')[0]} at {c.measured}" for c in ratio_miss) + ".",
            "",
            "Where the time goes (medians of this run):",
            "",
        ]
        for name, m in models.items():
            st, sm = m["runs"]["staged"], m["runs"]["streaming"]
            raw = _med([float(r["raw"]) for r in st + sm])
            apply = _med([float(r["apply"]) for r in st])
            tot_st, tot_sm = _med(_secs(st)), _med(_secs(sm))
            cpu_sm = _med([float(r["cpu"]) for r in sm])
            cpu_raw = _med([float(r["raw_cpu"]) for r in sm])
            out.append(
                f"- {_label(name)}: ceiling {raw * 1e3:.0f} ms using {cpu_raw:.2f} CPU-seconds (both processes); "
                f"streaming {tot_sm * 1e3:.0f} ms using {cpu_sm:.2f}; staged {tot_st * 1e3:.0f} ms, of which "
                f"{apply * 1e3:.0f} ms apply after the last byte, so a staged sync could reach at most "
                f"{raw / (raw + apply):.2f} x even with the transfer itself at the ceiling."
            )
        default = results["default_bucket_bytes"]
        for name, m in models.items():
            sw = m.get("sweep")
            if sw and default in sw["sizes"]:
                a = _med(_ratios(m["runs"]["streaming"]))
                b = _med(_ratios(sw["runs"][f"{default}/streaming"]))
                out.append(
                    f"- Noise: {_label(name)} with streaming apply at the default bucket size measured {a:.2f} x in "
                    f"section 1 and {b:.2f} x in the sweep of section 6, same configuration, same run."
                )
        findings = _profile_findings(results)
        if findings:
            out += ["", "What the profile of section 7 shows, per run of the profiled models:", "", *findings]
        out += [
            "",
            'Why. On this host the "wire" is itself a memory copy: loopback TCP moves each byte with two kernel '
            "copies, one per process, and that is all the ceiling does. Whatever wsync adds runs at the same "
            "speed as that copy, on the same 2 cores and memory bus, which other processes shared during this run "
            "(" + ", ".join(f"{k} {v:.1f}" for k, v in bg.items()) + " cores on average). Tensors of at least "
            f"{_mib(int(results.get('solo_bytes', 0)))} (`DEFAULT_SOLO_BYTES`) travel alone: the trainer "
            "broadcasts the tensor itself and, with streaming apply, the engine receives straight into the tensor "
            "it serves (`InPlaceReceive`), so they cost what the ceiling costs plus one collective each; that is "
            "how the 1 and 4 GB models (MLP and embedding matrices of 18-190 MB) get close to the ceiling with "
            "streaming apply. Smaller tensors are packed into flat buckets: the trainer copies them in (a "
            "single-threaded `memmove`) and the engine copies them out into the served tensors "
            "(`EngineAdapter.load_weights`). Overlapping those copies with the transfer (pack k+1 while k is on "
            "the wire, apply k while k+1 arrives) hides their latency but not their CPU and memory-bus cost: the "
            "profile (section 7) shows wsync keeping about as many of the 2 cores busy as the ceiling does, so "
            "its time grows with its CPU, and for a model made of small tensors (SmolLM2-135M: 1.7 MB at most, "
            "besides its embedding) the two copies nearly double the CPU a sync needs. Where the wall-time ratio "
            "falls below the CPU ratio, fewer cores were busy than in the ceiling: the first pack and the last "
            "apply (kept short by the ramp) and the hand-offs between collectives. Sending each small tensor "
            "alone instead costs more: gloo spends a few hundred microseconds per collective on this host "
            "(19,755 collectives of 33 kB took 2.3-3.4 s in a plain torch.distributed loop, against 0.16 s for "
            "the same bytes in one), and separate runs with `--solo 1` and `--solo 0.25` (lone tensors from 1 MiB "
            "or 256 KiB) were no faster on SmolLM2-135M shapes than the default.",
            "",
            "Staged apply keeps the served weights intact until Complete by design, so it receives into buffers "
            "and, after the last byte, nothing overlaps what Complete does. The engine benchmarked here "
            "(`TensorEngine`) implements `StorageSwap`: a lone tensor's buffer simply becomes the served tensor "
            "at Complete and the replaced memory becomes the next update's buffer, so only the packed small "
            "tensors are copied after the last byte; that copy bounds staged apply as listed above. An engine "
            "that cannot swap (CUDA graphs captured on the weights' addresses, fused or sharded parameters) "
            "copies the whole update at Complete.",
            "",
            "On GPUs the copies run at HBM bandwidth (1 GB in well under a millisecond on an H100, against tens of "
            "milliseconds for 1 GB over NVLink or InfiniBand), do not compete with the transfer for CPU, and NCCL's "
            "per-collective cost is tens of microseconds: that is the setting the 0.90 target describes, and this "
            "host cannot show it (no GPU; NCCL needs one GPU per rank). What would close the remaining gaps here: "
            "send buckets whose tensors already lie back to back in the trainer's memory without packing (flat "
            "parameter buffers as in FSDP or Megatron), and have engines that serve their weights from one flat "
            "buffer receive packed buckets in place too, which would also let staged apply swap them.",
            "",
        ]
    if any("naive" in c.target for c in failed):
        moe = results.get("moe", {})
        ind = _med(_secs(moe["runs"]["individual/staged"])) if moe else 0.0
        nv = _med(_secs(moe["runs"]["naive"])) if moe else 0.0
        out += [
            "### Against the naive way",
            "",
            f"Only wsync's `individual` layout (one collective per tensor, for trainers that send that way) is "
            f"slower than the naive way: {ind:.1f} s against {nv:.1f} s on {moe.get('tensors', 0):,} tensors. "
            "Both pay gloo's per-collective cost, a few hundred microseconds per tensor on two busy cores. "
            "wsync waits for the per-tensor broadcasts a chunk at a time with one completion callback per chunk "
            "(`wait_all` in `wsync_grpc/group.py`): a callback per broadcast made gloo's thread take the GIL "
            "after every collective and measured twice as slow. What is left is allocation (the engine allocates "
            "each tensor it receives; a staged update of 20k tensors) and noise: the two are within the "
            "run-to-run spread of this host. The flattened layout, the default, is several times faster than "
            "the naive way on this model.",
            "",
        ]
    if any("Prepare" in c.target for c in failed):
        c = results["control"]["dense-32b"]["by_bucket"].get(str(results["default_bucket_bytes"]), {})
        n = c.get("proto_messages", 0)
        out += [
            "### Control plane",
            "",
            f"Prepare of the 32B dense model at the default bucket size streams {n} messages. The Python gRPC "
            "server hands every message from its completion-queue thread to the handler thread, about 0.1-0.2 ms "
            "per message on this host whatever its size, which is why the client batches bucket specs "
            "(`BucketBatch`, up to 1 MiB per message), and the engine validates each tensor in Python, about "
            "10-15 us per tensor in `wsync_grpc/metadata.py`. A faster validator (compiled, or one check per "
            "distinct shape) would cut the rest; the figure moves with the load of this shared host.",
            "",
        ]
    if any("memory" in c.target for c in failed):
        out += [
            "### Memory",
            "",
            "The streaming receiver holds two buffers sized for the update's largest bucket; see section 5.",
            "",
        ]
    return out


def markdown(results: dict[str, Any], cks: list[Check]) -> str:
    """The full ``BENCHMARKS.md``."""
    total = results["total_seconds"]
    per_case = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("timings", {}).items())
    lines = [
        "# wsync benchmarks",
        "",
        f"Generated by `make bench` (`python -m bench.run`) on {results['date']}; the whole suite ran in "
        f"{total / 60:.1f} minutes ({per_case}). Raw numbers: `bench/results.json`. Do not edit this file by "
        "hand: run `make bench` again.",
        "",
        "## How it is measured",
        "",
        "This process is the trainer (rank 0); each engine is a separate process (`python -m bench.engine`) "
        "serving a synthetic model with realistic LLM tensor names and shapes (`wsync_grpc.engines.synthetic`, bf16) "
        "through the real gRPC servicer, the same `TensorEngine` `wsync serve --synthetic` runs. Each engine "
        "process also runs a plain HTTP server for the baselines, which use a second, plain torch process group "
        "over the same processes and backend (the servicer does not lend its own group):",
        "",
        "- **ceiling**: one `broadcast` of the model's bytes as one flat `uint8` tensor. Every engine posts its "
        "receive first, into a buffer that is reused and already touched (its own weights' memory), as wsync's "
        "receive-buffer pool does after the first sync; the time runs from the trainer posting its broadcast to "
        "the last engine's receive completing.",
        "- **wsync**: `TrainerClient.sync` from the first Prepare message to the last Complete reply, bucket "
        "planning included (wall time of the call), flattened layout unless said otherwise, client defaults "
        "(tensors of at least the solo threshold in buckets of their own, received in place with streaming "
        "apply; smaller ones packed).",
        "- **naive**: the way RL frameworks drive SGLang today (`bench/naive.py`): per bucket of tensors one JSON "
        "body over HTTP (`names`, `dtypes`, `shapes`), one broadcast per tensor into a freshly allocated tensor, "
        "then a copy into the model.",
        "",
        "Each way runs as its own phase on the same processes (a trainer keeps one apply mode), after a warm-up "
        "whose timing is discarded (its memory and time are reported as the first sync, section 5) and, for "
        "wsync, two more untimed syncs that bring the engine's buffers to their steady state. Every repetition "
        "of wsync or naive is paired with a ceiling run made just before it, and `x ceiling` is the median of "
        "those paired ratios (ceiling time / time). Figures are medians with (min-max). Throughput is bytes of "
        "weights (no padding) per second, GB = 10^9 bytes.",
        "",
        "## Machine",
        "",
        *_machine(results),
        "",
        "This is a shared 2-core VM: other processes ran during the suite (last row above), which slows the "
        "wsync and naive runs (several busy threads) more than the ceiling (one thread per process). Absolute "
        "figures drift from run to run; compare ratios.",
        "",
        "## Targets",
        "",
        "| target | measured | |",
        "|---|---|---|",
        *[f"| {c.target} | {c.measured} | {'PASS' if c.passed else 'FAIL'} |" for c in cks],
        "",
    ]
    if "models" in results:
        lines += [
            "## 1. End to end against the ceiling and the naive way (one engine)",
            "",
            *_throughput_table(results),
            "",
            "![throughput vs model size](bench/throughput.png)",
            "",
            "Where the time goes in a wsync sync (medians; packing overlaps the broadcast, the streaming apply "
            "overlaps it on the engine, the staged apply happens inside Complete):",
            "",
            *_breakdown_table(results),
            "",
        ]
    if "moe" in results:
        lines += ["## 2. Many small tensors", "", *_moe_table(results), ""]
    if "fanout" in results:
        lines += [
            "## 3. Fan-out: the 1 GB model to several engines",
            "",
            "One broadcast reaches every engine; the ceiling is the same raw broadcast to the same engines. All "
            "processes share the 2 cores (with 3 engines, 4 processes), and memory allows it: each engine holds "
            "the model plus, with staged apply, a second copy (about 2 GB per engine), the trainer the model and "
            "two buckets.",
            "",
            *_fanout_table(results),
            "",
        ]
    if "control" in results:
        lines += [
            "## 4. Control plane: Prepare to ready",
            "",
            "Time from the first Prepare message to the reply (every tensor validated against the model, the "
            "receiver armed), against the same metadata as one JSON body POSTed over HTTP and validated by the "
            "engine process (names, dtypes, shapes; no byte offsets, nothing armed). The engine serves "
            "`meta` tensors of these shapes (no weights). Planning (`plan_buckets` + building the messages) is "
            "done before the clock starts and shown apart; `TrainerClient.sync` does it once per sync.",
            "",
            *_control_table(results),
            "",
            "The JSON body must travel as one HTTP request; the protobuf metadata travels as a stream of messages "
            "(bucket specs batched up to 1 MiB each, far below gRPC's 4 MiB default limit) and is validated as "
            "it arrives.",
            "",
        ]
    if "models" in results:
        lines += [
            "## 5. Engine memory during a sync",
            "",
            "Peak resident memory of the engine process during one sync (`VmHWM`, reset through "
            "`/proc/self/clear_refs` just before) minus its resident memory before it. *First sync*: the "
            "engine's receive-buffer pool emptied before it (as on a fresh engine). *Later syncs*: the pool kept "
            "its buffers from the previous sync of the same kind, so the receive needs no new memory; what the "
            "pool keeps between syncs is the last column but one. With streaming apply, lone tensors are "
            "received in place and take nothing; the receiver takes two buffers sized for the largest packed "
            "bucket (so the peak stays at about twice that bucket, or less). With staged apply it keeps every "
            "bucket until Complete, so it needs the size of the update; lone tensors' buffers then become the "
            "served weights (`StorageSwap`) and the memory they replace becomes the pool. This benchmark engine "
            "serves its initial weights as views of one flat buffer, which it also keeps for the ceiling's raw "
            "receives: that memory is not handed back by the first swap, so the second staged sync allocates "
            "and first-touches a new update-sized set of buffers too (seconds per GB of page faults on this host) "
            "and the engine then holds one model more than it would serving separately allocated tensors, which "
            "is what the staged rows' 'kept between syncs' shows. The suite therefore runs two untimed syncs "
            "after the first before the timed ones (an engine serving separately allocated weights would be in "
            "its steady state after one).",
            "",
            *_memory_table(results),
            "",
        ]
        if any(m.get("sweep") for m in results["models"].values()):
            lines += [
                "## 6. Bucket size",
                "",
                f"`DEFAULT_BUCKET_BYTES` is {_mib(results['default_bucket_bytes'])}; the client ramps the first "
                f"and last buckets from {_mib(results['default_ramp_bytes'])} (`DEFAULT_RAMP_BYTES`). Each size "
                "below is used for a whole phase, first sync on an emptied pool, then paired repetitions.",
                "",
                *_sweep_table(results),
                "",
                "![bucket size sweep](bench/buckets.png)",
                "",
                *_sweep_summary(results),
                "",
            ]
    if results.get("profile"):
        lines += [
            "## 7. Where the CPU goes (profile)",
            "",
            "CPU time per run of the trainer (this process) and of the engine, by thread, read from "
            "`/proc/<pid>/task/*/stat` around a batch of runs (`bench/profile.py`): gloo's socket thread moves "
            "the bytes through loopback TCP, its work-queue thread issues the collectives, and the Python threads "
            "are wsync's own work (packing on the trainer; receiver, apply and gRPC on the engine) and torch's "
            "OpenMP threads. Milliseconds per run, ceiling and wsync on the same processes.",
            "",
            *_profile_tables(results),
            "",
        ]
    analysis = _analysis(results, cks)
    if analysis:
        lines += ["## 8. Missed targets: by how much, why, what would close them", "", *analysis]
    lines += [
        "## Reproduce",
        "",
        "```bash",
        "make bench                     # the suite above, under 15 minutes on 2 cores",
        "python -m bench.run --help     # cases, models, bucket sizes, repetitions",
        "```",
        "",
        "On a host with CUDA the same script puts the trainer on `cuda:0` and engine *i* on GPU *i+1* (modulo the "
        "GPU count), and every group uses NCCL; memory is then torch's allocated memory rather than RSS.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``throughput.png`` (and ``buckets.png`` when the sweep ran) into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    models = results.get("models", {})
    if models:
        fig, ax = plt.subplots(figsize=(8, 5))
        order = sorted(models.items(), key=lambda kv: kv[1]["bytes"])
        xs = list(range(len(order)))
        series: dict[str, Callable[[dict[str, Any]], list[float]]] = {
            "ceiling (raw broadcast of the same bytes)": _ceiling_gbps,
            "wsync, streaming apply": lambda m: _gbps(m["bytes"], m["runs"]["streaming"]),
            "wsync, staged apply": lambda m: _gbps(m["bytes"], m["runs"]["staged"]),
            "naive (JSON/HTTP + a broadcast per tensor)": lambda m: _gbps(m["bytes"], m["runs"]["naive"]),
        }
        styles = ["k--o", "C0-o", "C1-s", "C3-^"]
        for (label, fn), style in zip(series.items(), styles, strict=True):
            meds, err = _err([fn(m) for _, m in order])
            ax.errorbar(xs, meds, yerr=err, fmt=style, capsize=3, label=label)
        ticks = [
            f"{_label(n)}\n{m['tensors']} tensors"
            if _label(n).endswith(" GB")
            else f"{_label(n)}\n{m['bytes'] / GB:.2f} GB, {m['tensors']} tensors"
            for n, m in order
        ]
        ax.set_xticks(xs, ticks)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("model (bf16), by size")
        ax.set_ylabel("GB/s (bytes of weights / end-to-end seconds)")
        ax.set_ylim(0, 1.35 * max(max(_ceiling_gbps(m)) for m in models.values()))
        title = f"Weight sync to one engine, {results['backend']} over loopback, {results['machine']['cpu']}"
        ax.set_title(title + "\nmedian of paired repetitions, bars: min-max", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", ncol=2)
        fig.tight_layout()
        path = out_dir / "throughput.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    swept = {n: m for n, m in models.items() if m.get("sweep")}
    if swept:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for i, (name, m) in enumerate(swept.items()):
            sw = m["sweep"]
            sizes = sw["sizes"]
            xs = [b / MiB for b in sizes]
            for mode, marker in (("streaming", "o"), ("staged", "s")):
                meds, err = _err([_ratios(sw["runs"][f"{b}/{mode}"]) for b in sizes])
                style = f"C{i}-{marker}" if mode == "streaming" else f"C{i}--{marker}"
                a1.errorbar(xs, meds, yerr=err, fmt=style, capsize=3, label=f"{_label(name)}, {mode}")
            first = [sw["first"][f"{b}/streaming"]["peak_extra"] / MiB for b in sizes]
            later = [_med([float(r["peak_extra"]) for r in sw["runs"][f"{b}/streaming"]]) / MiB for b in sizes]
            largest = [sw["first"][f"{b}/streaming"]["largest_bucket"] / MiB for b in sizes]
            a2.plot(xs, first, f"C{i}-o", label=f"{_label(name)}, first sync")
            a2.plot(xs, later, f"C{i}:x", label=f"{_label(name)}, later syncs")
            a2.plot(xs, [2.5 * x for x in largest], f"C{i}--", lw=1, label=f"{_label(name)}: 2.5 x largest bucket")
        all_sizes = sorted({b for m in swept.values() for b in m["sweep"]["sizes"]})
        a1.axhline(0.9, color="gray", ls=":", lw=1)
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
        path = out_dir / "buckets.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write(results: dict[str, Any], out: Path, plot_dir: Path) -> list[Check]:
    """Write ``out`` (markdown) and the plots; return the checks."""
    cks = checks(results)
    plots(results, plot_dir)
    out.write_text(markdown(results, cks))
    return cks
