"""The lease credential on the wire: the ``wsync-lease`` header, and a client channel that carries it.

The engine issues its owner a lease credential (:mod:`wsync_grpc.core.ownership`) in the reply of
the call that made it the owner: ``InitResponse.lease_credential``, ``PrepareResponse.lease_credential``
or the first ``KeepAliveResponse.lease_credential``. The owner proves its ownership by sending it back
as the ``wsync-lease`` metadata header (:data:`LEASE_HEADER`) with every call that needs it: with a
raw stub, ``metadata=[("wsync-lease", credential)]``; with grpcurl, ``-H "wsync-lease: <credential>"``.

:func:`lease_channel` does both for a Python client: its interceptor attaches the credential a
:class:`LeaseHolder` holds at call time to every call on the channel, and hands the holder every
credential a reply carries; a ``NOT_OWNER`` refusal of the credential sent voids it (it can never
prove anything again: the engine's lease moved to a later generation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from wsync_grpc.wire.status import error_reason

LEASE_HEADER = "wsync-lease"
"""The metadata key of the lease credential (lower case, as gRPC metadata keys are)."""


def presented(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The lease credential a call presents in its metadata (``""``: none)."""
    for key, value in metadata or ():
        if key == LEASE_HEADER:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return ""


class LeaseHolder:
    """The lease credential of one client on one engine; thread-safe.

    Attributes:
        credential: the credential held (``""``: none yet, or the last one was refused).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._credential = ""
        self._changed = threading.Condition(self._lock)
        self._listeners: list[Callable[[], object]] = []

    @property
    def credential(self) -> str:
        """The credential held now (``""``: none)."""
        return self._credential

    def take(self, reply: object) -> None:
        """Hold the credential ``reply`` carries (its ``lease_credential`` field), if any."""
        credential = getattr(reply, "lease_credential", "")
        if credential:
            with self._lock:
                self._credential = credential
                self._changed.notify_all()
                listeners = list(self._listeners)
            for listener in listeners:
                listener()

    def listen(self, listener: Callable[[], object]) -> Callable[[], None]:
        """Call ``listener`` (from the thread that takes it) whenever a credential is taken; returns the undo."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def drop(self, credential: str) -> None:
        """Void ``credential`` (the engine refused it), unless another one is held meanwhile."""
        with self._lock:
            if credential and self._credential == credential:
                self._credential = ""

    def wait(self, timeout_s: float) -> str:
        """The credential held, waiting up to ``timeout_s`` seconds for one; ``""`` if none came."""
        with self._lock:
            self._changed.wait_for(lambda: bool(self._credential), timeout_s)
            return self._credential


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class _Captured:
    """A call (a future, or an iterator of replies) whose replies hand their credential to the holder."""

    def __init__(self, call: Any, holder: LeaseHolder, sent: str) -> None:
        self._call = call
        self._holder = holder
        self._sent = sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    def _refused(self, e: grpc.RpcError) -> None:
        if error_reason(e) == "NOT_OWNER":
            self._holder.drop(self._sent)

    def result(self, timeout: float | None = None) -> Any:
        try:
            reply = self._call.result(timeout)
        except grpc.RpcError as e:
            self._refused(e)
            raise
        self._holder.take(reply)
        return reply

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            reply = next(self._call)
        except grpc.RpcError as e:
            self._refused(e)
            raise
        self._holder.take(reply)
        return reply


class LeaseInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Sends ``holder``'s credential as ``wsync-lease`` with every call (unless the call sets its own), and
    hands ``holder`` the credential of every reply.

    Args:
        holder: the credential of this channel's client on its engine.
    """

    def __init__(self, holder: LeaseHolder) -> None:
        self.holder = holder

    def _call(self, continuation: Callable[[Any, Any], Any], details: Any, request: Any) -> _Captured:
        metadata = list(details.metadata or ())
        sent = presented(metadata)
        if not sent and (sent := self.holder.credential):
            metadata.append((LEASE_HEADER, sent))
        new = _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            getattr(details, "compression", None),
        )
        return _Captured(continuation(new, request), self.holder, sent)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._call(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._call(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._call(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._call(continuation, client_call_details, request_iterator)


class _AioLease:
    """What the ``grpc.aio`` interceptors of :func:`aio_lease_interceptors` share."""

    def __init__(self, holder: LeaseHolder) -> None:
        self.holder = holder

    def details(self, details: Any) -> tuple[Any, str]:
        metadata = list(details.metadata or ())
        sent = presented(metadata)
        if not sent and (sent := self.holder.credential):
            metadata.append((LEASE_HEADER, sent))
        new = grpc.aio.ClientCallDetails(
            details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready
        )
        return new, sent

    async def unary(self, continuation: Any, details: Any, request: Any) -> Any:
        new, sent = self.details(details)
        call = await continuation(new, request)
        try:
            reply = await call
        except grpc.RpcError as e:
            if error_reason(e) == "NOT_OWNER":
                self.holder.drop(sent)
            raise
        self.holder.take(reply)
        return call

    async def stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details)[0], request)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    def __init__(self, lease: _AioLease) -> None:
        self._lease = lease

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._lease.unary(continuation, client_call_details, request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[type-arg]
    def __init__(self, lease: _AioLease) -> None:
        self._lease = lease

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await self._lease.unary(continuation, client_call_details, request_iterator)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    def __init__(self, lease: _AioLease) -> None:
        self._lease = lease

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._lease.stream(continuation, client_call_details, request)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[type-arg]
    def __init__(self, lease: _AioLease) -> None:
        self._lease = lease

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await self._lease.stream(continuation, client_call_details, request_iterator)


def aio_lease_interceptors(holder: LeaseHolder) -> list[Any]:
    """The ``grpc.aio`` counterpart of :class:`LeaseInterceptor`, one interceptor per call shape (a ``grpc.aio``
    channel files each interceptor under one shape only): ``holder``'s credential goes with every call (unless
    the call sets its own); every unary reply's credential goes to ``holder``, and a ``NOT_OWNER`` refusal
    voids the credential sent.
    """
    lease = _AioLease(holder)
    return [_AioUnaryUnary(lease), _AioStreamUnary(lease), _AioUnaryStream(lease), _AioStreamStream(lease)]


def lease_channel(channel: grpc.Channel, holder: LeaseHolder | None = None) -> tuple[grpc.Channel, LeaseHolder]:
    """``channel`` carrying a lease credential (see the module); closing it closes ``channel``.

    Args:
        holder: the credential's holder (``None``: a new, empty one).

    Returns:
        The intercepted channel, and its holder.
    """
    holder = holder if holder is not None else LeaseHolder()
    return grpc.intercept_channel(channel, LeaseInterceptor(holder)), holder
