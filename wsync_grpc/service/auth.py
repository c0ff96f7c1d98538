"""The bearer token every call must carry when the engine's operator set one, and where the server is exposed.

``authorization: Bearer <token>`` metadata (the scheme is case-insensitive, RFC 6750 section 2.1 after
RFC 7235; the token is compared in constant time). Health checking stays open, for load balancers
and probes; server reflection stays open on a loopback address only: on an exposed port it would
tell anyone who reaches it the whole API (``docs/architecture.md``, "Invariants").
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

from wsync_grpc.service.call_limits import HEALTH_PREFIX, REFLECTION_PREFIX
from wsync_grpc.service.interceptors import Handler, Interceptor
from wsync_grpc.wire.targets import is_loopback

__all__ = ["TokenAuth", "is_loopback"]


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>'")


_DENY_UNARY: Handler = grpc.stream_unary_rpc_method_handler(_deny)
"""The refusal of a call with a unary response; it reads no request (a request stream is never waited on)."""
_DENY_STREAM: Handler = grpc.stream_stream_rpc_method_handler(_deny)
"""The refusal of a call with a streamed response; it reads no request either."""


class TokenAuth(Interceptor):
    """Refuse calls without ``authorization: Bearer <token>`` (UNAUTHENTICATED); health and, unless exposed,
    reflection stay open.

    The refusal reads no request message, so that a caller without the token holds no thread waiting for one.

    Args:
        token: the expected token.
        exposed: the server binds a non-loopback address: reflection needs the token too.
    """

    def __init__(self, token: str, *, exposed: bool) -> None:
        self._expected = token.encode()
        self._open = (HEALTH_PREFIX,) if exposed else (HEALTH_PREFIX, REFLECTION_PREFIX)

    def _authorized(self, value: str | bytes) -> bool:
        raw = value.encode() if isinstance(value, str) else value
        scheme, _, token = raw.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method: str = details.method  # type: ignore[attr-defined]
        if method.startswith(self._open):
            return continuation(details)
        for key, value in details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == "authorization" and self._authorized(value):
                return continuation(details)
        handler = continuation(details)
        return _DENY_STREAM if handler is not None and handler.response_streaming else _DENY_UNARY
