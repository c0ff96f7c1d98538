"""The one place that turns wsync's domain errors into gRPC statuses, and statuses back into reasons.

Every servicer method is wrapped by :func:`grpc_errors`: an exception raised
anywhere below it becomes a :class:`~wsync_grpc.core.errors.WsyncError`
(:func:`~wsync_grpc.core.errors.domain_error`), then one canonical status code
(:data:`STATUS_CODES`) plus a ``google.rpc.ErrorInfo`` detail (domain
``wsync.v1``, reason in UPPER_SNAKE_CASE) sent through grpcio-status
(``docs/architecture.md``, "Errors"). Clients read the detail back with
:func:`error_info` / :func:`error_reason`.
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

from wsync_grpc.core.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
    WsyncError,
    clip,
    domain_error,
)

log = logging.getLogger(__name__)

DOMAIN = "wsync.v1"
"""ErrorInfo domain of every wsync error."""

STATUS_CODES: dict[type[WsyncError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Aborted: grpc.StatusCode.ABORTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    Internal: grpc.StatusCode.INTERNAL,
}
"""Error category -> canonical gRPC status code (``docs/architecture.md``, "Errors")."""


def status_code(err: WsyncError) -> grpc.StatusCode:
    """The gRPC status code of ``err``'s category (its nearest class in :data:`STATUS_CODES`); INTERNAL if none."""
    for cls in type(err).__mro__:
        code = STATUS_CODES.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


MAX_MESSAGE_BYTES = 1024
"""Longest status message sent, in UTF-8 bytes (longer ones are cut, marked with an ellipsis)."""

MAX_METADATA_VALUE_BYTES = 256
"""Longest ErrorInfo metadata value sent, in UTF-8 bytes."""


def to_status(err: WsyncError) -> grpc.Status:
    """Build the rich gRPC status (code, message, ErrorInfo detail) for ``err``.

    The message and metadata values are bounded (:data:`MAX_MESSAGE_BYTES`,
    :data:`MAX_METADATA_VALUE_BYTES`): they travel in the trailers, and a
    message quoting a caller's huge dtype string or shape would exceed the
    client's metadata limit and arrive as a bare RESOURCE_EXHAUSTED without
    its code and reason.
    """
    metadata = {k: clip(v, MAX_METADATA_VALUE_BYTES) for k, v in err.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    message = clip(err.message, MAX_MESSAGE_BYTES)
    status = status_pb2.Status(code=getattr(code_pb2, status_code(err).name), message=message, details=[detail])
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
            err = domain_error(exc)
            if isinstance(err, Internal) and err is not exc:
                log.exception("%s failed", method.__name__)
            else:
                log.info("%s -> %s %s: %s", method.__name__, status_code(err).name, err.reason, clip(err.message))
            context.abort_with_status(to_status(err))
            raise AssertionError("abort_with_status returned") from None  # pragma: no cover

    return cast(F, wrapper)


def error_info(exc: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """The ``ErrorInfo`` reason and metadata carried by a failed call; ``("", {})`` when none.

    The rich status is parsed with ``grpc_status.rpc_status.from_call`` (the
    ``grpc-status-details-bin`` trailer), as the engines send it; a status whose
    details disagree with the call's code or message counts as none. ``exc`` is a
    synchronous call's error (a ``grpc.Call``) or a ``grpc.aio.AioRpcError``: both
    carry ``code()``, ``details()`` and ``trailing_metadata()``, all that is read.
    """
    call = cast(grpc.Call, exc)  # duck-typed: an AioRpcError has the three methods read
    try:
        status = rpc_status.from_call(call)
    except ValueError:
        return "", {}
    if status is None:
        return "", {}
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason), dict(info.metadata)
    return "", {}


def error_reason(exc: grpc.RpcError) -> str:
    """Return the ``ErrorInfo.reason`` carried by a failed call, or ``""`` when none."""
    return error_info(exc)[0]
