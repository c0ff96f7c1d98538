"""Section 8 of ``BENCHMARKS.md``: which targets were missed, by how much, why, and what would close them.

Every figure comes from the run; every judgement (a ratio rising with a
share, a gap within the noise) is picked among the template's variants by a
computed condition.
"""

from __future__ import annotations

import itertools
from typing import Any

from bench import report_colocated, report_delta, report_detection, report_fleet
from bench.profile import PYTHON
from bench.report_checks import LARGE_RATIO, MOE_SPEEDUP, PREPARE_LIMITS, Check, limit_text, slower_than_naive
from bench.report_stats import col, control_label, cores, label, med, mib, ratios, secs, shared, tensor_sizes
from bench.report_tables import SIDES, THREAD_GROUPS, cpu
from bench.report_text import fill
from wsync_grpc.core.planning import DEFAULT_SOLO_BYTES
from wsync_grpc.wire.convert import PREPARE_BATCH_BYTES

SIMILAR = 0.15
"""Cores busy in a wsync run within this fraction of the ceiling's count as "about as many"."""


def _share(d: dict[str, Any], side: str, fn: str) -> float:
    """py-spy share of function ``fn`` (by name) on ``side``, 0 when absent."""
    return sum(float(share) for f, share in d.get(side, {}).get("top", []) if f.split(" (")[0] == fn)


def _profiled(results: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(model, apply mode, wsync run, ceiling run) of every profiled run."""
    out = []
    for name, m in results.get("profile", {}).items():
        for mode in ("streaming", "staged"):
            if m["runs"].get(mode) is not None:
                out.append((name, mode, m["runs"][mode], m["runs"]["ceiling"]))
    return out


def profile_findings(results: dict[str, Any]) -> list[str]:
    """One line per profiled model and apply mode: extra CPU, what it is, and the bound it sets."""
    out = []
    for name, mode, run, ceil in _profiled(results):
        spy = results["profile"][name].get("py_spy", {}).get(mode, {})
        tp = float(run["trainer"].get(PYTHON, 0.0))
        ep = float(run["engine"].get(PYTHON, 0.0))
        gloo = sum(float(run[s].get(g, 0.0)) - float(ceil[s].get(g, 0.0)) for s in SIDES for g in THREAD_GROUPS[1:])
        ms = {
            "cpu": cpu(run),
            "ceiling_cpu": cpu(ceil),
            "pack": tp * _share(spy, "trainer", "pack_bucket"),
            "apply": ep * _share(spy, "engine", "TensorEngine.load_weights"),
            "trainer_python": tp,
            "engine_python": ep,
        }
        out.append(
            fill(
                "miss.profile.finding",
                model=label(name),
                mode=mode,
                busy=f"{cpu(run) / float(run['seconds']):.2f}",
                ceiling_busy=f"{cpu(ceil) / float(ceil['seconds']):.2f}",
                cores=cores(results),
                cpu_ratio=f"{cpu(ceil) / cpu(run):.2f}",
                wall_ratio=f"{float(ceil['seconds']) / float(run['seconds']):.2f}",
                gloo=f"{gloo * 1e3:+.0f}",
                **{k: f"{v * 1e3:.0f}" for k, v in ms.items()},
            )
        )
    return out


def _time_bullets(results: dict[str, Any]) -> list[str]:
    """Per model: ceiling, streaming and staged time and CPU, and the bound the staged apply sets; then noise."""
    out = []
    for name, m in results["models"].items():
        st, sm = m["runs"]["staged"], m["runs"]["streaming"]
        raw = med(col(st + sm, "raw"))
        apply = med(col(st, "apply"))
        out.append(
            fill(
                "miss.ratio.model",
                model=label(name),
                raw=f"{raw * 1e3:.0f}",
                raw_cpu=f"{med(col(sm, 'raw_cpu')):.2f}",
                streaming=f"{med(secs(sm)) * 1e3:.0f}",
                streaming_cpu=f"{med(col(sm, 'cpu')):.2f}",
                staged=f"{med(secs(st)) * 1e3:.0f}",
                apply=f"{apply * 1e3:.0f}",
                bound=f"{raw / (raw + apply):.2f}",
            )
        )
    default = results["default_bucket_bytes"]
    for name, m in results["models"].items():
        sw = m.get("sweep")
        if sw and default in sw["sizes"]:
            a = med(ratios(m["runs"]["streaming"]))
            b = med(ratios(sw["runs"][f"{default}/streaming"]))
            out.append(fill("miss.ratio.noise", model=label(name), models_case=f"{a:.2f}", sweep_case=f"{b:.2f}"))
    return out


def _solo_shares(results: dict[str, Any]) -> str:
    """Share of each model's bytes in lone tensors against its streaming ratio, and whether the ratio follows it."""
    solo = int(results.get("solo_bytes", 0))
    rows = []
    for name, m in results["models"].items():
        sizes = tensor_sizes(name, int(m["bytes"]), int(m["tensors"]))
        if sizes:
            share = sum(b for _, b in sizes if b >= solo) / int(m["bytes"])
            rows.append((share, med(ratios(m["runs"]["streaming"])), name))
    if len(rows) < 2:
        return ""
    rows.sort()
    rises = all(a[1] <= b[1] for a, b in itertools.pairwise(rows))
    shares = ", ".join(f"{label(n)} {s:.0%} ({r:.2f} x)" for s, r, n in rows)
    return fill("why.share.rises" if rises else "why.share.mixed", shares=shares)


def _busy(results: dict[str, Any]) -> str:
    """How many cores wsync kept busy against the ceiling in the profile."""
    runs = _profiled(results)
    if not runs:
        return ""
    busy = [(n, mode, cpu(r) / float(r["seconds"]), cpu(c) / float(c["seconds"])) for n, mode, r, c in runs]
    shown = ", ".join(f"{label(n)} {mode} {w:.2f} against {c:.2f}" for n, mode, w, c in busy)
    x = [w / c for _, _, w, c in busy]
    if all(abs(v - 1) <= SIMILAR for v in x):
        kind = "same"
    else:
        kind = "fewer" if all(v < 1 for v in x) else "more" if all(v > 1 for v in x) else "mixed"
    return fill(f"why.busy.{kind}", cores=cores(results), runs=shown)


def _small(results: dict[str, Any]) -> str:
    """CPU of the profiled model with the most bytes in packed tensors, against the ceiling's."""
    solo = int(results.get("solo_bytes", 0))
    best: tuple[float, str, float] | None = None
    for name, m in results.get("profile", {}).items():
        model = results.get("models", {}).get(name, {})
        sizes = tensor_sizes(name, int(model.get("bytes", 0)), int(model.get("tensors", 0)))
        packed = [b for _, b in sizes if b < solo]
        if packed and "streaming" in m["runs"] and (best is None or sum(packed) / m["bytes"] > best[0]):
            best = (sum(packed) / m["bytes"], name, max(packed))
    if best is None:
        return ""
    runs = results["profile"][best[1]]["runs"]
    return fill(
        "why.small",
        model=label(best[1]),
        packed_share=f"{best[0]:.0%}",
        largest=f"{best[2] / 1e6:.1f}",
        cpu_x=f"{cpu(runs['streaming']) / cpu(runs['ceiling']):.2f}",
    )


def _wall(results: dict[str, Any]) -> str:
    """Profiled runs whose wall-time ratio fell below their CPU ratio."""
    below = [
        f"{label(n)} {mode}"
        for n, mode, r, c in _profiled(results)
        if float(c["seconds"]) / float(r["seconds"]) < cpu(c) / cpu(r)
    ]
    return fill("why.wall", runs=", ".join(below)) if below else ""


def _individual(results: dict[str, Any]) -> str:
    """The MoE case's one-collective-per-tensor layout against the flattened layout and the ceiling."""
    moe = results.get("moe")
    if not moe:
        return ""
    runs = moe["runs"]["individual/staged"]
    n = int(moe["tensors"])
    ind, flat = med(secs(runs)), med(secs(moe["runs"]["flattened/staged"]))
    return fill(
        "why.individual",
        verdict=fill("why.individual.more" if ind > flat else "why.individual.less"),
        individual=f"{ind:.2f}",
        tensors=f"{n:,}",
        kb=f"{moe['bytes'] / n / 1e3:.1f}",
        us=f"{ind / n * 1e6:.0f}",
        flattened=f"{flat:.2f}",
        ceiling=f"{med(col(runs, 'raw')):.2f}",
    )


def why(results: dict[str, Any]) -> str:
    """The "Why." paragraph: what the ceiling does on this host and what wsync adds to it."""
    bg = results.get("background_cores", {})
    by_case = ", ".join(f"{k} {v:.1f}" for k, v in bg.items())
    others = fill("why.others.shared", by_case=by_case) if shared(results) else fill("why.others.quiet")
    wire = "why.wire.gloo" if results["backend"] == "gloo" else "why.wire.other"
    solo = int(results.get("solo_bytes", 0))
    solo_name = fill("why.solo.default" if solo == DEFAULT_SOLO_BYTES else "why.solo.option")
    parts = [
        fill(wire, cores=cores(results), others=others),
        fill("why.solo", solo=mib(solo), solo_name=solo_name),
        _solo_shares(results),
        fill("why.packed", busy=_busy(results)),
        _small(results),
        _wall(results),
        _individual(results),
    ]
    return " ".join(p for p in parts if p)


def _ratio(results: dict[str, Any], missed: list[Check]) -> list[str]:
    shown = "; ".join(f"{c.target.split(':')[0]} at {c.measured}" for c in missed)
    out = [fill("miss.ratio", missed=shown, bullets=_time_bullets(results))]
    findings = profile_findings(results)
    if findings:
        out.append(fill("miss.profile", findings=findings))
    no_gpu = fill("why.gpu.no_gpu") if results.get("machine", {}).get("cuda") == "none" else ""
    out += [why(results), fill("why.staged"), fill("why.gpu", target=f"{LARGE_RATIO:.2f}", host=no_gpu)]
    return out


def _naive(results: dict[str, Any], failed: list[Check]) -> str:
    slower, _ = slower_than_naive(results)
    moe = results.get("moe")
    out = []
    flattened_x = ""
    if moe:
        nv = med(secs(moe["runs"]["naive"]))
        flat = [(mode, nv / med(secs(moe["runs"][f"flattened/{mode}"]))) for mode in ("streaming", "staged")]
        flattened_x = " and ".join(f"{x:.1f} x ({mode} apply)" for mode, x in flat)
    if moe and [(n, w) for n, w, _ in slower] == [("moe-20k", "individual/staged")]:
        ind_runs, nv_runs = secs(moe["runs"]["individual/staged"]), secs(moe["runs"]["naive"])
        n = int(moe["tensors"])
        overlap = max(min(ind_runs), min(nv_runs)) <= min(max(ind_runs), max(nv_runs))
        ranges = {"individual_range": ind_runs, "naive_range": nv_runs}
        noise = fill(
            "naive.noise.within" if overlap else "naive.noise.beyond",
            **{k: f"{min(v):.2f}-{max(v):.2f}" for k, v in ranges.items()},
        )
        out.append(
            fill(
                "naive.individual",
                individual=f"{med(ind_runs):.1f}",
                naive=f"{med(nv_runs):.1f}",
                tensors=f"{n:,}",
                backend=results["backend"],
                individual_us=f"{med(ind_runs) / n * 1e6:.0f}",
                naive_us=f"{med(nv_runs) / n * 1e6:.0f}",
                noise=noise,
                flattened_x=flattened_x,
            )
        )
    elif slower:
        shown = ", ".join(f"{label(name)} {way} ({x:.2f} x)" for name, way, x in slower)
        out.append(fill("naive.other", slower=shown))
    if any(c.kind == "moe" for c in failed):
        out.append(fill("naive.moe", model=label("moe-20k"), flattened_x=flattened_x, target=f"{MOE_SPEEDUP:g}"))
    return " ".join(out)


def _prepare(results: dict[str, Any], missed: list[Check]) -> str:
    default = str(results["default_bucket_bytes"])
    lines = []
    for c in missed:
        ctl = results["control"][c.model]
        v = ctl["by_bucket"][default]
        t = med(v["runs"]["prepare"])
        lines.append(
            fill(
                "miss.prepare.model",
                model=control_label(results, c.model),
                messages=v["proto_messages"],
                ms=f"{t * 1e3:.1f}",
                target=limit_text(PREPARE_LIMITS[c.model]),
                us=f"{t / int(ctl['tensors']) * 1e6:.1f}",
                message_ms=f"{t / int(v['proto_messages']) * 1e3:.1f}",
            )
        )
    return fill("miss.prepare", models=" ".join(lines), batch=mib(PREPARE_BATCH_BYTES))


def missed(results: dict[str, Any], cks: list[Check]) -> list[str]:
    """Section 8's paragraphs: per kind of missed target, by how much, why, what would close it (empty: none)."""
    failed = [c for c in cks if not c.passed]
    out: list[str] = []
    ratio = [c for c in failed if c.kind == "ratio"]
    if ratio:
        out += _ratio(results, ratio)
    naive = [c for c in failed if c.kind in ("naive", "moe")]
    if naive:
        out.append(fill("miss.naive", text=_naive(results, naive)))
    prepare = [c for c in failed if c.kind == "prepare"]
    if prepare:
        out.append(_prepare(results, prepare))
    if any(c.kind == "memory" for c in failed):
        out.append(fill("miss.memory"))
    fleet = [c.target for c in failed if c.kind == "fleet"]
    if fleet:
        out.append(report_fleet.missed(results["fleet"], fleet))
    detection = [c.target for c in failed if c.kind == "detection"]
    if detection:
        out.append(report_detection.missed(results["detection"], detection))
    colocated = [c.target for c in failed if c.kind == "colocated"]
    if colocated:
        out.append(report_colocated.missed(results["colocated"], colocated))
    delta = [c.target for c in failed if c.kind == "delta"]
    if delta:
        out.append(report_delta.missed(results["delta"], delta))
    return [p for p in out if p]
