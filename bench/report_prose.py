"""Sections of ``BENCHMARKS.md`` up to the profile: template blocks filled with figures of the run.

Each function returns one section as markdown (paragraphs separated by a
blank line). Judgements that depend on figures are picked by a computed
condition among the template's variants.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from bench import profile as bench_profile
from bench import report_tables as tables
from bench.report_stats import GB, cores, label, med, memory_bytes, mib, ratios, secs, shared
from bench.report_text import fill
from wsync_grpc.wire.convert import PREPARE_BATCH_BYTES

GRPC_DEFAULT_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
"""gRPC's default limit on a received message (``GRPC_DEFAULT_MAX_RECV_MESSAGE_LENGTH``), in bytes."""


def minutes(results: dict[str, Any]) -> str:
    return f"{float(results['total_seconds']) / 60:.1f}"


def header(results: dict[str, Any]) -> str:
    per_case = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("timings", {}).items())
    return fill("header", date=results["date"], minutes=minutes(results), per_case=per_case)


def method() -> str:
    return fill("method", gb_exp=round(math.log10(GB)))


def machine(results: dict[str, Any]) -> str:
    note = fill("machine.shared" if shared(results) else "machine.quiet", cores=cores(results))
    return fill("machine", table=tables.machine(results), note=note)


def targets(cks: list[Any]) -> str:
    return fill("targets", table=tables.targets(cks))


def models(results: dict[str, Any]) -> str:
    return fill("s1", throughput=tables.throughput(results), breakdown=tables.breakdown(results))


def many_tensors(results: dict[str, Any]) -> str:
    return fill("s2", table=tables.moe(results))


def fanout(results: dict[str, Any]) -> str:
    """Section 3, with what the largest fan-out needs in memory against what the host has."""
    fan = results["fanout"]
    nbytes = max(int(f["bytes"]) for f in fan.values())
    engines = max(int(k) for k in fan)
    buckets = [int(r["largest_bucket"]) for f in fan.values() for rs in f["runs"].values() for r in rs]
    need = engines * 2 * nbytes + nbytes + 2 * max(buckets, default=0)
    host = memory_bytes(results)
    name = tables.fanout_model(results)
    return fill(
        "s3",
        model=label(name) if name else f"{nbytes / GB:.2f} GB",
        cores=cores(results),
        engines=engines,
        procs=engines + 1,
        memory=fill("s3.short" if host and need > host else "s3.fits"),
        staged_gb=f"{2 * nbytes / GB:.0f}",
        need_gb=f"{need / GB:.1f}",
        host=results["machine"]["memory"],
        table=tables.fanout(results),
    )


def control(results: dict[str, Any]) -> str:
    below = PREPARE_BATCH_BYTES < GRPC_DEFAULT_MAX_RECEIVE_BYTES
    return fill(
        "s4",
        table=tables.control(results),
        batch=mib(PREPARE_BATCH_BYTES),
        vs_grpc=fill("s4.below" if below else "s4.above"),
        grpc=mib(GRPC_DEFAULT_MAX_RECEIVE_BYTES),
    )


def _faults(results: dict[str, Any]) -> str:
    """What first-touching an update's buffers costs: the largest model's first staged sync against later ones."""
    name, m = max(results["models"].items(), key=lambda kv: kv[1]["bytes"])
    first = float(m["first_staged"]["seconds"])
    later = med(secs(m["runs"]["staged"]))
    per_gb = (first - later) / (m["bytes"] / GB)
    if per_gb <= 0:
        return fill("s5.faults.unknown")
    return fill("s5.faults", model=label(name), first=f"{first:.1f}", later=f"{later:.2f}", per_gb=f"{per_gb:.1f}")


def memory(results: dict[str, Any]) -> str:
    return fill("s5", faults=_faults(results), table=tables.memory(results))


def _spreads(results: dict[str, Any]) -> list[tuple[str, str, dict[int, list[float]]]]:
    """(model, mode, bucket size -> paired ratios) of every swept model and apply mode."""
    out = []
    for name, m in results["models"].items():
        sw = m.get("sweep")
        for mode in ("streaming", "staged") if sw else ():
            out.append((name, mode, {int(b): ratios(sw["runs"][f"{b}/{mode}"]) for b in sw["sizes"]}))
    return out


def _sweep_bullets(results: dict[str, Any]) -> list[str]:
    """Per swept model: sizes that plan the same buckets, and x ceiling by size for each apply mode."""
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
                lines.append(fill("s6.same_plan", model=label(name), sizes=" and ".join(mib(b) for b in same)))
        for mode in ("streaming", "staged"):
            meds = {b: med(ratios(sw["runs"][f"{b}/{mode}"])) for b in sw["sizes"]}
            best = max(meds, key=lambda b: meds[b])
            shown = ", ".join(f"{mib(b)} {v:.2f}" for b, v in meds.items())
            note = (
                fill("s6.by_size.default", default=mib(default), ratio=f"{meds[default]:.2f}")
                if default in meds
                else ""
            )
            lines.append(fill("s6.by_size", model=label(name), mode=mode, shown=shown, best=mib(best), note=note))
    return lines


def _sweep_paragraph(results: dict[str, Any]) -> str:
    """Whether the bucket size moves throughput beyond the noise, and how the smallest size fares."""
    moe = results.get("moe")
    collective = ""
    if moe:
        us = med(secs(moe["runs"]["individual/staged"])) / int(moe["tensors"]) * 1e6
        collective = fill("s6.collective", backend=results["backend"], us=f"{us:.0f}")
    default = fill("s6.default", collective=collective)
    pairs = [(n, mode, by) for n, mode, by in _spreads(results) if len(by) > 1]
    if not pairs:
        return default
    shown, within, slowest = [], True, 0
    for name, mode, by in pairs:
        meds = {b: med(v) for b, v in by.items()}
        spread = max(meds.values()) - min(meds.values())
        noise = med([max(v) - min(v) for v in by.values()])
        within = within and spread <= noise
        slowest += meds[min(meds)] <= min(meds.values())
        shown.append(f"{label(name)} {mode} {spread:.2f} against {noise:.2f}")
    spread_text = fill("s6.within" if within else "s6.beyond", spreads=", ".join(shown))
    smallest = fill("s6.smallest", slowest=slowest, pairs=len(pairs))
    return fill("s6.paragraph", spread=spread_text, smallest=smallest, default=default)


def sweep(results: dict[str, Any]) -> str:
    summary = "\n".join(_sweep_bullets(results)) + "\n\n" + _sweep_paragraph(results)
    return fill(
        "s6",
        bucket=mib(results["default_bucket_bytes"]),
        ramp=mib(results["default_ramp_bytes"]),
        table=tables.sweep(results),
        summary=summary,
    )


def profile(results: dict[str, Any]) -> str:
    out = fill("s7", table=tables.profile(results))
    spy = tables.py_spy(results)
    if spy:
        rate = inspect.signature(bench_profile.record).parameters["rate"].default
        out += "\n\n" + fill("s7.py_spy", rate=rate, table=spy)
    return out


def reproduce(results: dict[str, Any]) -> str:
    return fill("reproduce", minutes=minutes(results), cores=cores(results))
