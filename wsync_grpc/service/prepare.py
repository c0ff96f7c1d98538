"""Reading one Prepare call's client stream: a header, then bucket specs, each validated as it arrives.

Reading the stream blocks until the client's next message, so a watchdog
thread cancels the RPC (which ends the read) when the stream stalls longer
than the stall timeout or when Cancel sets the reader's cancel event; a
stuck trainer cannot hold the engine in PREPARING. The validation itself is
:class:`~wsync_grpc.core.validation.UpdateValidator`'s, and the reader hands
that validator on to the update, which keeps it for every later Update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.errors import Aborted, DeadlineExceeded, InvalidArgument, WsyncError
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.wire.convert import header_from_proto

log = logging.getLogger(__name__)

WATCHDOG_POLL_S = 0.05
"""How often the watchdog checks for a stall or a cancel, in seconds."""


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
        cancel: set (by Cancel) to abandon the Prepare: the read ends with
            ABORTED/UPDATE_CANCELLED.
        update_id: the update's id once its header was read; ``None`` before.
    """

    def __init__(self, stall_timeout_s: float, on_owner: Callable[[str], None] | None = None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._on_owner = on_owner
        self.cancel = threading.Event()
        self.update_id: str | None = None
        self.validator: UpdateValidator | None = None
        self._buckets: list[Bucket] = []
        self._last_message = time.monotonic()
        self._read_done = threading.Event()
        self._stalled = threading.Event()

    def read(
        self, validator: UpdateValidator, stream: Iterator[pb.PrepareRequest], context: grpc.ServicerContext
    ) -> tuple[UpdateHeader, list[Bucket]]:
        """Read ``stream`` to its end, validating with ``validator``; return the header and buckets.

        ``validator`` is a fresh one for the engine's model; afterwards it
        holds what the stream declared, and the update keeps it.

        Raises:
            InvalidArgument: a message the contract does not allow (MISSING_HEADER,
                EMPTY_MESSAGE, UNKNOWN_ENUM_VALUE...) or metadata that does not fit
                the model (see :class:`~wsync_grpc.core.validation.UpdateValidator`).
            Unimplemented: a transport not built yet.
            Aborted: UPDATE_CANCELLED (Cancel was called) or STREAM_BROKEN (the client went away).
            DeadlineExceeded: PREPARE_STALLED, the stream sent nothing for ``stall_timeout_s``.
        """
        self.validator = validator
        self._last_message = time.monotonic()
        threading.Thread(target=self._watch, args=(context,), name="wsync-prepare-watchdog", daemon=True).start()
        try:
            for msg in stream:
                self._last_message = time.monotonic()
                self._message(msg)
        except grpc.RpcError as e:  # the client went away mid-stream, or the watchdog cancelled the call
            raise self._broken(e) from None
        finally:
            self._read_done.set()
        validator.finish_stream()
        assert validator.header is not None
        return validator.header, self._buckets

    def _watch(self, context: grpc.ServicerContext) -> None:
        """Cancel the RPC once the stream stalls or the update is cancelled; end with the read."""
        while not self._read_done.wait(WATCHDOG_POLL_S):
            if time.monotonic() - self._last_message > self.stall_timeout_s:
                self._stalled.set()
            if self._stalled.is_set() or self.cancel.is_set():
                context.cancel()  # type: ignore[no-untyped-call]
                return

    def _message(self, msg: pb.PrepareRequest) -> None:
        v = self.validator
        assert v is not None
        if self.cancel.is_set():
            raise cancelled_while_preparing()
        kind = msg.WhichOneof("kind")
        if kind == "header":
            if self._on_owner is not None and v.header is None:
                self._on_owner(msg.header.owner)
            self.update_id = v.header_message(header_from_proto(msg.header)).update_id
        elif kind in ("bucket", "buckets"):
            if v.header is None:
                raise InvalidArgument("MISSING_HEADER", "a bucket arrived before the header")
            specs = [msg.bucket] if kind == "bucket" else msg.buckets.buckets
            if not specs:
                raise InvalidArgument("EMPTY_MESSAGE", "a PrepareRequest carried an empty bucket batch")
            v.check_more_buckets(len(self._buckets) + len(specs))
            self._buckets.extend(v.bucket_messages(specs))
        else:
            raise InvalidArgument("EMPTY_MESSAGE", "a PrepareRequest carried neither header nor bucket")

    def _broken(self, e: grpc.RpcError) -> WsyncError:
        """Why the stream ended early: cancelled, stalled, or broken by the client."""
        if self.cancel.is_set():
            return cancelled_while_preparing()
        if self._stalled.is_set():
            log.warning("Prepare stream sent nothing for %g s: cancelled", self.stall_timeout_s)
            return DeadlineExceeded(
                "PREPARE_STALLED", f"the Prepare stream sent nothing for {self.stall_timeout_s:g} s"
            )
        return Aborted("STREAM_BROKEN", f"the Prepare stream broke before it ended: {e}")
