"""``wsync.v1.GenerationService``: text generation on the reference engine over gRPC.

It lets a person (``grpcurl``) or a test watch the weights change; real
engines keep their own generation APIs. Status codes: empty prompt or a
request beyond the model's context -> INVALID_ARGUMENT; not finished within
the request's timeout (admission wait included, e.g. while the engine is
paused) -> DEADLINE_EXCEEDED; engine closed -> UNAVAILABLE; a failed forward
pass -> INTERNAL; an adapter the engine does not serve -> NOT_FOUND.
"""

from __future__ import annotations

import logging

import grpc
from wsync.v1 import generation_pb2, generation_pb2_grpc

from wsync_grpc.engines.reference import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TIMEOUT_S,
    EngineClosed,
    FinishReason,
    GenerationTimeout,
    ReferenceEngine,
)
from wsync_grpc.engines.reference.lora import UnknownAdapter

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORTED,
}


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Serves ``Generate`` from a :class:`ReferenceEngine` (greedy, deterministic for fixed weights)."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self._engine = engine

    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        """Run one request to its end.

        ``max_new_tokens`` 0 means 32; an unset or zero ``timeout`` means 300 s,
        further bounded by the call's own gRPC deadline. A call cancelled by
        the client cancels its request in the engine.
        """
        if not request.prompt:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is required")
        max_new_tokens = request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        timeout = request.timeout.ToTimedelta().total_seconds() if request.HasField("timeout") else 0.0
        if timeout < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout must not be negative, got {timeout} s")
        timeout = timeout or DEFAULT_TIMEOUT_S
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = max(min(timeout, remaining), 1e-3)
        try:
            handle = self._engine.submit(
                request.prompt, max_new_tokens, raw=request.raw, timeout=timeout, adapter=request.adapter or None
            )
        except UnknownAdapter as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineClosed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

        def cancel() -> None:  # runs when the RPC terminates; a no-op once the request finished
            handle.cancel()

        context.add_callback(cancel)
        try:
            result = handle.result()
        except GenerationTimeout as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except EngineClosed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RuntimeError as exc:
            log.error("Generate failed: %s", exc)
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        return generation_pb2.GenerateResponse(
            text=result.text,
            token_ids=result.token_ids,
            finish_reason=_FINISH_REASONS[result.finish_reason],
            weight_versions=result.weight_versions,
            queued_seconds=result.queued_seconds,
            generate_seconds=result.generate_seconds,
            adapter=result.adapter,
            adapter_versions=result.adapter_versions,
        )


def add_generation_service(server: grpc.Server, engine: ReferenceEngine) -> GenerationServicer:
    """Register ``wsync.v1.GenerationService`` for ``engine`` on ``server`` (before ``start()``).

    Returns:
        The servicer.
    """
    servicer = GenerationServicer(engine)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    return servicer
