"""Each bucket's digest, declared to every engine as soon as the trainer hashed it (``Update`` with ``digests``).

A trainer that hashes its buckets as it sends them (:mod:`wsync_grpc.transports.broadcast.sender`)
prepares the update with ``digests_follow`` and declares each digest right after the bucket is on
the wire; every engine worker holds a bucket until its digest came, and checks it before staging
or applying it (``wsync.v1.BucketDigest``). :class:`DigestCourier` does the declaring: one
``Update`` in flight per engine at a time, carrying every digest hashed since its previous one,
so that the calls never queue up behind a slow engine and a fast wire costs about one call per
bucket per engine. The sender's thread only hands digests over; the calls run on the client's event
loop (:meth:`~wsync_grpc.trainer.fleet.Fleet.submit`, over the engines' ``grpc.aio`` channels, which
carry the lease credential like every owner call): no thread per engine.

Units: times in seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket
from wsync_grpc.trainer.fleet import Fleet, RemoteEngine
from wsync_grpc.trainer.results import EngineFailure
from wsync_grpc.wire.convert import digest_to_proto


class _Lane:
    """One engine's digests: those waiting for its next ``Update``, and whether a call is in flight."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.waiting: dict[int, Digest] = {}
        self.in_flight = False
        self.failure: EngineFailure | None = None


class DigestCourier:
    """Declares the digests of one update's buckets to every engine as they are hashed.

    Thread-safe.

    Args:
        fleet: the client's engines and event loop; the update goes to ``fleet.engines``.
        update_id: the update's id.
        timeout_s: each ``Update`` call's deadline, in seconds.
    """

    def __init__(self, fleet: Fleet, update_id: str, timeout_s: float) -> None:
        self._fleet = fleet
        self._update_id = update_id
        self._timeout_s = timeout_s
        self._lanes = [_Lane(e) for e in fleet.engines]
        self._cond = threading.Condition()
        self.calls = 0
        """``Update`` calls made so far (every engine's)."""

    def add(self, bucket: Bucket, digest: Digest) -> None:
        """Declare ``bucket``'s digest to every engine: now, or with the engine's next ``Update``."""
        with self._cond:
            for lane in self._lanes:
                if lane.failure is None:
                    lane.waiting[bucket.index] = digest
                    if not lane.in_flight:
                        lane.in_flight = True
                        self._start(lane)

    def _start(self, lane: _Lane) -> None:
        """Start ``lane``'s declaring on the event loop (lock held; ``lane.in_flight`` set)."""
        try:
            self._fleet.submit(lambda: self._declare(lane))
        except Exception as exc:  # the client is closed
            self._ended(lane, exc)

    async def _declare(self, lane: _Lane) -> None:
        """On the loop: send what ``lane`` has waiting, one ``Update`` at a time, until nothing waits."""
        fleet = self._fleet
        while True:
            with self._cond:
                if not lane.waiting or lane.failure is not None:
                    self._ended(lane, None)
                    return
                digests, lane.waiting = lane.waiting, {}
                self.calls += 1
            request = pb.UpdateRequest(
                update_id=self._update_id,
                owner=fleet.owner,
                digests=[pb.DeclaredDigest(bucket_index=i, digest=digest_to_proto(d)) for i, d in digests.items()],
            )
            try:
                await fleet.aio(lane.engine).Update(request, timeout=self._timeout_s, metadata=fleet.metadata)
            except Exception as exc:
                with self._cond:
                    self._ended(lane, exc)
                return

    def _ended(self, lane: _Lane, error: BaseException | None) -> None:
        """``lane`` has no call in flight any more (``error``: why its last one failed). Lock held."""
        lane.in_flight = False
        if error is not None:
            lane.failure = EngineFailure.from_exception(lane.engine.target, "Update", error)
            lane.waiting = {}
        self._cond.notify_all()

    def failures(self) -> Mapping[str, EngineFailure]:
        """target -> why declaring a digest to it failed, so far."""
        with self._cond:
            return {lane.engine.target: lane.failure for lane in self._lanes if lane.failure is not None}

    def finish(self, timeout_s: float) -> dict[str, EngineFailure]:
        """Wait until every engine took every digest (or failed), at most ``timeout_s`` seconds.

        Returns:
            target -> failure, for the engines that did not take them all (DEADLINE_EXCEEDED past
            ``timeout_s``).
        """
        deadline = time.monotonic() + timeout_s

        def settled() -> bool:
            return all(lane.failure is not None or not (lane.in_flight or lane.waiting) for lane in self._lanes)

        with self._cond:
            self._cond.wait_for(settled, max(0.0, deadline - time.monotonic()))
            for lane in self._lanes:
                if lane.failure is None and (lane.in_flight or lane.waiting):
                    lane.failure = EngineFailure(
                        lane.engine.target,
                        "Update",
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "DIGESTS_NOT_DECLARED",
                        f"the buckets' digests were not all declared within {timeout_s:g} s",
                    )
            return {lane.engine.target: lane.failure for lane in self._lanes if lane.failure is not None}
