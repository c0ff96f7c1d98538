"""Calls by class, each class with its own bound on concurrent calls, so that no traffic starves the owner's calls.

grpcio's synchronous server runs every call on one thread pool, and a call holds its thread until it
ends: idle reflection streams, Generate calls queued behind a pause or observers' ``Watch`` streams
could take every thread, and the owner's KeepAlive, Complete and Cancel, and the operator's Resume,
would queue behind them for good. So every call belongs to a :class:`CallClass`; each class may run
at most its own number of calls at once (:class:`CallLimits`), a call beyond it is refused at once with
RESOURCE_EXHAUSTED / ``TOO_MANY_CALLS`` (the client may retry) rather than queued, and the server's pool
has a thread for every call every class may run (:meth:`CallLimits.pool_threads`): whatever one class
does, the others find threads (``docs/architecture.md``, "Call isolation").

:class:`CallLimiter` is the server interceptor that does it. A unary request is read inside the
call's slot (its handler takes the request as a stream of one), so a client that opens calls and never
sends their request holds slots of its class only, never threads beyond them. A ``Watch`` call's class
depends on its request (held or not): its request is read in a slot of either ``watch`` or ``lease``,
which it then keeps or trades for the other.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from wsync_grpc.core.errors import InvalidArgument, ResourceExhausted
from wsync_grpc.service.interceptors import Handler, Interceptor
from wsync_grpc.wire.status import to_status


class CallClass(enum.Enum):
    """What a call is, for the bound on how many such calls run at once."""

    CONTROL = "control"
    """``wsync.v1.WeightSyncService``'s unary calls and Prepare: the owner's and the operator's commands."""
    LEASE = "lease"
    """``KeepAlive`` and held ``Watch`` calls: the owner's proofs of life (only the owner's stay open)."""
    WATCH = "watch"
    """``Watch`` calls without ``hold``: observers of the update in flight."""
    SERVING = "serving"
    """The engine's own services beside weight sync (the reference engine's ``GenerationService``)."""
    HEALTH = "health"
    """``grpc.health.v1.Health`` (open without a token, for load balancers and probes)."""
    REFLECTION = "reflection"
    """Server reflection (``grpcurl``, ``buf curl``)."""


DEFAULT_CALL_LIMITS: Mapping[CallClass, int] = {
    CallClass.CONTROL: 16,
    CallClass.LEASE: 16,
    CallClass.WATCH: 16,
    CallClass.SERVING: 32,
    CallClass.HEALTH: 8,
    CallClass.REFLECTION: 4,
}
"""Calls of each class that may run at once, by default (``wsync serve --max-calls CLASS=N``)."""

SPARE_THREADS = 8
"""Threads of the server's pool beyond the classes' bounds: refusals of excess calls run on them, in threads."""

WEIGHT_SYNC_PREFIX = "/wsync.v1.WeightSyncService/"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
LEASE_METHODS = ("KeepAlive",)
WATCH_METHOD = "Watch"


def call_classes(method: str) -> tuple[CallClass, ...]:
    """The classes a call of ``method`` (``/package.Service/Method``) may run in; two only for ``Watch``.

    A ``Watch`` request with ``hold`` is a :attr:`CallClass.LEASE` call, one without a
    :attr:`CallClass.WATCH` call (see :func:`request_class`).
    """
    if method.startswith(HEALTH_PREFIX):
        return (CallClass.HEALTH,)
    if method.startswith(REFLECTION_PREFIX):
        return (CallClass.REFLECTION,)
    if method.startswith(WEIGHT_SYNC_PREFIX):
        name = method[len(WEIGHT_SYNC_PREFIX) :]
        if name in LEASE_METHODS:
            return (CallClass.LEASE,)
        if name == WATCH_METHOD:
            return (CallClass.WATCH, CallClass.LEASE)
        return (CallClass.CONTROL,)
    return (CallClass.SERVING,)


def request_class(method: str, request: Any) -> CallClass:
    """The class of a call of ``method`` once its (unary) request is known: a held Watch is a lease."""
    classes = call_classes(method)
    if len(classes) == 1:
        return classes[0]
    return CallClass.LEASE if getattr(request, "hold", False) else CallClass.WATCH


@dataclass(frozen=True)
class CallLimits:
    """How many calls of each class may run at once (a missing class takes its default).

    Attributes:
        maxima: class -> calls at once (at least 1); see :data:`DEFAULT_CALL_LIMITS`.

    Raises:
        ValueError: a bound below 1.
    """

    maxima: Mapping[CallClass, int] = field(default_factory=lambda: dict(DEFAULT_CALL_LIMITS))

    def __post_init__(self) -> None:
        merged = {**DEFAULT_CALL_LIMITS, **self.maxima}
        for cls, n in merged.items():
            if n < 1:
                raise ValueError(f"at least one {cls.value} call must be allowed, got {n}")
        object.__setattr__(self, "maxima", merged)

    def pool_threads(self) -> int:
        """Threads the server's pool needs so that no class waits for another's: every bound plus spares."""
        return sum(self.maxima.values()) + SPARE_THREADS

    @classmethod
    def parse(cls, specs: Sequence[str]) -> CallLimits:
        """Limits from ``CLASS=N`` strings (``wsync serve --max-calls``), the defaults for the other classes.

        Raises:
            ValueError: not ``CLASS=N``, an unknown class (the message lists them), or N below 1.
        """
        maxima: dict[CallClass, int] = {}
        names = ", ".join(c.value for c in CallClass)
        for spec in specs:
            name, sep, value = spec.partition("=")
            try:
                maxima[CallClass(name.strip())] = int(value)
            except ValueError:
                raise ValueError(f"--max-calls takes CLASS=N with CLASS one of {names}, not {spec!r}") from None
            if not sep:
                raise ValueError(f"--max-calls takes CLASS=N, not {spec!r}")
        return cls(maxima)


class _Slots:
    """The running calls of one class, at most ``limit``."""

    def __init__(self, cls: CallClass, limit: int) -> None:
        self.cls = cls
        self.limit = limit
        self._lock = threading.Lock()
        self.running = 0

    def take(self) -> bool:
        with self._lock:
            if self.running >= self.limit:
                return False
            self.running += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.running -= 1


class CallLimiter(Interceptor):
    """The server interceptor that bounds each class's concurrent calls (see the module's description).

    Put it after the token check, so that calls refused for their credentials take no slot.

    Args:
        limits: the bounds per class.
    """

    def __init__(self, limits: CallLimits) -> None:
        self._slots = {c: _Slots(c, n) for c, n in limits.maxima.items()}

    def running(self, cls: CallClass) -> int:
        """Calls of class ``cls`` running now."""
        return self._slots[cls].running

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        return _limited(handler, method, self)

    def take(self, classes: Sequence[CallClass], context: grpc.ServicerContext) -> _Slots:
        """A slot of the first class in ``classes`` that has one free; refuses the call when none has.

        Raises:
            Exception: the call was aborted with RESOURCE_EXHAUSTED / TOO_MANY_CALLS (grpc's abort).
        """
        for cls in classes:
            slots = self._slots[cls]
            if slots.take():
                return slots
        self._refuse(self._slots[classes[0]], context)
        raise AssertionError("abort returned")  # pragma: no cover

    def settle(self, held: _Slots, cls: CallClass, context: grpc.ServicerContext) -> _Slots:
        """Trade ``held`` for a slot of ``cls`` (the class the request revealed); refuses the call when none is free.

        Raises:
            Exception: the call was aborted with RESOURCE_EXHAUSTED / TOO_MANY_CALLS (``held`` given back).
        """
        if held.cls is cls:
            return held
        wanted = self._slots[cls]
        taken = wanted.take()
        held.give()
        if not taken:
            self._refuse(wanted, context)
        return wanted

    @staticmethod
    def _refuse(slots: _Slots, context: grpc.ServicerContext) -> None:
        err = ResourceExhausted(
            "TOO_MANY_CALLS",
            f"{slots.limit} {slots.cls.value} call(s) are running on this engine already, its bound "
            "(wsync serve --max-calls); retry later",
            call_class=slots.cls.value,
            limit=str(slots.limit),
        )
        context.abort_with_status(to_status(err))


def _first(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
    """The one request of a unary call, read from its stream of one.

    Raises:
        Exception: no request came (grpc's abort, INVALID_ARGUMENT); grpc.RpcError: the call was cancelled.
    """
    request = next(requests, None)
    if request is None:
        context.abort_with_status(to_status(InvalidArgument("NO_REQUEST", "the call carried no request message")))
    return request


def _limited(handler: Handler, method: str, limiter: CallLimiter) -> Handler:
    """``handler`` run inside a slot of its class; a unary request is read inside the slot."""
    classes = call_classes(method)
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    def admit(arg: Any, unary: bool, context: grpc.ServicerContext) -> tuple[_Slots, Any]:
        slots = limiter.take(classes, context)
        try:
            request = _first(arg, context) if unary else arg
        except BaseException:
            slots.give()
            raise
        return limiter.settle(slots, request_class(method, request) if unary else classes[0], context), request

    def unary_response(behavior: Callable[[Any, grpc.ServicerContext], Any], unary: bool) -> Any:
        def call(arg: Any, context: grpc.ServicerContext) -> Any:
            slots, request = admit(arg, unary, context)
            try:
                return behavior(request, context)
            finally:
                slots.give()

        return call

    def stream_response(behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]], unary: bool) -> Any:
        def call(arg: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            slots, request = admit(arg, unary, context)
            try:
                yield from behavior(request, context)
            finally:
                slots.give()

        return call

    if handler.unary_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary_response(handler.unary_unary, True), **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary, False), **kw)
    if handler.unary_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream_response(handler.unary_stream, True), **kw)
    assert handler.stream_stream is not None  # the fourth arity
    return grpc.stream_stream_rpc_method_handler(stream_response(handler.stream_stream, False), **kw)
