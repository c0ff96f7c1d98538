"""Who may call what: bearer tokens, each naming a principal with a role, where the engine's operator set any.

``authorization: Bearer <token>`` metadata (the scheme is case-insensitive, RFC 6750 section 2.1 after
RFC 7235; tokens are compared in constant time). A token authenticates a **principal** (a name) with a
**role** (:class:`Role`): ``reader`` (GetStatus, an observer's Watch, GetWeightChecksums, ListAdapters,
Generate), ``trainer`` (the reader's calls and the lifecycle of updates: Init, Prepare, Update,
Complete, Cancel, Leave, KeepAlive, a held Watch, UnloadAdapter, Resume), ``operator`` (everything:
Pause, and ``force`` on Init, Cancel, Leave and Resume). The operator's per-principal tokens come from
a file (``wsync serve --token-file``: ``name:role:token`` lines, :func:`read_token_file`), never the
command line; the single ``--token`` (or ``WSYNC_TOKEN``) is an operator. A call without a known token
gets UNAUTHENTICATED; a principal whose role does not allow the call gets PERMISSION_DENIED, reason
``ROLE_NOT_ALLOWED`` (metadata ``principal``, ``role``, ``needs``), before the servicer runs.

Health checking stays open, for load balancers and probes; server reflection stays open on a loopback
address only: on an exposed port it would tell anyone who reaches it the whole API
(``docs/architecture.md``, "Invariants").
"""

from __future__ import annotations

import enum
import hmac
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from wsync_grpc.core.errors import PermissionDenied
from wsync_grpc.service.call_limits import HEALTH_PREFIX, REFLECTION_PREFIX, WEIGHT_SYNC_PREFIX
from wsync_grpc.service.interceptors import Handler, Interceptor
from wsync_grpc.wire.status import to_status
from wsync_grpc.wire.targets import is_loopback

__all__ = ["Principal", "Role", "TokenAuth", "is_loopback", "read_token_file"]

MIN_TOKEN_CHARS = 16
"""The shortest token a token file may hold."""


class Role(enum.IntEnum):
    """What a principal may do; each role may do what the roles below it may."""

    READER = 1
    TRAINER = 2
    OPERATOR = 3


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its name (for logs and errors) and its role."""

    name: str
    role: Role


METHOD_ROLES: dict[str, Role] = {
    "GetStatus": Role.READER,
    "Watch": Role.READER,
    "GetWeightChecksums": Role.READER,
    "ListAdapters": Role.READER,
    "Init": Role.TRAINER,
    "Prepare": Role.TRAINER,
    "Update": Role.TRAINER,
    "Complete": Role.TRAINER,
    "Cancel": Role.TRAINER,
    "Leave": Role.TRAINER,
    "KeepAlive": Role.TRAINER,
    "UnloadAdapter": Role.TRAINER,
    "Resume": Role.TRAINER,
    "Pause": Role.OPERATOR,
}
"""``wsync.v1.WeightSyncService`` method -> the least role that may call it (before its flags, :data:`FLAG_ROLES`)."""

FLAG_ROLES: dict[str, tuple[str, Role]] = {
    "Init": ("force", Role.OPERATOR),
    "Cancel": ("force", Role.OPERATOR),
    "Leave": ("force", Role.OPERATOR),
    "Resume": ("force", Role.OPERATOR),
    "Watch": ("hold", Role.TRAINER),
}
"""Method -> (a boolean request field, the least role that may set it)."""

SERVING_ROLE = Role.READER
"""The least role for the engine's own services (``wsync.v1.GenerationService``); other services need an operator."""


def read_token_file(path: str | os.PathLike[str]) -> dict[str, Principal]:
    """The principals of a token file: one ``name:role:token`` line each (role ``reader``, ``trainer`` or
    ``operator``); blank lines and lines starting with ``#`` are skipped.

    Returns:
        token -> principal.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is readable or writable by other users than its owner (``chmod 600``), a
            malformed line, an unknown role, a token shorter than :data:`MIN_TOKEN_CHARS`, or a name or
            token given twice; the message names the line, never a token.
    """
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{p} is open to other users (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    principals: dict[str, Principal] = {}
    names: set[str] = set()
    for n, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(":")
        role_name, _, token = rest.partition(":")
        if not name or not token:
            raise ValueError(f"{p} line {n}: expected name:role:token")
        try:
            role = Role[role_name.strip().upper()]
        except KeyError:
            raise ValueError(f"{p} line {n}: unknown role {role_name[:40]!r} (reader, trainer or operator)") from None
        token = token.strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{p} line {n}: the token of {name!r} is shorter than {MIN_TOKEN_CHARS} characters")
        if name in names or token in principals:
            raise ValueError(f"{p} line {n}: {name!r} or its token is given twice")
        names.add(name)
        principals[token] = Principal(name.strip(), role)
    return principals


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>'")


_DENY_UNARY: Handler = grpc.stream_unary_rpc_method_handler(_deny)
"""The refusal of a call with a unary response; it reads no request (a request stream is never waited on)."""
_DENY_STREAM: Handler = grpc.stream_stream_rpc_method_handler(_deny)
"""The refusal of a call with a streamed response; it reads no request either."""


def _refuse(principal: Principal, needs: Role, what: str) -> grpc.Status:
    return to_status(
        PermissionDenied(
            "ROLE_NOT_ALLOWED",
            f"{what} needs the {needs.name.lower()} role; {principal.name!r} is a {principal.role.name.lower()}",
            principal=principal.name,
            role=principal.role.name.lower(),
            needs=needs.name.lower(),
        )
    )


def _denying(status: grpc.Status, streaming: bool) -> Handler:
    """A handler that refuses with ``status`` without reading a request."""

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    if streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    return grpc.stream_unary_rpc_method_handler(deny)


def _checking_flag(handler: Handler, principal: Principal, method: str, field: str, needs: Role) -> Handler:
    """``handler``, refusing a request that sets ``field`` unless ``principal`` may.

    The request is judged where the handler reads it: a request stream (the call limiter reads a unary
    request from one, inside its slot) is judged message by message as it is read.
    """

    def check(request: Any, context: grpc.ServicerContext) -> Any:
        if getattr(request, field, False):
            context.abort_with_status(_refuse(principal, needs, f"{method} with {field}"))
        return request

    def each(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for r in requests:
            yield check(r, context)

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        uu = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(lambda r, c: uu(check(r, c), c), **kw)
    if handler.unary_stream is not None:
        us = handler.unary_stream
        return grpc.unary_stream_rpc_method_handler(lambda r, c: us(check(r, c), c), **kw)
    if handler.stream_unary is not None:
        su = handler.stream_unary
        return grpc.stream_unary_rpc_method_handler(lambda rs, c: su(each(rs, c), c), **kw)
    assert handler.stream_stream is not None
    ss = handler.stream_stream
    return grpc.stream_stream_rpc_method_handler(lambda rs, c: ss(each(rs, c), c), **kw)


class TokenAuth(Interceptor):
    """Refuse calls without a known ``authorization: Bearer <token>`` (UNAUTHENTICATED), and calls the token's
    principal's role does not allow (PERMISSION_DENIED ``ROLE_NOT_ALLOWED``); health and, unless exposed,
    reflection stay open.

    The refusals read no request message (a flag's refusal reads the one request it judges), so that a
    caller without the token holds no thread waiting for one.

    Args:
        tokens: the expected token (an operator's), or token -> principal (:func:`read_token_file`).
        exposed: the server binds a non-loopback address: reflection needs a token too.
    """

    def __init__(self, tokens: str | Mapping[str, Principal], *, exposed: bool) -> None:
        if isinstance(tokens, str):
            tokens = {tokens: Principal("token", Role.OPERATOR)}
        self._principals = [(t.encode(), p) for t, p in tokens.items()]
        self._open = (HEALTH_PREFIX,) if exposed else (HEALTH_PREFIX, REFLECTION_PREFIX)

    def _principal(self, value: str | bytes) -> Principal | None:
        raw = value.encode() if isinstance(value, str) else value
        scheme, _, token = raw.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        found = None
        for expected, principal in self._principals:  # every comparison runs: no early exit
            if hmac.compare_digest(token.strip(), expected):
                found = principal
        return found

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method: str = details.method  # type: ignore[attr-defined]
        if method.startswith(self._open):
            return continuation(details)
        principal = None
        for key, value in details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == "authorization" and (principal := self._principal(value)) is not None:
                break
        handler = continuation(details)
        streaming = handler is not None and handler.response_streaming
        if principal is None:
            return _DENY_STREAM if streaming else _DENY_UNARY
        if handler is None or principal.role is Role.OPERATOR:
            return handler
        name = method.rpartition("/")[2]
        if method.startswith(WEIGHT_SYNC_PREFIX):
            needs = METHOD_ROLES.get(name, Role.OPERATOR)
        else:
            needs = SERVING_ROLE if method.startswith("/wsync.v1.") else Role.OPERATOR
        if principal.role < needs:
            return _denying(_refuse(principal, needs, name), streaming)
        flag = FLAG_ROLES.get(name) if method.startswith(WEIGHT_SYNC_PREFIX) else None
        if flag is not None and principal.role < flag[1]:
            return _checking_flag(handler, principal, name, *flag)
        return handler
