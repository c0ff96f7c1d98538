"""No traffic starves the owner's calls: each class of calls has its own bound and its own threads.

A real reference engine (a tiny Llama) served by ``build_server`` with its defaults, and against it at
once: 200 idle server-reflection streams, 64 Generate calls queued behind a pause, 32 ``Watch`` calls
of a non-owner on the update in flight. The owner's KeepAlive, Complete and Cancel, and the
operator's Resume, each answer within 1 s; each crowd gets its class's bound of calls and the excess
is refused at once with RESOURCE_EXHAUSTED / ``TOO_MANY_CALLS`` rather than queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import code_of
from wsync.v1 import generation_pb2, generation_pb2_grpc, weight_sync_pb2_grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.engines.generation_service import add_generation_service
from wsync_grpc.engines.reference import ReferenceEngine
from wsync_grpc.group.waits import wait_work
from wsync_grpc.service.call_limits import DEFAULT_CALL_LIMITS, CallClass
from wsync_grpc.service.server import WsyncServer, build_server
from wsync_grpc.testing import join_as_trainer, owner_channel
from wsync_grpc.wire.convert import duration
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (the owner's calls answered within a bound): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

pytest.importorskip("transformers")

OWNER = "the-owner"
TENSOR = "model.norm.weight"
ANSWER_S = 1.0
"""The owner's and the operator's calls answer within this, in seconds, whatever the crowd does."""
LONG = 60.0
"""Generous bound, in seconds, for anything that should happen promptly."""


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = LONG) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    reply = call()
    return reply, time.monotonic() - t0


def prepare(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, version: str) -> str:
    """Prepare a one-bucket staged update of ``TENSOR`` (64 float32) as the owner; its update id."""
    spec = pb.BucketSpec(index=0, size_bytes=256)
    spec.tensors.add(name=TENSOR, dtype="float32", shape=[64], offset_bytes=0)
    header = pb.PrepareHeader(weight_version=version, bucket_count=1, total_bytes=256, owner=OWNER)
    reply = stub.Prepare(iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=LONG)
    return str(reply.update_id)


def watchers(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, update_id: str, n: int) -> list[Any]:
    """``n`` Watch calls of a non-owner (no hold) on ``update_id``, left open."""
    return [stub.Watch(pb.WatchRequest(update_id=update_id, interval=duration(5))) for _ in range(n)]


def refused(calls: list[Any]) -> int:
    """How many of the (ended) calls were refused for their class's bound."""
    return sum(
        1
        for c in calls
        if c.done() and code_of(c) == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(c) == "TOO_MANY_CALLS"
    )


@pytest.fixture
def served(tiny_llama: Any, smollm2_tokenizer: Any) -> Iterator[tuple[WsyncServer, ReferenceEngine]]:
    engine = ReferenceEngine(tiny_llama, smollm2_tokenizer, name="tiny-llama")

    def services(server: grpc.Server) -> list[str]:
        add_generation_service(server, engine)
        return [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name]

    srv = build_server(engine, extra=services)
    try:
        yield srv, engine
    finally:
        srv.stop(0.5)
        engine.close()


@pytest.mark.timeout(300)
def test_the_owners_calls_answer_within_a_second_whatever_the_crowd_does(
    served: tuple[WsyncServer, ReferenceEngine],
) -> None:
    srv, engine = served
    limits = DEFAULT_CALL_LIMITS
    owners_channel = owner_channel(srv.address)  # keeps the lease credential Init issues, and presents it
    crowd_channel = grpc.insecure_channel(srv.address)
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(owners_channel)
    crowd = weight_sync_pb2_grpc.WeightSyncServiceStub(crowd_channel)
    release = threading.Event()
    streams: list[Any] = []
    trainer = join_as_trainer(stub, owner=OWNER)
    try:
        first = prepare(stub, "v1")

        # The crowd: a paused engine with 64 Generate calls queued, 200 idle reflection streams,
        # and 32 Watch calls of a non-owner on the update in flight.
        stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=LONG)
        generation = generation_pb2_grpc.GenerationServiceStub(crowd_channel)
        request = generation_pb2.GenerateRequest(prompt="Name a colour.", max_new_tokens=2)
        generations = [generation.Generate.future(request, timeout=LONG) for _ in range(64)]

        def idle() -> Iterator[reflection_pb2.ServerReflectionRequest]:
            release.wait(LONG)  # a stream that sends nothing until released
            yield from ()

        reflection = reflection_pb2_grpc.ServerReflectionStub(crowd_channel)
        reflections = [reflection.ServerReflectionInfo(idle()) for _ in range(200)]
        streams += reflections
        watches = watchers(crowd, first, 32)
        streams += watches
        wait_until(
            lambda: (
                srv.limiter.running(CallClass.REFLECTION) == limits[CallClass.REFLECTION]
                and srv.limiter.running(CallClass.SERVING) == limits[CallClass.SERVING]
                and srv.limiter.running(CallClass.WATCH) == limits[CallClass.WATCH]
                and refused(reflections) == 200 - limits[CallClass.REFLECTION]
                and refused(generations) == 64 - limits[CallClass.SERVING]
                and refused(watches) == 32 - limits[CallClass.WATCH]
            ),
            "every class full, the excess refused",
        )
        assert engine.request_counts() == (0, limits[CallClass.SERVING])

        # The owner's calls, and the operator's, answer at once.
        keepalive = stub.KeepAlive(pb.KeepAliveRequest(owner=OWNER))
        streams.append(keepalive)
        msg, took = timed(lambda: next(keepalive))
        assert took < ANSWER_S and msg.owner.owner == OWNER, (took, msg)
        status, took = timed(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=LONG))
        assert took < ANSWER_S and status.owner.keepalive_calls == 1, took

        new = torch.arange(64, dtype=torch.float32)
        wait_work(trainer.broadcast(new.view(torch.uint8)), time.monotonic() + LONG)  # type: ignore[attr-defined]
        done, took = timed(lambda: stub.Complete(pb.CompleteRequest(update_id=first, owner=OWNER), timeout=LONG))
        assert took < ANSWER_S and done.weight_version == "v1", took
        assert torch.equal(engine.get_weight(TENSOR), new)

        second = prepare(stub, "v2")
        streams += watchers(crowd, second, 32)
        wait_until(lambda: srv.limiter.running(CallClass.WATCH) == limits[CallClass.WATCH], "the watchers are back")
        cancelled, took = timed(lambda: stub.Cancel(pb.CancelRequest(update_id=second, owner=OWNER), timeout=LONG))
        assert took < ANSWER_S and cancelled.cancelled, took

        resumed, took = timed(lambda: stub.Resume(pb.ResumeRequest(), timeout=LONG))
        assert took < ANSWER_S and resumed.was_paused, took
        # The queued Generate calls that were admitted run once resumed, on the new weights.
        admitted = [g for g in generations if not (g.done() and g.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)]
        replies = [g.result(timeout=LONG) for g in admitted]
        assert len(replies) == limits[CallClass.SERVING]
        assert all(list(r.weight_versions) == ["v1"] for r in replies)
    finally:
        release.set()
        for call in streams:
            call.cancel()
        trainer.destroy()  # type: ignore[attr-defined]
        owners_channel.close()
        crowd_channel.close()
