"""The Ray section of ``BENCHMARKS.md`` (results of :func:`bench.ray_case.case_ray`): the fleet launched as Ray
actors against the same fleet launched directly. Times in seconds unless named ``_ms``; medians with the p95 and
the max beside them."""

from __future__ import annotations

import statistics
from typing import Any

from bench.colocated_case import p95


def _spread(xs: list[float], scale: float = 1.0, digits: int = 2) -> str:
    xs = [x * scale for x in xs]
    return f"{statistics.median(xs):.{digits}f} ({p95(xs):.{digits}f}, {max(xs):.{digits}f})"


def section(c: dict[str, Any]) -> str:
    """The markdown section: per way, the syncs' control plane and wall time, the trainer's threads, and the
    kill rounds' exclusion and catch-up times."""
    lines = [
        "## Engines as Ray actors against engines launched directly",
        "",
        f"A local Ray cluster of {c['nodes']} nodes on this host; {c['engines']} engines (`wsync serve --synthetic "
        "tiny`, a model of about 0.3 MB: a sync is mostly its control plane) launched by `wsync_grpc.ray."
        "launch_engines` over a SPREAD placement group (`max_restarts`), the trainer from `trainer_client`, and the "
        "same engines launched directly as processes (`spawn_engine`) with a plain `TrainerClient`; `FleetPolicy."
        f"exclude` for both. {c['syncs']} timed syncs per way after a warm-up, then {c['kills']} rounds of one engine "
        "killed (`ray.kill` of its actor; SIGKILL of its process), the next sync timed (it leaves the engine out, or, "
        "where the engine's restart was found by its status probe, takes it back at once) and the time from the kill "
        "until every engine serves the fleet's version again (`catch_up` called until then): Ray restarts the actor "
        "on a new port and the trainer's resolver finds it there; directly, the engine is started again by hand on "
        "its old port (its start included). Medians (p95, max) over the rounds; the engines left out of, and taken "
        "back into, the sync after a kill summed over them. The trainer's threads at rest include, on the Ray "
        "side, those of the Ray driver in the same process.",
        "",
        "| way | engines serving after launch s | sync wall ms | control plane ms per engine (Prepare + Complete) "
        "| trainer threads at rest | the sync after the kill s (engines left out; back in it) "
        "| killed to the fleet whole again s |",
        "|---|---|---|---|---|---|---|",
    ]
    for way in ("direct", "ray"):
        w = c.get(way) or {}
        if "error" in w or "syncs" not in w:
            lines.append(f"| {way} | did not run: {w.get('error', 'not measured')[:200]} | | | | | |")
            continue
        syncs, kills = w["syncs"], w["kills"]
        lines.append(
            f"| {way} | {w['launch_s']:.1f} | {_spread([s['wall_s'] for s in syncs], 1e3, 0)} "
            f"| {_spread([s['control_ms_per_engine'] for s in syncs], 1.0, 1)} | {w['threads_idle']} "
            f"| {_spread([k['sync_after_kill_s'] for k in kills])} ({sum(len(k['excluded']) for k in kills)}; "
            f"{sum(len(k['rejoined']) for k in kills)}) | {_spread([k['whole_again_s'] for k in kills])} |"
        )
    return "\n".join(lines)
