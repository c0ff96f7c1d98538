"""The sharded-trainer section of ``BENCHMARKS.md`` and its targets (:func:`bench.sharded_case.case_sharded`)."""

from __future__ import annotations

import statistics
from typing import Any

WAYS = ("ceiling", "gather", "direct", "gather_all")

BOOKKEEPING = 2 << 20
"""Slack on the memory bounds for the call's own bookkeeping (its plan, its messages, the exchanged
piece lists), in bytes: the figures are a whole process's resident memory."""
LABELS = {
    "ceiling": "ceiling: raw gloo broadcast of the same bytes, rank 0 to the others (no engine)",
    "gather": '`sync(mode="gather")`',
    "direct": '`sync(mode="direct")`',
    "gather_all": "every parameter gathered, then one sync (today's way)",
}


def _rows(d: dict[str, Any], way: str, ranks: int, rank: int | None = None) -> list[dict[str, Any]]:
    return [r for r in d["rows"] if r["way"] == way and r["ranks"] == ranks and (rank is None or r["rank"] == rank)]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def seconds(d: dict[str, Any], way: str, ranks: int) -> float:
    """Median wall time of ``way`` with ``ranks`` trainer ranks (rank 0's), in seconds."""
    return _median([r["seconds"] for r in _rows(d, way, ranks, 0)])


def peak(d: dict[str, Any], way: str, ranks: int) -> int:
    """The largest peak extra memory of any rank (median over the repetitions), in bytes."""
    per_rank = [_median([r["peak_extra_bytes"] for r in _rows(d, way, ranks, k)]) for k in range(ranks)]
    return int(max(per_rank)) if per_rank else 0


def checks(d: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)``: the memory bounds per mode, and direct against gather at 2 ranks."""
    rows = d["rows"]
    bucket = int(d["bucket_bytes"])
    largest = max(r["largest_tensor_bytes"] for r in rows)
    out = []
    for ranks in (1, 2):
        direct, gather, everything = (peak(d, w, ranks) for w in ("direct", "gather", "gather_all"))
        slack = BOOKKEEPING
        out += [
            (f"direct, {ranks} rank(s): peak extra memory per rank <= 2 buckets (+2 MiB bookkeeping)",
             f"{direct / 1e6:.1f} MB (2 buckets: {2 * bucket / 1e6:.1f} MB)", direct <= 2 * bucket + slack),
            (f"gather, {ranks} rank(s): peak extra memory per rank <= 2 buckets + the largest tensor (+2 MiB)",
             f"{gather / 1e6:.1f} MB (bound {(2 * bucket + largest) / 1e6:.1f} MB)",
             gather <= 2 * bucket + largest + slack),
        ]  # fmt: skip
        if ranks > 1:  # one rank holds every tensor whole: there is nothing to gather
            out.append(
                (f"{ranks} ranks: both modes far below gathering everything (<= half)",
                 f"{max(direct, gather) / 1e6:.0f} MB vs {everything / 1e6:.0f} MB",
                 2 * max(direct, gather) <= everything)
            )  # fmt: skip
    t_direct, t_gather = seconds(d, "direct", 2), seconds(d, "gather", 2)
    out.append(
        ("direct not slower than gather at 2 ranks", f"{t_direct:.2f} s vs {t_gather:.2f} s", t_direct <= t_gather)
    )
    return out


def section(d: dict[str, Any]) -> str:
    """The markdown section: time, peak extra memory and bytes sent per rank, per way and rank count."""
    rows = d["rows"]
    model = rows[0]["model_bytes"]
    lines = [
        "## Sharded trainers: FSDP2 ranks sending into one engine",
        "",
        f"SmolLM2-135M in fp32 ({model / 1e6:.0f} MB), sharded with FSDP2 over gloo on this host, synced into one "
        f"reference engine (staged) in buckets of {d['bucket_bytes'] / 2**20:.0f} MiB, each way back to back in "
        f"every repetition (measured {d['date']}, `--cases sharded`), without bucket digests (the digests section "
        "times them). Time is rank 0's wall time of the call; "
        "peak extra memory is the rank's peak resident memory above what it held before the call (the client "
        "keeps no pack buffers between calls here, so each call pays for its two); bytes sent are from the plan. "
        "The memory targets allow 2 MiB for the call's own bookkeeping (plan, messages, exchanged piece lists). "
        "Median (min-max) over the repetitions:",
        "",
        "| ranks | way | seconds | peak extra memory per rank (MB) | bytes sent per rank (MB) |",
        "|---|---|---|---|---|",
    ]
    for ranks in (1, 2):
        for way in WAYS:
            got = _rows(d, way, ranks, 0)
            if not got:
                continue
            t = [r["seconds"] for r in got]
            mem = " / ".join(
                f"{_median([r['peak_extra_bytes'] for r in _rows(d, way, ranks, k)]) / 1e6:.0f}" for k in range(ranks)
            )
            sent = " / ".join(f"{_rows(d, way, ranks, k)[0]['sent_bytes'] / 1e6:.0f}" for k in range(ranks))
            lines.append(f"| {ranks} | {LABELS[way]} | {_median(t):.2f} ({min(t):.2f}-{max(t):.2f}) | {mem} | {sent} |")
    lines += [
        "",
        "Per rank: rank 0 / rank 1. In the gather mode every rank gathers each bucket (`full_tensor()`) and "
        "rank 0 sends it; in the direct mode each rank sends its own shards and the engine assembles them, "
        "so the bytes sent split between the ranks and nothing is gathered.",
    ]
    return "\n".join(lines)
