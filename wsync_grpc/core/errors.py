"""Domain errors of wsync, with no transport attached.

Every error a caller can act on is a :class:`WsyncError`: a category (the
subclass, after the canonical error model of ``google.rpc.Code``), a
machine-readable ``reason`` in UPPER_SNAKE_CASE and a message a person can
act on. The wire edge (:mod:`wsync_grpc.wire.status`) is the one place that
turns a category into a gRPC status code (``docs/architecture.md``, "Errors").

Below the categories sit the process group's own failures
(:class:`GroupError`, :class:`GroupTimeout`) and the typed cancellation of a
wait (:class:`Cancelled`); :func:`domain_error` is the one mapping from any
exception to a :class:`WsyncError`, by the phase it happened in.
"""

from __future__ import annotations

import enum


class WsyncError(Exception):
    """An error with a category (the subclass) and a machine-readable reason.

    Attributes:
        reason: UPPER_SNAKE_CASE reason (``google.rpc.ErrorInfo.reason`` on the wire).
        message: what went wrong, for a person.
        metadata: extra string key/values (e.g. the tensor and bucket named).
    """

    def __init__(self, reason: str, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata = metadata


class InvalidArgument(WsyncError):
    """Bad metadata or parameters (INVALID_ARGUMENT)."""


class FailedPrecondition(WsyncError):
    """Wrong lifecycle order or engine condition (FAILED_PRECONDITION)."""


class Aborted(WsyncError):
    """A concurrent update, or an update cancelled while preparing (ABORTED)."""


class AlreadyExists(WsyncError):
    """The group is already joined with other parameters (ALREADY_EXISTS)."""


class DeadlineExceeded(WsyncError):
    """A join, receive, drain or apply ran past its deadline (DEADLINE_EXCEEDED)."""


class Unavailable(WsyncError):
    """The group broke: a peer died or closed its connection (UNAVAILABLE)."""


class Unimplemented(WsyncError):
    """A transport or feature this engine does not implement (UNIMPLEMENTED)."""


class PermissionDenied(WsyncError):
    """A path outside what the engine's operator allows (PERMISSION_DENIED), e.g. a checkpoint outside every root."""


class DataLoss(WsyncError):
    """Bytes that arrived corrupted: a bucket whose digest does not match (DATA_LOSS)."""


class NotFound(WsyncError):
    """A named file, checkpoint or adapter that does not exist (NOT_FOUND)."""


class ResourceExhausted(WsyncError):
    """Too many calls of one kind at once: the engine refuses the excess rather than queue it (RESOURCE_EXHAUSTED)."""


class Internal(WsyncError):
    """Anything else (INTERNAL); logged by the engine."""


class GroupError(RuntimeError):
    """A collective failed: a peer died, closed its connection, or the group broke."""


class GroupTimeout(TimeoutError):
    """A join or a collective did not finish by its deadline."""


class Cancelled(Exception):
    """A wait ended because the update it served was cancelled (its cancel event was set)."""


MAX_LOGGED_BYTES = 256
"""Longest caller-supplied string (weight version, update id, error message) put in a log line, in UTF-8 bytes."""


def clip(text: str, limit: int = MAX_LOGGED_BYTES) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (never inside a character), marked with an ellipsis.

    For strings a caller chose: they go into log lines and status trailers, which must stay bounded
    whatever a caller sends.
    """
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."


class Phase(enum.Enum):
    """What was going on when an exception was raised; it picks the reason :func:`domain_error` reports."""

    OTHER = "other"
    JOIN = "join"
    """Joining the weight-sync group (Init)."""
    RECEIVE = "receive"
    """Receiving an update's buckets (a worker's receiver)."""


def domain_error(exc: BaseException, phase: Phase = Phase.OTHER, *, timeout_s: float = 0.0) -> WsyncError:
    """Map any exception to a :class:`WsyncError` (the whole service's one mapping).

    A :class:`WsyncError` is returned as it is. Otherwise, by phase:

    - JOIN: GroupTimeout -> DEADLINE_EXCEEDED/JOIN_TIMEOUT, GroupError ->
      UNAVAILABLE/JOIN_FAILED, ValueError (inconsistent ranks, backend or
      device) -> INVALID_ARGUMENT/INVALID_GROUP;
    - RECEIVE: GroupTimeout -> DEADLINE_EXCEEDED/RECEIVE_TIMEOUT (the message
      names ``timeout_s``, the group timeout in seconds), Cancelled ->
      ABORTED/UPDATE_CANCELLED, GroupError -> UNAVAILABLE/PEER_LOST;
    - any phase: Cancelled -> ABORTED/UPDATE_CANCELLED, GroupTimeout and
      TimeoutError -> DEADLINE_EXCEEDED/TIMEOUT, GroupError ->
      UNAVAILABLE/GROUP_BROKEN, anything else -> INTERNAL/INTERNAL.
    """
    if isinstance(exc, WsyncError):
        return exc
    if phase is Phase.JOIN:
        if isinstance(exc, GroupTimeout):
            return DeadlineExceeded("JOIN_TIMEOUT", str(exc))
        if isinstance(exc, GroupError):
            return Unavailable("JOIN_FAILED", str(exc))
        if isinstance(exc, ValueError):
            return InvalidArgument("INVALID_GROUP", str(exc))
    if phase is Phase.RECEIVE:
        if isinstance(exc, GroupTimeout):
            return DeadlineExceeded(
                "RECEIVE_TIMEOUT", f"no bucket arrived within the group timeout of {timeout_s:g} s: {exc}"
            )
        if isinstance(exc, GroupError):
            return Unavailable(
                "PEER_LOST", f"the weight-sync group broke while receiving (did the trainer die?): {exc}"
            )
    if isinstance(exc, Cancelled):
        return Aborted("UPDATE_CANCELLED", "the update was cancelled")
    if isinstance(exc, GroupTimeout | TimeoutError):
        return DeadlineExceeded("TIMEOUT", str(exc) or "timed out")
    if isinstance(exc, GroupError):
        return Unavailable("GROUP_BROKEN", str(exc))
    return Internal("INTERNAL", f"{type(exc).__name__}: {exc}")
