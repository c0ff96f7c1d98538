"""OpenTelemetry spans of the engine's side of a sync, joined to the trainer's trace.

The trainer sends its trace context in each call's gRPC metadata (W3C
``traceparent``, injected by OpenTelemetry's global propagator; see
:mod:`wsync_grpc.trainer.tracing`). The engine extracts it and records, as
children of the trainer's spans: ``wsync.engine.prepare`` (reading,
validating and arming one update), ``wsync.engine.receive`` (armed receivers
to the last bucket, recorded once every bucket arrived, with the times it
really took), ``wsync.engine.verify`` and ``wsync.engine.apply`` (the two
phases of Complete). Only the OpenTelemetry API is a dependency: without an
SDK configured in the engine's process every span is a no-op.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context

tracer = trace.get_tracer("wsync_grpc.service")
"""The engine's tracer (a no-op until an OpenTelemetry SDK is configured)."""


def remote_context(context: grpc.ServicerContext) -> Context:
    """The trainer's trace context carried in the call's metadata (empty when it sent none)."""
    carrier = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
    return propagate.extract(carrier)


@contextmanager
def server_span(name: str, context: grpc.ServicerContext, **attributes: str | int) -> Iterator[Context]:
    """A span ``name`` around one RPC's work, child of the caller's span; yields its context."""
    with tracer.start_as_current_span(
        name, context=remote_context(context), kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        yield trace.set_span_in_context(span)


def record_span(
    name: str, parent: Context, start_monotonic: float, end_monotonic: float, **attributes: str | int
) -> None:
    """Record a span ``name`` that already happened, from and to two ``time.monotonic()`` readings (seconds)."""
    offset_ns = time.time_ns() - time.monotonic_ns()
    span = tracer.start_span(
        name, context=parent, start_time=int(start_monotonic * 1e9) + offset_ns, attributes=attributes
    )
    span.end(end_time=int(end_monotonic * 1e9) + offset_ns)
