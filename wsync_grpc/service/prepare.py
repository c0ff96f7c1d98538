"""Reading one Prepare stream: a header, then bucket specs, each validated as it arrives.

Reading the stream blocks until the caller's next message, so a watchdog
thread stops the stream (which ends the read) when it stalls longer than the
stall timeout or when Cancel sets the reader's cancel event; a stuck trainer
cannot hold the engine in PREPARING. The validation itself is
:class:`~wsync_grpc.core.validation.UpdateValidator`'s, and the reader hands
that validator on to the update, which keeps it for every later Update.

Protocol-agnostic: the stream is one of :data:`PrepareMessage` values (the
servicer converts ``wsync.v1.PrepareRequest`` messages into them at the edge),
and stopping it is a callable the edge supplies (gRPC: cancel the call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.errors import Aborted, DeadlineExceeded, InvalidArgument, WsyncError
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Bucket, with_digests
from wsync_grpc.core.validation import BucketSpecFields, UpdateValidator

log = logging.getLogger(__name__)

WATCHDOG_POLL_S = 0.05
"""How often the watchdog checks for a stall or a cancel, in seconds."""


@dataclass(frozen=True)
class HeaderMessage:
    """A Prepare stream's header.

    Attributes:
        owner: who sends the update (``PrepareHeader.owner``), checked before anything else.
        header: the header in domain terms, converted when called (after the owner check).
    """

    owner: str
    header: Callable[[], UpdateHeader]


@dataclass(frozen=True)
class BucketsMessage:
    """Bucket specs of a Prepare stream (one ``bucket``, or a ``buckets`` batch; empty: an empty batch).

    Attributes:
        specs: the specs, read by the validator as they are.
        digests: each spec's digest, converted at the edge (``None``: none); empty when no spec has one.
    """

    specs: Sequence[BucketSpecFields]
    digests: Sequence[Digest | None] = ()


PrepareMessage = HeaderMessage | BucketsMessage
"""One message of a Prepare stream, as the engine side reads it."""


class StreamBroken(Exception):
    """The caller's stream ended before its end (the caller went away, or the stream was stopped)."""


def cancelled_while_preparing() -> Aborted:
    """The error of an update cancelled before it was armed (ABORTED, UPDATE_CANCELLED)."""
    return Aborted("UPDATE_CANCELLED", "the update was cancelled while it was being prepared")


class PrepareReader:
    """Reads and validates one Prepare stream.

    Args:
        stall_timeout_s: longest silence between two messages, in seconds.
        on_owner: called with the header's ``owner`` as soon as the header arrives,
            before it is validated; raises to refuse the caller (NOT_OWNER).

    Attributes:
        on_owner: see above (may be set after construction, before :meth:`read`).
        on_header: called with the validated header before any bucket is read; raises to refuse the update
            (e.g. a delta for another base); ``None``: nothing to check.
        cancel: set (by Cancel) to abandon the Prepare: the read ends with
            ABORTED/UPDATE_CANCELLED.
        update_id: the update's id once its header was read; ``None`` before.
    """

    def __init__(self, stall_timeout_s: float, on_owner: Callable[[str], None] | None = None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.on_owner = on_owner
        self.on_header: Callable[[UpdateHeader], None] | None = None
        self.cancel = threading.Event()
        self.update_id: str | None = None
        self.validator: UpdateValidator | None = None
        self._buckets: list[Bucket] = []
        self._last_message = time.monotonic()
        self._read_done = threading.Event()
        self._stalled = threading.Event()

    def read(
        self, validator: UpdateValidator, stream: Iterator[PrepareMessage], stop_stream: Callable[[], None]
    ) -> tuple[UpdateHeader, list[Bucket]]:
        """Read ``stream`` to its end, validating with ``validator``; return the header and buckets.

        ``validator`` is a fresh one for the engine's model; afterwards it
        holds what the stream declared, and the update keeps it.

        Args:
            stop_stream: ends the stream (its iteration then raises :class:`StreamBroken`); called by the
                watchdog on a stall or a cancel.

        Raises:
            InvalidArgument: a message the contract does not allow (MISSING_HEADER,
                EMPTY_MESSAGE, UNKNOWN_ENUM_VALUE...) or metadata that does not fit
                the model (see :class:`~wsync_grpc.core.validation.UpdateValidator`).
            Unimplemented: a transport not built yet.
            Aborted: UPDATE_CANCELLED (Cancel was called) or STREAM_BROKEN (the caller went away).
            DeadlineExceeded: PREPARE_STALLED, the stream sent nothing for ``stall_timeout_s``.
        """
        self.validator = validator
        self._last_message = time.monotonic()
        threading.Thread(target=self._watch, args=(stop_stream,), name="wsync-prepare-watchdog", daemon=True).start()
        try:
            for msg in stream:
                self._last_message = time.monotonic()
                self._message(msg)
        except StreamBroken as e:  # the caller went away mid-stream, or the watchdog stopped it
            raise self._broken(e) from None
        finally:
            self._read_done.set()
        validator.finish_stream()
        assert validator.header is not None
        return validator.header, self._buckets

    def _watch(self, stop_stream: Callable[[], None]) -> None:
        """Stop the stream once it stalls or the update is cancelled; end with the read."""
        while not self._read_done.wait(WATCHDOG_POLL_S):
            if time.monotonic() - self._last_message > self.stall_timeout_s:
                self._stalled.set()
            if self._stalled.is_set() or self.cancel.is_set():
                stop_stream()
                return

    def _message(self, msg: PrepareMessage) -> None:
        v = self.validator
        assert v is not None
        if self.cancel.is_set():
            raise cancelled_while_preparing()
        if isinstance(msg, HeaderMessage):
            if self.on_owner is not None and v.header is None:
                self.on_owner(msg.owner)
            header = v.header_message(msg.header())
            self.update_id = header.update_id
            if self.on_header is not None:
                self.on_header(header)
            return
        if v.header is None:
            raise InvalidArgument("MISSING_HEADER", "a bucket arrived before the header")
        if not msg.specs:
            raise InvalidArgument("EMPTY_MESSAGE", "a PrepareRequest carried an empty bucket batch")
        v.check_more_buckets(len(self._buckets) + len(msg.specs))
        self._buckets.extend(with_digests(v.bucket_messages(msg.specs), msg.digests))

    def _broken(self, e: StreamBroken) -> WsyncError:
        """Why the stream ended early: cancelled, stalled, or broken by the caller."""
        if self.cancel.is_set():
            return cancelled_while_preparing()
        if self._stalled.is_set():
            log.warning("Prepare stream sent nothing for %g s: cancelled", self.stall_timeout_s)
            return DeadlineExceeded(
                "PREPARE_STALLED", f"the Prepare stream sent nothing for {self.stall_timeout_s:g} s"
            )
        return Aborted("STREAM_BROKEN", f"the Prepare stream broke before it ended: {e}")
