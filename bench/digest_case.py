"""The digest case of the benchmarks: what checking every bucket's digest costs a sync.

One engine process serving a synthetic model (:mod:`bench.engine`) and the trainer's copy. First
the hash alone: :func:`wsync_grpc.core.digests.digest_of` over the model's bytes as one flat
buffer on the trainer's host (XXH3-128, one thread), against the raw broadcast of the same bytes
(the wire's rate). Then, per apply mode, rounds run back to back on the same processes: the
ceiling (one raw broadcast), a sync with digests (the client's default on CPU: the trainer hashes each
bucket while it is on the wire and declares the digest with an ``Update``; the engine hashes what
arrived before it stages or applies it) and the same sync without (``TrainerClient.digests =
False``). The cost is the ratio of the two syncs, taken per round.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from wsync_grpc.core.digests import digest_of

if TYPE_CHECKING:
    from bench.run import Harness

MODES = ("streaming", "staged")


def case_digests(h: Harness, model_name: str, reps: int) -> dict[str, Any]:
    """One engine serving ``model_name``: the hash rate, then per apply mode ``reps`` rounds of ceiling, sync with
    digests and sync without."""
    from bench.run import _say, session

    _say(f"digests: {model_name}")
    with session(h, model_name) as s:
        assert s.model.flat is not None
        hash_s = []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.monotonic()
            digest_of([s.model.flat])
            hash_s.append(time.monotonic() - t0)
        hash_s = hash_s[1:]
        wire_s = [s.raw() for _ in range(reps + 1)][1:]
        _say(
            f"  hash {s.model.nbytes / statistics.median(hash_s) / 1e9:.2f} GB/s, "
            f"wire {s.model.nbytes / statistics.median(wire_s) / 1e9:.2f} GB/s"
        )
        runs: dict[str, list[dict[str, Any]]] = {}
        for mode in MODES:
            for digests in (True, True, False):  # warm-up: the receive buffers of this mode, both ways
                s.client.digests = digests
                s.wsync(mode)
            rounds = []
            for _ in range(reps):
                raw = s.raw()
                s.client.digests = True
                on = s.wsync(mode)
                s.client.digests = False
                off = s.wsync(mode)
                rounds.append({"raw": raw, "on": on, "off": off})
                _say(
                    f"  {mode}: ceiling {raw:.3f} s, with digests {on['seconds']:.3f} s, without {off['seconds']:.3f} s"
                )
            runs[mode] = rounds
        s.client.digests = False  # as the other cases' syncs run
        return {
            "model": model_name,
            "bytes": s.model.nbytes,
            "tensors": len(s.model.tensors),
            "hash_seconds": hash_s,
            "wire_seconds": wire_s,
            "runs": runs,
            "verified": s.verify(),
        }


def cost(d: dict[str, Any], mode: str) -> float:
    """Median over the rounds of (sync with digests / the same round's sync without), for ``mode``."""
    return statistics.median(r["on"]["seconds"] / r["off"]["seconds"] for r in d["runs"][mode])


def _rng(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def section(d: dict[str, Any]) -> str:
    """The markdown section: the hash rate against the wire's, and the syncs with and without digests."""
    gb = d["bytes"] / 1e9
    hash_rate = gb / statistics.median(d["hash_seconds"])
    wire_rate = gb / statistics.median(d["wire_seconds"])
    lines = [
        "## Digests: what checking every bucket costs",
        "",
        f"One engine serving the synthetic `{d['model']}` model ({gb:.2f} GB, {d['tensors']} tensors). "
        f"XXH3-128 over the model's bytes on one thread of the trainer: {hash_rate:.2f} GB/s; the raw broadcast "
        f"of the same bytes: {wire_rate:.2f} GB/s. Each round runs back to back: the raw broadcast (ceiling), a "
        "sync with digests (the default for CPU buckets: the trainer hashes each bucket while it is on the wire, "
        "every engine worker hashes what arrived before staging or applying it) and one without (`digests=False`, "
        "as the other sections run). Seconds, "
        "median (min-max):",
        "",
        "| apply | ceiling | with digests | without | with / without (median per round) |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        rounds = d["runs"][mode]
        lines.append(
            f"| {mode} | {_rng([r['raw'] for r in rounds])} | {_rng([r['on']['seconds'] for r in rounds])} | "
            f"{_rng([r['off']['seconds'] for r in rounds])} | {cost(d, mode):.2f} x |"
        )
    lines += [
        "",
        "With digests a streaming engine never receives a bucket straight into the served tensor (it must "
        "check the bytes before any of them is served), so the cost includes that copy as well as the hashing.",
    ]
    return "\n".join(lines)
