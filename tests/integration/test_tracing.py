"""One OpenTelemetry trace per sync, across the trainer and two real engines (gRPC on loopback ports).

The SDK's in-memory exporter collects the spans of the trainer client and of both engines' servicers
(in this process); the engines join the trainer's trace through the ``traceparent`` metadata.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import tensor_server

from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import TrainerClient

EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first test to ask sets the global provider
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def test_a_sync_is_one_trace_whose_engine_spans_join_the_trainers(spans: InMemorySpanExporter) -> None:
    model = synthetic.build("tiny", seed=4, dtype=torch.bfloat16)
    with (
        tensor_server() as (a, _ea, _sa),
        tensor_server() as (b, _eb, _sb),
        TrainerClient([a.address, b.address], rpc_timeout_s=30) as client,
    ):
        client.sync(model.items(), "traced")
    got = [s for s in spans.get_finished_spans() if s.name.startswith("wsync.")]
    roots = [s for s in got if s.name == "wsync.sync"]
    assert len(roots) == 1
    root = roots[0]
    assert root.attributes is not None and root.attributes["wsync.weight_version"] == "traced"
    assert root.context is not None
    trace_id = root.context.trace_id
    mine = [s for s in got if s.context is not None and s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in mine if s.context is not None}

    def parent(s: ReadableSpan) -> str:
        assert s.parent is not None, s.name
        return by_id[s.parent.span_id].name

    phases = [s.name for s in sorted(mine, key=lambda s: s.start_time or 0) if s.parent and parent(s) == "wsync.sync"]
    assert phases == ["wsync.plan", "wsync.init", "wsync.prepare", "wsync.broadcast", "wsync.verify", "wsync.apply"]
    engine_spans = [s for s in mine if s.name.startswith("wsync.engine.")]
    counts = {n: sum(s.name == n for s in engine_spans) for n in {s.name for s in engine_spans}}
    assert counts == {"wsync.engine.prepare": 2, "wsync.engine.receive": 2, "wsync.engine.verify": 2,
                      "wsync.engine.apply": 2}  # fmt: skip
    for s in engine_spans:
        want = {
            "wsync.engine.prepare": "wsync.prepare",
            "wsync.engine.receive": "wsync.engine.prepare",
            "wsync.engine.verify": "wsync.verify",
            "wsync.engine.apply": "wsync.apply",
        }[s.name]
        assert parent(s) == want, (s.name, parent(s))
    assert all(s.start_time is not None and s.end_time is not None and s.end_time >= s.start_time for s in mine)
    assert len(mine) == len(got), "every wsync span of the sync is in its one trace"
