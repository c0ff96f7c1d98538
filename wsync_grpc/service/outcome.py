"""What an update reports when it is armed (Prepare) and verified or applied (Complete).

The session (:class:`~wsync_grpc.service.session.UpdateSession`) fills these in;
the servicer turns them into ``wsync.v1.PrepareResponse`` and ``CompleteResponse``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wsync_grpc.worker.receiver import Receiver


@dataclass(frozen=True)
class PrepareResult:
    """An armed update (the fields of ``wsync.v1.PrepareResponse``; sizes in bytes, times in seconds).

    ``lease_credential``: the caller's lease credential (its reply alone carries it).
    """

    update_id: str
    bucket_count: int
    tensor_count: int
    total_bytes: int
    ready_seconds: float
    lease_credential: str = ""


@dataclass(frozen=True)
class CompleteResult:
    """An applied (or only verified) update (the fields of ``wsync.v1.CompleteResponse``).

    Sizes in bytes, times in seconds. The counts are worker 0's; every worker
    receives the same buckets. ``verified_only``: the first phase of a
    two-phase Complete, nothing applied (``weight_version`` is still the served one).
    ``buckets_verified``: the buckets whose digest matched on every worker (the fewest of any worker).
    ``weight_identity``: the identity the apply issued to the base weights now served (``""``: verified only, or
    an adapter).
    """

    update_id: str
    weight_version: str
    bucket_count: int
    tensor_count: int
    bytes_received: int
    receive_seconds: float
    apply_seconds: float
    total_seconds: float
    cache_flushed: bool
    verified_only: bool = False
    prepare_seconds: float = 0.0
    verify_seconds: float = 0.0
    buckets_verified: int = 0
    weight_identity: str = ""


def last_arrival(receivers: Sequence[Receiver], default: float) -> float:
    """When the last bucket arrived on the slowest of ``receivers`` (monotonic seconds); ``default`` before any did."""
    return max((r.last_arrival_at or default) for r in receivers) if receivers else default
