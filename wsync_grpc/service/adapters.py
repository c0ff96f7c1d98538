"""The engine's LoRA adapter RPCs beside updates: ``ListAdapters`` and ``UnloadAdapter``.

Loading or replacing an adapter is an update (``PrepareHeader.adapter``,
through :mod:`wsync_grpc.service.session`); these two only read the adapters
an engine serves (:class:`~wsync_grpc.core.lora.LoraAdapters`) or remove
one, between two inference steps, by the engine's owner.
"""

from __future__ import annotations

from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import Engine
from wsync_grpc.core.errors import FailedPrecondition
from wsync_grpc.core.lifecycle import Rpc
from wsync_grpc.core.lora import LoraAdapters, check_name
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.session import UpdateSession


def list_adapters(engine: Engine) -> pb.ListAdaptersResponse:
    """``ListAdaptersResponse``: ``supported`` false on an engine without adapters."""
    if not isinstance(engine, LoraAdapters) or not engine.lora_linears():
        return pb.ListAdaptersResponse(supported=False)
    out = pb.ListAdaptersResponse(supported=True)
    for a in engine.adapters():
        out.adapters.add(
            name=a.name,
            version=a.version,
            rank=a.rank,
            alpha=a.alpha,
            target_modules=list(a.target_modules),
            tensor_count=a.tensor_count,
        )
    return out


def unload_adapter(
    state: EngineState[UpdateSession], request: pb.UnloadAdapterRequest, credential: str = ""
) -> pb.UnloadAdapterResponse:
    """Remove adapter ``request.name`` under the engine's weights lock; idempotent (``credential``: the caller's
    lease credential).

    Raises:
        InvalidArgument: BAD_ADAPTER_NAME.
        FailedPrecondition: NOT_OWNER; ADAPTER_UPDATE_IN_FLIGHT (an update of that adapter is in flight).
    """
    name = check_name(request.name)
    engine = state.engine
    with state.lock:
        state.check_owner(credential, "UnloadAdapter")
        state.lifecycle.check(Rpc.UNLOAD_ADAPTER)
        upd = state.update
        if upd is not None and upd.header.adapter is not None and upd.header.adapter.name == name:
            raise FailedPrecondition(
                "ADAPTER_UPDATE_IN_FLIGHT", f"an update of adapter {name!r} is in flight; cancel it first"
            )
        if not isinstance(engine, LoraAdapters):
            return pb.UnloadAdapterResponse(was_loaded=False)
        with engine.weights_lock():
            removed = engine.unload_adapter(name)
    if removed is None:
        return pb.UnloadAdapterResponse(was_loaded=False)
    return pb.UnloadAdapterResponse(was_loaded=True, version=removed[0], aborted_requests=removed[1])
