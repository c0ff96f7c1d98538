"""Prometheus metrics of one engine (``wsync serve --metrics-port``), with ``prometheus-client``.

Counters and histograms are updated where an update ends (the session) and
where an RPC ends (:class:`RpcMetrics`, a server interceptor); the gauges are
read from the engine's status at scrape time (:class:`_StateCollector`), so
they never drift from what ``GetStatus`` says. Names follow Prometheus'
conventions (``wsync_`` prefix, base units in the name, ``_total`` for
counters); the observability guide (docs/guides/observability.md) maps them to vLLM's
``vllm:rl_weight_update_*`` metrics where there is one.

Metrics:

- ``wsync_update_phase_duration_seconds{phase}``: histogram of each applied
  update's phases: ``prepare`` (first Prepare message to armed receivers),
  ``receive`` (armed to the last bucket), ``verify`` (the verifying Complete),
  ``apply`` (the apply at Complete), as vLLM's
  ``vllm:rl_weight_update_operation_duration_seconds{operation}``;
- ``wsync_update_duration_seconds{outcome}``: first Prepare message to the
  update's end, by outcome (``applied``, ``failed``, ``cancelled``);
- ``wsync_updates_total{outcome, reason}``: updates by outcome and reason
  (``""`` when applied; the ``ErrorInfo`` reason otherwise);
- ``wsync_received_bytes_total``: bytes received over every worker;
- ``wsync_rpcs_total{method, code}``: ``wsync.v1`` RPCs by method and status code; a call to a
  method no registered service declares counts as ``method="unknown"``, so callers cannot
  create series by inventing method names;
- gauges ``wsync_lifecycle_state{state}`` (1 for the current state),
  ``wsync_paused``, ``wsync_dirty``, ``wsync_owner_present``,
  ``wsync_updates_in_flight`` (as vLLM's in-flight operations gauge),
  ``wsync_receive_buffer_bytes``; info ``wsync_weight_version_info{weight_version}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from wsync_grpc.core.errors import clip
from wsync_grpc.core.lifecycle import State
from wsync_grpc.service.interceptors import Handler, Interceptor
from wsync_grpc.service.status import StatusSnapshot

log = logging.getLogger(__name__)


DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram buckets of the duration metrics, in seconds (5 ms to 5 min)."""

UNKNOWN_METHOD = "unknown"
"""The ``method`` label of every call to a method no registered service declares (one series per code)."""


class EngineMetrics:
    """The engine's metrics in a registry of their own (served only when asked).

    Args:
        registry: where to register them; ``None`` = a fresh ``CollectorRegistry``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.phase = Histogram(
            "wsync_update_phase_duration_seconds",
            "Duration of each phase of an applied update (prepare, receive, verify, apply), in seconds",
            ["phase"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.duration = Histogram(
            "wsync_update_duration_seconds",
            "First Prepare message to the end of an update, by outcome, in seconds",
            ["outcome"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.updates = Counter(
            "wsync_updates", "Updates that ended, by outcome and failure reason", ["outcome", "reason"], registry=r
        )
        self.received = Counter("wsync_received_bytes", "Bytes received by every worker of the engine", registry=r)
        self.rpcs = Counter(
            "wsync_rpcs", "wsync.v1 RPCs handled, by method and status code", ["method", "code"], registry=r
        )

    def update_applied(self, phases: dict[str, float], total_s: float, received_bytes: int) -> None:
        """Record an applied update: ``phases`` name -> seconds, the total in seconds, bytes over every worker."""
        for name, seconds in phases.items():
            self.phase.labels(phase=name).observe(seconds)
        self.duration.labels(outcome="applied").observe(total_s)
        self.updates.labels(outcome="applied", reason="").inc()
        self.received.inc(received_bytes)

    def update_failed(self, reason: str, cancelled: bool, total_s: float, received_bytes: int) -> None:
        """Record a failed (or, ``cancelled``, abandoned on request) update with its ``ErrorInfo`` reason."""
        outcome = "cancelled" if cancelled else "failed"
        self.duration.labels(outcome=outcome).observe(total_s)
        self.updates.labels(outcome=outcome, reason=clip(reason, 64)).inc()
        self.received.inc(received_bytes)

    def watch_state(self, snapshot: Callable[[], StatusSnapshot], buffer_bytes: Callable[[], int]) -> None:
        """Export the gauges, read from ``snapshot()`` and ``buffer_bytes()`` at every scrape."""
        self.registry.register(_StateCollector(snapshot, buffer_bytes))

    def serve(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` over HTTP on ``host:port`` (a daemon thread); returns the HTTP server (``shutdown()``).

        Raises:
            OSError: the port cannot be bound.
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_port)
        return server


class _StateCollector(Collector):
    """The gauges, read from the engine's status when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot], buffer_bytes: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._buffer_bytes = buffer_bytes

    def describe(self) -> Iterable[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        state = GaugeMetricFamily("wsync_lifecycle_state", "1 for the engine's lifecycle state", labels=["state"])
        for st in State:
            state.add_metric([st.name], 1.0 if st == s.state else 0.0)
        yield state
        yield GaugeMetricFamily("wsync_paused", "1 while admission is paused", value=float(s.paused))
        yield GaugeMetricFamily(
            "wsync_dirty", "1 while a failed update left the weights half-updated", value=float(s.dirty)
        )
        yield GaugeMetricFamily(
            "wsync_owner_present", "1 while the engine has a live owner", value=float(s.owner is not None)
        )
        yield GaugeMetricFamily(
            "wsync_updates_in_flight", "Updates in flight (0 or 1)", value=float(s.update is not None)
        )
        yield GaugeMetricFamily(
            "wsync_receive_buffer_bytes",
            "Receive buffers kept for the next update, in bytes",
            value=float(self._buffer_bytes()),
        )
        info = InfoMetricFamily("wsync_weight_version", "The weight version being served")
        info.add_metric([], {"weight_version": clip(s.weight_version, 200)})
        yield info


class RpcMetrics(Interceptor):
    """Counts every ``wsync.v1`` RPC by method and final status code (``wsync_rpcs_total``).

    Put it first in the server's interceptors, so that calls refused by the
    token check are counted too (UNAUTHENTICATED). Only the methods of the
    services given to :meth:`count_services` get a series of their own
    (labelled with the method's name); a call to any other path of a
    ``wsync.v1`` service, or of no registered service at all, counts as
    ``method="unknown"``, so the number of series stays bounded whatever
    method names callers send. Health checks and reflection are not counted.

    Args:
        metrics: where the counter lives.
        services: full names of the services whose methods are counted by name (see :meth:`count_services`).
    """

    def __init__(self, metrics: EngineMetrics, services: Iterable[str] = ()) -> None:
        self._metrics = metrics
        self._methods: dict[str, str] = {}
        self.count_services(services)

    def count_services(self, services: Iterable[str]) -> None:
        """Count the methods of ``services`` (full names, e.g. ``"wsync.v1.WeightSyncService"``) by name.

        Call it before the server starts, once every service is registered. A service the default
        protobuf descriptor pool does not hold has no methods to read: its calls count as ``unknown``.
        """
        pool = descriptor_pool.Default()
        for name in services:
            try:
                service = pool.FindServiceByName(name)
            except KeyError:
                log.warning("service %s has no descriptor: its RPCs are counted as method=%r", name, UNKNOWN_METHOD)
                continue
            for m in service.methods:
                self._methods[f"/{service.full_name}/{m.name}"] = m.name

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        path = handler_call_details.method  # type: ignore[attr-defined]
        method = self._methods.get(path)
        if method is None:
            if path.startswith(_UNCOUNTED):
                return handler  # health and reflection (or made-up paths under their names)
            method = UNKNOWN_METHOD
        if handler is None:  # gRPC answers UNIMPLEMENTED
            self._metrics.rpcs.labels(method=method, code=grpc.StatusCode.UNIMPLEMENTED.name).inc()
            return None
        count = self._metrics.rpcs
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

        def unary(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    reply = behavior(request, context)
                except BaseException:
                    count.labels(method=method, code=_code(context, failed=True)).inc()
                    raise
                count.labels(method=method, code=_code(context, failed=False)).inc()
                return reply

            return call

        def stream(
            behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
        ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from behavior(request, context)
                except BaseException:
                    count.labels(method=method, code=_code(context, failed=True)).inc()
                    raise
                count.labels(method=method, code=_code(context, failed=False)).inc()

            return call

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kw)
        if handler.stream_stream is not None:  # a streamed call behind the call bounds, or refused by the token
            return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kw)
        return handler


_UNCOUNTED = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Paths the counter leaves alone: health checks and reflection."""


def _code(context: grpc.ServicerContext, *, failed: bool) -> str:
    """The status code the call ends with: the one it set or aborted with; UNKNOWN for an escaped exception."""
    code = context.code()  # type: ignore[attr-defined]
    if code is None:
        code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
    return str(code.name)
