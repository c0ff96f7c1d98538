"""The disk section of ``BENCHMARKS.md`` and its target (results of :func:`bench.disk_case.case_disk`)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.disk_case import WAYS, disk_ratio

DISK_RATIO = 1.5
"""Target: a staged disk update of a checkpoint in the page cache at most this many times the staged broadcast."""

LABELS = {
    "broadcast": "broadcast, staged (`sync`)",
    "disk": "disk, staged (`sync_from_disk`)",
    "save_and_sync": "save, then disk (`save_and_sync`)",
}


def _rng(values: list[float], fmt: str = "{:.3f}") -> str:
    return (fmt + " (" + fmt + "-" + fmt + ")").format(statistics.median(values), min(values), max(values))


def checks(d: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)``: the disk update against the broadcast, and the served bytes."""
    ratio = disk_ratio(d)
    return [
        (f"disk update (page cache warm) <= {DISK_RATIO:g} x the broadcast", f"{ratio:.2f} x", ratio <= DISK_RATIO),
        ("disk updates serve the trainer's bytes", "yes" if d["verified"] else "no", bool(d["verified"])),
    ]


def section(d: dict[str, Any]) -> str:
    """The markdown section: what ran, one table of seconds per way and their split."""
    rounds = d["rounds"]
    lines = [
        "## Disk: a checkpoint read by the engine",
        "",
        f"One engine serving the synthetic `{d['model']}` model ({d['bytes'] / 1e9:.2f} GB, {d['tensors']} tensors); "
        "the trainer's copy saved once as `model.safetensors` inside the engine's checkpoint root "
        f"({d['first_save_s']:.2f} s). Each of {len(rounds)} rounds runs back to back: the raw broadcast "
        "(ceiling), a staged broadcast sync, a staged disk update of that file (in the page cache after the "
        "warm-up) and `save_and_sync` (the file written again, then read)"
        + (f", measured {d['date']} (`--cases disk`)" if d.get("date") else "")
        + ". Seconds, median (min-max):",
        "",
        "| way | total | Prepare | Complete | apply |",
        "|---|---|---|---|---|",
        f"| ceiling (raw broadcast) | {_rng([r['raw'] for r in rounds])} | | | |",
    ]
    for way in WAYS:
        cells = [_rng([r[way][k] for r in rounds]) for k in ("seconds", "prepare", "complete", "apply")]
        lines.append(f"| {LABELS[way]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Disk update / broadcast, per round: median {disk_ratio(d):.2f} x. A disk update's Prepare lists the "
        "file and validates its safetensors header; its Complete waits for the read (copies into fresh "
        "buffers: no pool yet) and applies. A cold page cache or a network file system adds its read time.",
    ]
    return "\n".join(lines)
