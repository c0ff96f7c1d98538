"""The delta section of ``BENCHMARKS.md`` and its targets (results of :func:`bench.delta_case.case_delta`).

Every ratio is taken per step between the delta and the whole sync of the same weights, made back to back on the
same processes; medians are over steps 2 and later (the first step after a whole sync changes more: Adam's first
update is large), with step 1, the p95 and the max beside them. Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.colocated_case import p95

WIRE_TARGETS = {"1e-06": 0.025, "1e-05": 0.07}
"""Target: a delta's wire bytes at most this share of the whole update's, per learning rate (median, steps 2+)."""
POSITIONS_DENSITY = 0.03
"""Target: at most this share of elements changed, the positions take at most the values' bytes."""
TIME_RATIO = 1.1
"""Target: a delta sync at most this times the whole sync's time on loopback, at every learning rate."""
LINK_RATIO = 0.3
"""Target: on a link rate-limited to 2 Gbit/s, a delta sync at most this times the whole one (lr 1e-6)."""


def _share(row: dict[str, Any]) -> float:
    d = row.get("forced", row["delta"])
    return d["changed"] / d["elements"] if d["elements"] else 0.0


def _wire(row: dict[str, Any]) -> float:
    return row.get("forced", row["delta"])["wire_bytes"] / row["whole"]["wire_bytes"]


def _time(row: dict[str, Any], way: str = "delta") -> float:
    """The time of the sync of client ``way`` (``"delta"``: with deltas on, its defaults; ``"forced"``: a delta at
    every sync), the trainer's diff included, over the whole sync's."""
    d, w = row.get(way, row["delta"]), row["whole"]
    return (d["total_s"] + d["diff_s"]) / w["total_s"]


def _later(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["step"] >= 2] or list(rows)


def checks(c: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)`` for the delta targets."""
    out = []
    lrs = c["lrs"]
    for lr, limit in WIRE_TARGETS.items():
        target = f"delta, lr {lr}: wire bytes <= {100 * limit:g}% of the whole update (median, steps 2+)"
        rows = lrs.get(lr)
        if not rows:
            out.append((target, "not measured", False))
            continue
        wires = [_wire(r) for r in _later(rows)]
        m = statistics.median(wires)
        measured = f"{100 * m:.2f}% (max {100 * max(wires):.2f}%, step 1 {100 * _wire(rows[0]):.2f}%)"
        out.append((target, measured, m <= limit))
    entries = [r.get("forced", r["delta"]) for rows in lrs.values() for r in rows if _share(r) <= POSITIONS_DENSITY]
    sparse = [d for d in entries if d["values_bytes"]]
    if sparse:
        x = max(d["positions_bytes"] / d["values_bytes"] for d in sparse)
        out.append(
            (
                f"delta: positions <= 1 x the values' bytes where <= {100 * POSITIONS_DENSITY:g}% changed",
                f"at most {x:.2f} x over {len(sparse)} steps",
                x <= 1.0,
            )
        )
    worst, where = 0.0, ""
    for lr, rows in lrs.items():
        m = statistics.median(_time(r) for r in _later(rows))
        if m >= worst:
            worst, where = m, lr
    out.append(
        (
            f"delta: a delta sync (diff included) <= {TIME_RATIO:g} x the whole sync on loopback, every lr",
            f"at most {worst:.2f} x (median, lr {where})",
            worst <= TIME_RATIO,
        )
    )
    target = f"delta: on a 2 Gbit/s link, a delta sync (diff included) <= {LINK_RATIO:g} x the whole one at lr 1e-6"
    link = c.get("link")
    if not link or not link.get("rows"):
        out.append((target, f"not measured{': ' + link['error'][:120] if link and link.get('error') else ''}", False))
    else:
        times = [_time(r) for r in _later(link["rows"])]
        m = statistics.median(times)
        out.append((target, f"{m:.2f} x (median over steps 2+; max {max(times):.2f} x)", m <= LINK_RATIO))
    target = "delta: vLLM tokens/s during a delta sync >= during a whole one"
    v = c.get("vllm")
    if not v or not v.get("syncs"):
        out.append((target, f"not measured{': ' + v['error'][:120] if v and v.get('error') else ''}", False))
    else:
        d, w = _vllm_split(v)
        td, tw = statistics.median(x["tokens_per_s"] for x in d), statistics.median(x["tokens_per_s"] for x in w)
        out.append((target, f"{td:.1f} against {tw:.1f} tokens/s (medians over {len(d)} and {len(w)} syncs)", td >= tw))
    return out


def _vllm_split(v: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The vLLM part's syncs after the warm-up: the deltas, the whole ones."""
    syncs = v["syncs"][v.get("warmup", 0) :]
    return [x for x in syncs if x["delta"]], [x for x in syncs if not x["delta"]]


def section(c: dict[str, Any]) -> str:
    """The markdown section: what ran, and per learning rate the steps' shares, bytes and times."""
    lines = [
        "## Delta updates: only the bfloat16 elements that changed",
        "",
        f"SmolLM2-135M-Instruct trained in float32 with AdamW on the tests' real text ({c['tokens']} tokens, "
        f"{c['window']}-token windows), {c['steps']} steps per learning rate from the same weights; after each "
        "step the same weights synced, back to back in an order rotated per step, to one engine by a client "
        "with deltas on and its defaults (it falls back to whole syncs while deltas cost more: `delta_fallback`), "
        "to another by one that sends a delta at every sync (`delta_fallback=False`: forced) and to a third by one "
        "without (three engine processes serving SmolLM2-135M's shapes in bfloat16, bfloat16 on the wire, digests "
        "on). changed: the share of elements whose bfloat16 value changed; wire: the forced delta's bytes over the "
        "whole update's; limit: the changed values plus one byte of position each, over the whole update's; "
        "positions/values: the delta entries' bytes; time: a sync plus the trainer's diff over the whole sync's; "
        "fell back: the syncs of the client with deltas on that went whole for it. Medians over steps 2 and later, "
        "step 1 apart; p95 and max over the steps"
        + (f"; measured {c['date']} (`--cases delta`)." if c.get("date") else "."),
        "",
        "| lr | changed median (step 1) | wire median (step 1, max) | limit median | positions/values | "
        "forced delta s median (diff s) | whole s median | forced x whole median (p95, max) | "
        "with deltas on x whole median (p95, max) | fell back |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lr, rows in c["lrs"].items():
        later = _later(rows)
        shares = [_share(r) for r in later]
        wires = [_wire(r) for r in later]
        limits = [r.get("forced", r["delta"])["changed"] * 3 / r["whole"]["wire_bytes"] for r in later]
        pv = [
            d["positions_bytes"] / d["values_bytes"]
            for d in (r.get("forced", r["delta"]) for r in later)
            if d["values_bytes"]
        ]
        times = [_time(r, "forced") for r in later]
        auto = [_time(r) for r in later]
        first = rows[0]
        forced = [r.get("forced", r["delta"]) for r in later]
        lines.append(
            f"| {lr} | {100 * statistics.median(shares):.2f}% ({100 * _share(first):.2f}%) "
            f"| {100 * statistics.median(wires):.2f}% ({100 * _wire(first):.2f}%, {100 * max(wires):.2f}%) "
            f"| {100 * statistics.median(limits):.2f}% "
            f"| {statistics.median(pv):.2f} "
            if pv
            else "| - "
        )
        lines[-1] += (
            f"| {statistics.median(d['total_s'] for d in forced):.2f} "
            f"({statistics.median(d['diff_s'] for d in forced):.2f}) "
            f"| {statistics.median(r['whole']['total_s'] for r in later):.2f} "
            f"| {statistics.median(times):.2f} ({p95(times):.2f}, {max(times):.2f}) "
            f"| {statistics.median(auto):.2f} ({p95(auto):.2f}, {max(auto):.2f}) "
            f"| {sum(bool(r['delta'].get('fell_back')) for r in rows)} of {len(rows)} |"
        )
    phases = []
    for lr, rows in c["lrs"].items():
        later = _later(rows)
        parts = ", ".join(
            f"{k} {statistics.median(r.get('forced', r['delta'])['phases'][k] for r in later):.2f}/"
            f"{statistics.median(r['whole']['phases'][k] for r in later):.2f}"
            for k in ("prepare", "broadcast", "verify", "apply")
        )
        phases.append(f"lr {lr}: {parts}")
    lines += [
        "",
        "Where a sync's time goes, forced delta/whole (medians, seconds): "
        + "; ".join(phases)
        + ". A delta's `verify` "
        "includes the engine rebuilding each changed tensor from a copy of the one it serves and hashing the "
        "result. On loopback the wire runs at memory-copy speed, so a delta saves little time there: its win is "
        "where the wire is the bottleneck.",
    ]
    link = c.get("link")
    if link and link.get("rows"):
        later = _later(link["rows"])
        lines += [
            "",
            f"Over a link rate-limited to {link['rate']} (`tc` token bucket on a veth pair into a network namespace "
            "per engine, `wsync serve --synthetic` there), lr 1e-6, the same steps synced both ways: delta "
            f"{statistics.median(r['delta']['total_s'] + r['delta']['diff_s'] for r in later):.2f} s (diff "
            f"included) against whole {statistics.median(r['whole']['total_s'] for r in later):.2f} s, medians over "
            f"steps 2+: {statistics.median(_time(r) for r in later):.2f} x (max {max(_time(r) for r in later):.2f} "
            f"x; step 1 {_time(link['rows'][0]):.2f} x).",
        ]
        lines += [
            "",
            "Where the time goes: a delta sync costs the trainer a diff (converting every tensor to bfloat16, "
            "comparing it with the base word by word, listing the changed positions: passes over the whole model, "
            "bound by memory bandwidth on this 2-core host, and done before the Prepare because each entry's size "
            "goes in its bucket's spec) and the engine a rebuild (a copy of each changed tensor into memory its "
            "pool kept, the scatter, the digest of the result) where a whole sync only moves bytes. On loopback, "
            "whose wire is itself a memory copy, those passes cost about what the bytes they save cost (the forced "
            "column), so a client left to decide falls back to whole syncs there and tries a delta again every "
            "eight syncs; over the rate-limited link they are what is left of the delta's time. Overlapping the two "
            "(each group of tensors declared with `Update` as soon as it is diffed, `PrepareHeader.incremental`, "
            "while the engine rebuilds the group before it) was built and measured on this host: no faster (0.33 x "
            "against 0.31 x in the same session), since the diff and the rebuild then compete for the same two "
            "cores and memory bus; it was not kept. Between hosts, where the engine rebuilds on its own, it would "
            "hide the rebuild behind the diff.",
        ]
    elif link and link.get("error"):
        lines += ["", f"The rate-limited link part did not run: {link['error'][:300]}"]
    v = c.get("vllm")
    if v and v.get("syncs"):
        d, w = _vllm_split(v)
        if d and w:
            lines += [
                "",
                "On this 2-core host the trainer's diff and the engine's rebuild take CPU that vLLM's generation "
                "would use; a trainer on its own host leaves only the engine's share.",
                "",
                "vLLM (`wsync serve --engine vllm`, SmolLM2-135M-Instruct in bfloat16), staged syncs alternately delta "
                "and whole (`delta_anchor_every=1`, no fallback), about 1% of every matrix moved before each, while a "
                "request "
                "streams tokens:",
                "",
                "| sync | n | wall s median (max) | tokens/s median | longest gap s median (max) | wire MB median |",
                "|---|---|---|---|---|---|",
            ]
            for name, xs in (("delta", d), ("whole", w)):
                lines.append(
                    f"| {name} | {len(xs)} | {statistics.median(x['wall_s'] for x in xs):.2f} "
                    f"({max(x['wall_s'] for x in xs):.2f}) | {statistics.median(x['tokens_per_s'] for x in xs):.1f} "
                    f"| {statistics.median(x['max_gap_s'] for x in xs):.2f} ({max(x['max_gap_s'] for x in xs):.2f}) "
                    f"| {statistics.median(x['wire_bytes'] for x in xs) / 1e6:.1f} |"
                )
            idle = "; ".join(
                f"lr {lr}: {statistics.median(r['forced']['diff_s'] for r in _later(rows)):.2f} ("
                f"{statistics.median(r['forced']['changed'] / r['forced']['elements'] for r in _later(rows)):.2%} "
                "changed)"
                for lr, rows in c["lrs"].items()
                if all("forced" in r for r in _later(rows))
            )
            lines += [
                "",
                "Where the delta syncs' extra time goes (medians, seconds): the trainer's diff "
                f"{statistics.median(x['diff_s'] for x in d):.2f} (whole syncs: converting to bfloat16, "
                f"{statistics.median(x['diff_s'] for x in w):.2f}), where the same model's diff beside an idle engine "
                f"took {idle} above: here its torch operations share the two cores with vLLM's generation; "
                "Complete's verifying phase "
                f"{statistics.median(x['phases']['verify'] for x in d):.2f} against "
                f"{statistics.median(x['phases']['verify'] for x in w):.2f} (the worker rebuilds its kept copy, then "
                "loads every tensor through vLLM's weight processing as for a whole update).",
            ]
    elif v and v.get("error"):
        lines += ["", f"The vLLM part did not run: {v['error'][:300]}"]
    return "\n".join(lines)


def missed(c: dict[str, Any], failed: Sequence[str]) -> str:
    """Section 8's paragraph on the missed delta targets (``failed``: their target texts): by how much, where the
    time goes, what would close it."""
    out: list[str] = []
    link = c.get("link")
    if any("link" in f for f in failed) and link and link.get("rows"):
        later = _later(link["rows"])
        diff = statistics.median(r["delta"]["diff_s"] for r in later)
        sync = statistics.median(r["delta"]["total_s"] for r in later)
        verify = statistics.median(r["delta"]["phases"]["verify"] for r in later)
        whole = statistics.median(r["whole"]["total_s"] for r in later)
        out.append(
            f"Over the rate-limited link a delta sync takes {statistics.median(_time(r) for r in later):.2f} x the "
            f"whole one (target {LINK_RATIO:g} x): the trainer's diff {diff:.2f} s and the sync {sync:.2f} s (of "
            f"which the engine's rebuild and digest {verify:.2f} s) against {whole:.2f} s for the whole update on "
            f"the wire. The delta's own bytes ({statistics.median(r['delta']['wire_bytes'] for r in later) / 1e6:.1f}"
            f" MB) are a small part of it: what is left is passes over the whole model on this host's two cores "
            f"(converting and diffing on the trainer; copying, patching and hashing on the engine), which would have "
            f"to fit in {LINK_RATIO * whole:.2f} s. Each pass already runs one tensor per thread and is bound by the "
            "host's memory bandwidth; patching the memory the engine swapped out at the last apply instead of "
            "copying the served tensor would not shorten it (its scattered writes and reads miss the cache and cost "
            "about what the copy does)."
        )
    if any("loopback" in f for f in failed):
        for lr, rows in c["lrs"].items():
            later = _later(rows)
            if statistics.median(_time(r) for r in later) <= TIME_RATIO:
                continue
            plain = [r for r in later if r["delta"]["fell_back"]]
            if not plain:
                continue
            # A whole sync right after a delta (the step before ran one) against the others.
            ran = {r["step"]: r["delta"]["delta"] for r in rows}
            after = [r for r in plain if ran.get(r["step"] - 1)]
            rest = [r for r in plain if not ran.get(r["step"] - 1)]
            ratio = lambda rs: statistics.median(r["delta"]["total_s"] / r["whole"]["total_s"] for r in rs)  # noqa: E731
            split = f"those right after a delta {ratio(after):.2f} x the other client's, " if after else ""
            others = f"the others {ratio(rest):.2f} x" if rest else ""
            out.append(
                f"On loopback at lr {lr} the client with deltas on sent {len(plain)} of its {len(later)} syncs after "
                f"step 1 whole, as with deltas off (a delta with its diff cost more there: the forced client's took "
                f"{statistics.median(_time(r, 'forced') for r in later):.2f} x), and a try of a delta every "
                f"eight syncs. Of those whole syncs, {split}{others}: an engine that kept only the receive buffers "
                "its last update used received the whole update after a delta into freshly allocated memory, a "
                "page fault every 4 KiB (since this run an engine on CPU keeps the last whole update's buffers "
                "through a delta: `BufferPool.trim`); the median of "
                f"{statistics.median(_time(r) for r in later):.2f} x is those syncs and the tries."
            )
    v = c.get("vllm")
    if any("vLLM" in f for f in failed) and v and v.get("syncs"):
        d, w = _vllm_split(v)
        if d and w:
            rates = [x["tokens_per_s"] for x in d + w]
            out.append(
                f"During vLLM syncs the stream made {statistics.median(x['tokens_per_s'] for x in d):.1f} tokens/s "
                f"during a delta against {statistics.median(x['tokens_per_s'] for x in w):.1f} during a whole one, "
                f"while single syncs of either kind ranged from {min(rates):.1f} to {max(rates):.1f}: a difference "
                f"this run's {len(d)} and {len(w)} syncs cannot resolve. A delta sync does more CPU work in the "
                "worker here (Complete's verifying phase "
                f"{statistics.median(x['phases']['verify'] for x in d):.2f} s against "
                f"{statistics.median(x['phases']['verify'] for x in w):.2f} s: the same full load through vLLM's "
                "weight processing, with no wire to overlap it) and the trainer's diff shares the host's two cores."
            )
    return "**Delta.** " + " ".join(out) if out else ""
