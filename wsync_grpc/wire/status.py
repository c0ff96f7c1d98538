"""Errors of the wsync service and the one place that maps them to gRPC statuses.

Every servicer method is wrapped by :func:`grpc_errors`: an exception raised
anywhere below it becomes one canonical status code plus a
``google.rpc.ErrorInfo`` detail (domain ``wsync.v1``, reason in
UPPER_SNAKE_CASE) sent through grpcio-status, as ``../shared/DESIGN.md``
section 3 specifies. Clients read the reason back with :func:`error_reason`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from wsync_grpc.core.lifecycle import UpdateInProgress, WrongState
from wsync_grpc.group.process_group import GroupError, GroupTimeout

log = logging.getLogger(__name__)

DOMAIN = "wsync.v1"
"""ErrorInfo domain of every wsync error."""


class WsyncError(Exception):
    """An error with a gRPC status code and a machine-readable reason.

    Attributes:
        code: the canonical gRPC status code.
        reason: UPPER_SNAKE_CASE reason (``google.rpc.ErrorInfo.reason``).
        metadata: extra string key/values for ErrorInfo (e.g. the tensor name).
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, reason: str, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata = metadata


class InvalidArgument(WsyncError):
    """Bad metadata or parameters (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(WsyncError):
    """Wrong lifecycle order or engine condition (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(WsyncError):
    """A concurrent update, or an update cancelled while preparing (ABORTED)."""

    code = grpc.StatusCode.ABORTED


class AlreadyExists(WsyncError):
    """The group is already joined with other parameters (ALREADY_EXISTS)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(WsyncError):
    """A join, receive, drain or apply ran past its deadline (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(WsyncError):
    """The group broke: a peer died or closed its connection (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(WsyncError):
    """A transport or feature this engine does not implement (UNIMPLEMENTED)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(WsyncError):
    """Anything else (INTERNAL); logged by the engine."""

    code = grpc.StatusCode.INTERNAL


def as_wsync_error(exc: BaseException) -> WsyncError:
    """Map any exception to a :class:`WsyncError` (the whole service's one mapping).

    WrongState -> FAILED_PRECONDITION/WRONG_STATE; UpdateInProgress ->
    ABORTED/UPDATE_IN_PROGRESS; GroupTimeout and TimeoutError ->
    DEADLINE_EXCEEDED; GroupError -> UNAVAILABLE/GROUP_BROKEN; anything else ->
    INTERNAL.
    """
    if isinstance(exc, WsyncError):
        return exc
    if isinstance(exc, WrongState):
        return FailedPrecondition("WRONG_STATE", str(exc), state=exc.state.name, rpc=exc.rpc.value)
    if isinstance(exc, UpdateInProgress):
        return Aborted("UPDATE_IN_PROGRESS", str(exc), state=exc.state.name)
    if isinstance(exc, GroupTimeout | TimeoutError):
        return DeadlineExceeded("TIMEOUT", str(exc) or "timed out")
    if isinstance(exc, GroupError):
        return Unavailable("GROUP_BROKEN", str(exc))
    return Internal("INTERNAL", f"{type(exc).__name__}: {exc}")


MAX_MESSAGE_BYTES = 1024
"""Longest status message sent, in UTF-8 bytes (longer ones are cut, marked with an ellipsis)."""

MAX_METADATA_VALUE_BYTES = 256
"""Longest ErrorInfo metadata value sent, in UTF-8 bytes."""


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (never inside a character)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."


def to_status(err: WsyncError) -> grpc.Status:
    """Build the rich gRPC status (code, message, ErrorInfo detail) for ``err``.

    The message and metadata values are bounded (:data:`MAX_MESSAGE_BYTES`,
    :data:`MAX_METADATA_VALUE_BYTES`): they travel in the trailers, and a
    message quoting a caller's huge dtype string or shape would exceed the
    client's metadata limit and arrive as a bare RESOURCE_EXHAUSTED without
    its code and reason.
    """
    metadata = {k: _clip(v, MAX_METADATA_VALUE_BYTES) for k, v in err.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    message = _clip(err.message, MAX_MESSAGE_BYTES)
    status = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=message, details=[detail])
    return rpc_status.to_status(status)


F = TypeVar("F", bound=Callable[..., Any])


def grpc_errors(method: F) -> F:
    """Decorate a servicer method ``(self, request, context)`` so that exceptions become statuses.

    INTERNAL errors are logged with their traceback; the others at INFO level.
    """

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            err = as_wsync_error(exc)
            if isinstance(err, Internal) and err is not exc:
                log.exception("%s failed", method.__name__)
            else:
                log.info("%s -> %s %s: %s", method.__name__, err.code.name, err.reason, err.message)
            context.abort_with_status(to_status(err))
            raise AssertionError("abort_with_status returned") from None  # pragma: no cover

    return cast(F, wrapper)


def error_reason(exc: grpc.RpcError) -> str:
    """Return the ``ErrorInfo.reason`` carried by a failed call, or ``""`` when none."""
    call = cast(grpc.Call, exc)
    try:
        status = rpc_status.from_call(call)
    except ValueError:
        return ""
    if status is None:
        return ""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""
