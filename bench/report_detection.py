"""The detection section of ``BENCHMARKS.md`` and its targets (results of :func:`bench.detection_case.case_detection`).

Times are seconds from the trainer's SIGKILL to the engine's first ``GetStatus`` reply saying
``FAILED`` for the killed update.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.colocated_case import p95

DETECTION_LIMIT_S = 1.0
"""Target: every kill of a mode noticed (``FAILED``, ``PEER_LOST``) within this many seconds of the SIGKILL."""
MIN_KILLS = 3
"""Target: at least this many kills per apply mode noticed by the ``Watch`` window (when the results do not say)."""
MODES = ("staged", "streaming")


def noticed(r: dict[str, Any]) -> bool:
    """Whether a kill was noticed as a lost peer: ``FAILED`` with reason ``PEER_LOST`` within the case's wait."""
    return r.get("seconds") is not None and r.get("reason") == "PEER_LOST"


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode's kills, in seconds: the first apart; median, p95 and max of the later ones the engine noticed by
    its ``Watch`` window (``path`` ``watch``: the bound measured); median of those it noticed by a broken receive
    (``group``); max of all; counts, and the kills not noticed as ``PEER_LOST``."""
    times = [float(r["seconds"]) for r in runs if r.get("seconds") is not None]
    watch = [float(r["seconds"]) for r in runs[1:] if noticed(r) and r.get("path") == "watch"]
    group = [float(r["seconds"]) for r in runs if noticed(r) and r.get("path") == "group"]
    engine = [float(r["engine_seconds"]) for r in runs if noticed(r) and r.get("path") == "watch"]
    first = runs[0] if runs else {}
    return {
        "kills": len(runs),
        "missed": sum(not noticed(r) for r in runs),
        "by_watch": sum(noticed(r) and r.get("path") == "watch" for r in runs),
        "by_group": sum(noticed(r) and r.get("path") == "group" for r in runs),
        "first": first.get("seconds"),
        "first_path": first.get("path") or "-",
        "median": statistics.median(watch) if watch else None,
        "p95": p95(watch) if watch else None,
        "max_watch": max(watch) if watch else None,
        "group_median": statistics.median(group) if group else None,
        "engine_median": statistics.median(engine) if engine else None,
        "max": max(times) if times else None,
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def checks(d: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)``: per apply mode, every kill noticed within the limit, enough of them by the
    ``Watch`` window; then the recovery."""
    out = []
    need = int(d.get("min_watch_kills", MIN_KILLS))
    for mode in MODES:
        s = summary(d["runs"].get(mode, []))
        target = (
            f"trainer SIGKILLed mid-broadcast, {mode}: engine FAILED (PEER_LOST) <= {DETECTION_LIMIT_S:g} s, "
            f"every kill, >= {need} by the Watch window"
        )
        measured = f"max {_s(s['max'])} s over {s['kills']} kills, {s['by_watch']} by the Watch window"
        measured += f" (first {_s(s['first'])} s; later, by the window: median {_s(s['median'])} s)"
        if s["missed"]:
            measured += f"; {s['missed']} not noticed as PEER_LOST"
        ok = not s["missed"] and s["by_watch"] >= need and s["max"] is not None and s["max"] <= DETECTION_LIMIT_S
        out.append((target, measured, ok))
    bad = [m for m in MODES if not d.get("recovery", {}).get(m, {}).get("ok")]
    measured = "yes, both modes" if not bad else "no: " + ", ".join(bad)
    out.append(("after the kills, the next trainer's plain init and sync succeed", measured, not bad))
    return out


def missed(d: dict[str, Any], targets: Sequence[str]) -> str:
    """The analysis paragraph for missed detection targets: which, and what the figures are made of."""
    window = float(d["reattach_seconds"]) + float(d["gone_poll_seconds"])
    return "\n".join(
        [
            "### Detection of a killed trainer",
            "",
            f"Missed: {'; '.join(targets)}. The engine's window is `REATTACH_S + GONE_POLL_S` = {window:g} s "
            f"(`wsync_grpc/service/watch.py`), one more `REATTACH_S` when a bucket still completes during the "
            "wait; a kill past the target means that window grew, a bucket landed after the Watch ended, or the "
            "host's load delayed the engine's threads (see the detection section's table).",
        ]
    )


def _margin(d: dict[str, Any], reattach: float, gone: float) -> str:
    """A sentence on where this run's kills noticed by the window fell within it (empty when none were)."""
    runs = [r for rs in d["runs"].values() for r in rs]
    watch = [float(r["seconds"]) for r in runs if noticed(r) and r.get("path") == "watch"]
    if not watch:
        return ""
    over = statistics.median(watch) - reattach
    where = f"well within `GONE_POLL_S` ({gone:g} s)" if over < gone / 2 else f"near or past `GONE_POLL_S` ({gone:g} s)"
    return (
        f" In this run the kills noticed by the window took `REATTACH_S` plus {over * 1e3:.0f} ms at the median "
        f"(both modes), {where}."
    )


def section(d: dict[str, Any]) -> str:
    """The markdown section: what ran, one row per apply mode, what the bound is made of, the recovery."""
    reattach, gone = float(d["reattach_seconds"]), float(d["gone_poll_seconds"])
    window = reattach + gone
    points = ", ".join(f"{x:.0%}" for x in d.get("kill_at", [0.0]))
    lines = [
        "## Detection: a trainer killed mid-broadcast",
        "",
        f"One engine process serving the synthetic `{d['model']}` model; per apply mode, {d['kills']} trainers "
        f"(more, up to {2 * int(d['kills'])}, until {int(d.get('min_watch_kills', MIN_KILLS))} were noticed by "
        "the window below), each a process of its own (`bench/detection_trainer.py`: `TrainerClient.init`, then "
        "one sync), SIGKILLed once the engine's `GetStatus` showed the broadcast under way (some bytes received, "
        f"not all; the kills wait in turn for more than {points} of the bytes). From the SIGKILL, `GetStatus` "
        f"every {float(d['poll_seconds']) * 1e3:.0f} ms until the engine reports `FAILED` for that update"
        + (f", measured {d['date']} (`--cases detection`)" if d.get("date") else "")
        + ". Seconds from the kill to that reply. The engine notices a kill in one of two ways: *watch*, the "
        "trainer's held `Watch` call ended and no bucket nor re-attached `Watch` came within the window (the bound "
        "this section measures); *group*, a receive posted in the weight-sync group broke when the trainer's "
        "sockets closed, before the window ran out. The first kill of each mode is shown apart (its way in "
        "brackets); median, p95 and max are over the later kills noticed by the window; *engine's own* is the "
        "failure time the engine recorded (`last_error.unix_seconds`) minus the kill's, median of the kills "
        "noticed by the window.",
        "",
        "| apply mode | kills (watch / group) | bytes received at the kill | first kill | median | p95 | max | "
        "engine's own | by group, median | max, every kill | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        runs = d["runs"].get(mode, [])
        if not runs:
            continue
        s = summary(runs)
        fracs = [r["bytes_received"] / r["bytes_expected"] for r in runs if r.get("bytes_expected")]
        reasons = ", ".join(sorted({r.get("reason") or "none" for r in runs}))
        lines.append(
            f"| {mode} | {len(runs)} ({s['by_watch']} / {s['by_group']}) | {min(fracs):.0%}-{max(fracs):.0%} | "
            f"{_s(s['first'])} ({s['first_path']}) | {_s(s['median'])} | {_s(s['p95'])} | {_s(s['max_watch'])} | "
            f"{_s(s['engine_median'])} | {_s(s['group_median'])} | {_s(s['max'])} | {reasons} |"
        )
    rec = d.get("recovery", {})
    shown = ", ".join(
        f"{m} {'succeeded' if rec[m].get('ok') else 'FAILED'}"
        + (f" ({rec[m]['seconds']:.2f} s)" if rec[m].get("seconds") is not None else "")
        for m in MODES
        if m in rec
    )
    lines += [
        "",
        "What the bound is made of: the trainer's held `Watch` call ends with its connection (gRPC's end-of-call "
        f"callback, or the stream's own check for a gone caller every `GONE_POLL_S` = {gone:g} s); the engine "
        f"then waits `REATTACH_S` = {reattach:g} s for a bucket or a re-attached `Watch` before it declares the "
        "trainer lost (`PEER_LOST`; `wsync_grpc/service/watch.py`), one more `REATTACH_S` when a bucket still "
        f"completes during the wait. The window `REATTACH_S + GONE_POLL_S` = {window:g} s is a deliberate "
        "trade-off: a live trainer whose Watch connection dropped re-attaches within it and is not taken for "
        f"dead. The target ({DETECTION_LIMIT_S:g} s, every kill) leaves {DETECTION_LIMIT_S - window:.2f} s above "
        "that window for the polling and the host's load, so a change that lengthens either constant, or delays "
        "the end of the call reaching the engine, fails it." + _margin(d, reattach, gone),
        "",
        f"Recovery: after the kills of each mode, nothing done to the engine, one more trainer's plain `init` "
        f"(no force) and sync to the end: {shown}; the engine then serves that version, clean and not paused.",
    ]
    return "\n".join(lines)
