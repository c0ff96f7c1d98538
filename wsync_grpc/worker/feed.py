"""The buckets of one update (and the digests declared after them), appended by the engine's control plane and read
by every worker's receiver."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.errors import DeadlineExceeded, GroupTimeout, InvalidArgument
from wsync_grpc.core.layout import Bucket


class BucketFeed:
    """The buckets of one update, appended by Prepare/Update and read by every worker.

    Thread-safe. :meth:`close` says no more buckets will come (Complete, or a
    failure; at once for an update that is not incremental). Digests of
    buckets already declared may follow (``wsync.v1.PrepareHeader.digests_follow``)
    until :meth:`close_digests` (Complete, or a failure).
    """

    def __init__(self) -> None:
        self._buckets: list[Bucket] = []
        self._closed = False
        self._digests: dict[int, Digest] = {}
        self._digests_closed = False
        self._max_size = 0
        self._cond = threading.Condition()

    def extend(self, buckets: list[Bucket]) -> None:
        """Append validated buckets."""
        with self._cond:
            self._buckets.extend(buckets)
            self._max_size = max([self._max_size, *(b.size_bytes for b in buckets)])
            self._cond.notify_all()

    @property
    def max_size_bytes(self) -> int:
        """The largest ``size_bytes`` of the buckets declared so far, in bytes."""
        return self._max_size

    def close(self) -> None:
        """No more buckets will be appended. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def add_digests(self, digests: Mapping[int, Digest]) -> None:
        """Record digests declared after their buckets (bucket index -> digest; validated by the caller)."""
        with self._cond:
            self._digests.update(digests)
            self._cond.notify_all()

    def close_digests(self) -> None:
        """No more digests will be declared (nor buckets: :meth:`close` too). Idempotent."""
        with self._cond:
            self._closed = self._digests_closed = True
            self._cond.notify_all()

    def declared_digest(self, i: int) -> Digest | None:
        """The digest declared after bucket ``i``, if one was (its spec's own is :attr:`Bucket.digest`)."""
        with self._cond:
            return self._digests.get(i)

    def digest(self, i: int, timeout: float) -> Digest | None:
        """The digest declared after bucket ``i``, waiting at most ``timeout`` seconds for it to come.

        Returns:
            The digest; ``None`` when the declarations ended (:meth:`close_digests`) without it.

        Raises:
            GroupTimeout: it was not declared within ``timeout``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: i in self._digests or self._digests_closed, timeout):
                raise GroupTimeout(f"no digest of bucket {i} was declared within {timeout:g} s")
            return self._digests.get(i)

    def __len__(self) -> int:
        with self._cond:
            return len(self._buckets)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def get(self, i: int, timeout: float | None) -> Bucket | None:
        """Return bucket ``i``; ``None`` when the feed is closed before it.

        ``timeout`` (seconds) bounds the wait for bucket ``i`` to be declared;
        ``0`` does not wait.

        Raises:
            LookupError: ``timeout`` was 0 and bucket ``i`` is not declared yet.
            GroupTimeout: bucket ``i`` was not declared within ``timeout``.
        """
        with self._cond:
            if timeout == 0:
                if i < len(self._buckets):
                    return self._buckets[i]
                if self._closed:
                    return None
                raise LookupError(i)
            ok = self._cond.wait_for(lambda: i < len(self._buckets) or self._closed, timeout)
            if not ok:
                raise GroupTimeout(f"no bucket {i} was declared within {timeout:g} s (Update or Complete)")
            return self._buckets[i] if i < len(self._buckets) else None


def digest_timeout(bucket: int, timeout_s: float) -> DeadlineExceeded:
    """The error of bucket ``bucket`` received with no digest declared within ``timeout_s`` seconds (reason
    DIGEST_TIMEOUT), the header having promised one (``PrepareHeader.digests_follow``)."""
    return DeadlineExceeded(
        "DIGEST_TIMEOUT",
        f"bucket {bucket} arrived, but its digest was not declared within {timeout_s:g} s "
        "(PrepareHeader.digests_follow promised it in an Update)",
        bucket=str(bucket),
    )


def digest_missing(bucket: int) -> InvalidArgument:
    """The error of bucket ``bucket`` left without a digest when the declarations ended (Complete came; reason
    DIGEST_MISSING), the header having promised one (``PrepareHeader.digests_follow``)."""
    return InvalidArgument(
        "DIGEST_MISSING",
        f"bucket {bucket} has no digest: the update promised one for every bucket "
        "(PrepareHeader.digests_follow), but Complete came before it",
        bucket=str(bucket),
    )
