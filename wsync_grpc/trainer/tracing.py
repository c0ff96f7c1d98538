"""The OpenTelemetry trace of one sync, carried to the engines in gRPC metadata.

``TrainerClient.sync`` is one trace: a root span ``wsync.sync`` and one child
span per phase as it runs (``wsync.plan``, ``wsync.init`` when the group is
(re-)formed, ``wsync.prepare``, ``wsync.broadcast``, ``wsync.verify`` for a
staged update, ``wsync.apply``). The calls of a phase carry its context in
their metadata (W3C ``traceparent`` through OpenTelemetry's global
propagator), so the engines' spans (:mod:`wsync_grpc.service.tracing`) join
the trace under it. Only the OpenTelemetry API is a dependency: without an
SDK configured by the caller every span is a no-op and no metadata is added.
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode

tracer = trace.get_tracer("wsync_grpc.trainer")
"""The trainer client's tracer (a no-op until an OpenTelemetry SDK is configured)."""


class SyncTrace:
    """The root span of one sync and its current phase span.

    Args:
        update_id: the update's id.
        weight_version: the version being synced.
        apply_mode: ``"staged"`` or ``"streaming"``.
        engines: how many engines the sync goes to.
    """

    def __init__(self, update_id: str, weight_version: str, apply_mode: str, engines: int) -> None:
        self._root = tracer.start_span(
            "wsync.sync",
            attributes={
                "wsync.update_id": update_id,
                "wsync.weight_version": weight_version,
                "wsync.apply_mode": apply_mode,
                "wsync.engines": engines,
            },
        )
        self._phase: Span | None = None

    def begin(self, phase: str) -> None:
        """End the current phase's span (if any) and start ``wsync.<phase>`` under the root."""
        if self._phase is not None:
            self._phase.end()
        self._phase = tracer.start_span(f"wsync.{phase}", context=trace.set_span_in_context(self._root))

    def metadata(self, base: tuple[tuple[str, str | bytes], ...]) -> tuple[tuple[str, str | bytes], ...]:
        """``base`` plus the current phase's trace context (nothing more without an SDK)."""
        carrier: dict[str, str] = {}
        span = self._phase if self._phase is not None else self._root
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return base + tuple(carrier.items())

    def end(self, error: BaseException | None = None) -> None:
        """End the phase and the root span; an ``error`` marks both as failed."""
        for span in (self._phase, self._root):
            if span is None:
                continue
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, str(error)[:500]))
            span.end()
        self._phase = None
