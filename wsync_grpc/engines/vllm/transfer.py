"""wsync inside a vLLM worker process: the ``wsync`` weight-transfer backend, vLLM's glue to the worker host.

vLLM creates one weight-transfer engine per worker process after the model
is loaded (``vllm.distributed.weight_transfer``, selected by
``--weight-transfer-config '{"backend": "wsync"}'``). wsync's is
:class:`WsyncTransferEngine`: it holds the engine-agnostic
:class:`~wsync_grpc.engines.host.WorkerHost` (group membership, the update's
receiver made by its transport, progress, apply, abandon) and gives it
:class:`VllmModelGlue`, which loads weights through vLLM's layerwise reload
(``initialize_layerwise_reload`` -> ``model.load_weights`` with
checkpoint-format names -> ``finalize_layerwise_reload``, re-running each
layer's weight processing: fused ``qkv_proj``/``gate_up_proj``, the CPU
backend's prepacked linears; then the processing of every layer that shares
a loaded parameter without loading it, see :meth:`VllmModelGlue.end_reload`)
and prepares a staged update beside the live
model (:class:`~wsync_grpc.engines.vllm.shadow.ShadowUpdate`).

The engine's front process drives it through the methods of
:class:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension` (vLLM's
``collective_rpc``), never through vLLM's own ``update_weights`` flow, whose
receive runs inside the step loop. Every method here runs on the worker's
main thread, between two inference steps, except the receiver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.messages import bucket_from_msg
from wsync_grpc.core.packing import tensor_views
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S
from wsync_grpc.engines.host import WorkerHost
from wsync_grpc.engines.vllm.shadow import ShadowUpdate, SpareShadows
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.group.waits import wait_work

log = logging.getLogger(__name__)


@dataclass
class WsyncInitInfo(WeightTransferInitInfo):
    """The group a worker joins (vLLM's ``init_weight_transfer_engine`` ``init_info``).

    Attributes:
        master_address: host of the trainer's rendezvous store.
        master_port: its TCP port.
        rank_offset: the group rank of the engine's global worker rank 0.
        world_size: ranks in the group, trainer included.
        group_name: the group's name (its store prefix); empty for the default.
        backend: ``"gloo"`` or ``"nccl"``; empty to choose by device.
        timeout_s: join deadline and per-collective timeout, in seconds.
        trainer_ranks: how many group ranks the trainer holds (each a sender).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = ""
    backend: str = ""
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
    trainer_ranks: int = 1


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of vLLM's own update flow (``update_weights``) on the wsync backend.

    Not how wsync updates travel (those are driven by the ``wsync.v1``
    servicer and received in the background): vLLM's flow receives inside its
    step loop, between ``start_weight_update`` and ``finish_weight_update``.
    It is offered so that vLLM's RL API works on the same group and
    transport, e.g. to compare the two flows side by side.

    Attributes:
        buckets: the chunk's buckets (:func:`~wsync_grpc.core.messages.bucket_to_msg`),
            each broadcast by rank 0 as one flat ``uint8`` buffer of its ``size_bytes``.
    """

    buckets: list[dict[str, Any]] = field(default_factory=list)


class VllmModelGlue:
    """A vLLM worker's model, as the worker host loads it (:class:`~wsync_grpc.engines.host.ModelGlue`).

    Args:
        model: the worker's model.
        vllm_config: the engine's config (vLLM's loaders read it).
        model_config: its model config (the reload's finalization reads it).
    """

    def __init__(self, model: Any, vllm_config: Any, model_config: Any) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.model_config = model_config
        self._tied = tied_layers(model)
        self.spare = SpareShadows()
        """Shadow memory a staged update leaves for the next (:class:`~wsync_grpc.engines.vllm.shadow.SpareShadows`)."""

    def begin_reload(self) -> None:
        """``initialize_layerwise_reload``: each layer reloads once all of its tensors arrived.

        The spare shadows are kept: they are memory, not served values, and a
        live parameter the reload replaces no longer matches its entry
        (:meth:`~wsync_grpc.engines.vllm.shadow.SpareShadows.take`), so the
        next staged update allocates that one afresh.
        """
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """``model.load_weights`` of checkpoint-format pairs (a layerwise reload is in progress)."""
        with set_current_vllm_config(self.vllm_config):
            self.model.load_weights(iter(tensors))

    def end_reload(self) -> None:
        """``finalize_layerwise_reload``, then the processing of tied layers that loaded nothing themselves.

        A layer that shares its parameter with another (the LM head tied to
        the token embeddings) receives no tensor of its own: the model's
        ``load_weights`` skips ``lm_head.weight`` and loads the embeddings.
        vLLM's finalization then puts its parameter back (which now holds
        the new values) but does not re-run its weight processing, so what
        processing built from the old values keeps serving (on CPU, the LM
        head's oneDNN-prepacked copy of the embeddings: every logit from the
        old weights). Such a layer is processed again here, as at load time.
        """
        untouched = [layer for layer in self._tied if _loaded_nothing(layer)]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self.model, self.model_config)
            for layer in untouched:
                method = getattr(layer, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    method.process_weights_after_loading(layer)

    def preparation(self) -> ShadowUpdate:
        """A staged update's processed weights, to be built beside the live model as buckets arrive.

        The shadows are made here (:meth:`ShadowUpdate.begin`), in the memory
        the last swap left spare where it fits; the host feeds each received
        bucket to ``add`` and calls ``finish`` after the last one.

        Raises:
            Exception: from vLLM's metadata (the host then reloads at apply).
        """
        shadow = ShadowUpdate(self.model, self.vllm_config, self.spare)
        shadow.begin()
        return shadow


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``model`` holding a parameter that another layer holds too (tied embeddings), in module order."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        for p in layer.parameters(recurse=False):
            holders.setdefault(id(p), []).append(layer)
    tied = {id(layer): layer for layers in holders.values() if len(layers) > 1 for layer in layers}
    return [layer for layer in model.modules() if id(layer) in tied]


def _loaded_nothing(layer: torch.nn.Module) -> bool:
    """Whether ``layer``, in a layerwise reload, is still waiting for its first tensor."""
    info = get_layerwise_info(layer)
    return bool(info.can_load()) and int(info.load_numel) == 0


class WsyncTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
    """One vLLM worker's weight-sync host (:attr:`host`) and vLLM's own update flow on the same group.

    Constructed by vLLM's ``WeightTransferEngineFactory`` (see
    :func:`wsync_grpc.engines.vllm.register`). Not thread-safe: every method
    runs on the worker's main thread (a ``collective_rpc``); only the
    receiver runs beside it.
    """

    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.glue = VllmModelGlue(self.model, self.vllm_config, self.model_config)
        self.host = WorkerHost(self.glue, self.device, self.global_rank)
        """The update in flight and the group membership (driven by :mod:`~wsync_grpc.engines.vllm.worker`)."""
        self.raw_buffers: list[torch.Tensor] = []
        """The buffers of ``wsync_receive_raw`` (the transport's ceiling), kept between calls."""
        self._join_lock = threading.Lock()
        self._joining: threading.Thread | None = None
        self._join_outcome: dict[str, Any] | None = None
        self._leave_when_joined = False

    @property
    def global_rank(self) -> int:
        """This worker's rank among all the engine's workers (data parallel replicas included)."""
        pc = self.parallel_config
        return int(pc.data_parallel_index) * int(pc.world_size) + int(pc.rank)

    @property
    def group(self) -> WeightSyncGroup | None:
        """The worker's membership of the weight-sync group, ``None`` when not a member."""
        return self.host.group

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        """Join the weight-sync group at ``rank_offset`` + this worker's global rank (blocks until it formed).

        Raises:
            GroupTimeout, GroupError, ValueError: see :func:`~wsync_grpc.group.process_group.join_group`.
        """
        i = init_info
        self.host.join(
            GroupParams(
                i.master_address,
                i.master_port,
                i.rank_offset,
                i.world_size,
                i.group_name,
                i.backend,
                i.timeout_s,
                i.trainer_ranks,
            )
        )

    def begin_join(self, init_info: WsyncInitInfo) -> None:
        """Start joining the group on a thread of its own and return at once; see :meth:`join_outcome`.

        A join waits for every rank (the trainer's store, the other engines): for as long as the caller's
        timeout. Run in the ``collective_rpc`` itself, it would hold vLLM's step loop, and every request
        with it, for that long; on its own thread, steps run on.

        Raises:
            RuntimeError: an earlier join of this worker has not ended yet (it overran its timeout).
        """
        with self._join_lock:
            if self._joining is not None and self._joining.is_alive():
                raise RuntimeError("an earlier join of this worker has not ended yet; try again")
            self._join_outcome = None
            self._leave_when_joined = False
            self._joining = threading.Thread(
                target=self._join_in_background, args=(init_info,), name="wsync-join", daemon=True
            )
            self._joining.start()

    def _join_in_background(self, init_info: WsyncInitInfo) -> None:
        try:
            self.init_transfer_engine(init_info)
            outcome: dict[str, Any] = {"rank": self.host.rank, "error": ""}
        except BaseException as e:
            outcome = {"rank": -1, "error": str(e) or type(e).__name__}
        with self._join_lock:
            self._join_outcome = outcome
            if self._leave_when_joined:  # left while joining: the group it formed goes too
                self.host.leave()

    def join_outcome(self) -> dict[str, Any] | None:
        """The last join's end, ``None`` while it runs: ``{"rank": int, "error": str}`` (``error`` empty: joined)."""
        with self._join_lock:
            return self._join_outcome

    def shutdown(self) -> None:
        """Abandon any update in flight and leave the group (a join in flight leaves once it ends). Idempotent."""
        with self._join_lock:
            if self._joining is not None and self._joining.is_alive():
                self._leave_when_joined = True
                return
        self.host.leave()

    # ------------------------------------------------ vLLM's own update flow

    def start_weight_update(self) -> None:
        """vLLM's flow: begin a layerwise reload (the engine must be paused by then)."""
        self.glue.begin_reload()
        self._flow_reloading = True

    def finish_weight_update(self) -> None:
        """vLLM's flow: finalize the layerwise reload."""
        if getattr(self, "_flow_reloading", False):
            self._flow_reloading = False
            self.glue.end_reload()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's flow: receive and load one chunk, inside the step loop (the base class's, minus its CPU-only sync)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        """vLLM's flow: receive each bucket of ``update_info`` and load its tensors (blocks until the last byte).

        Raises:
            RuntimeError: not a member of a group.
            GroupTimeout, GroupError: a broadcast did not complete within the group's timeout.
        """
        group = self.group
        if group is None:
            raise RuntimeError("this worker is not a member of a weight-sync group")
        deadline = time.monotonic() + group.timeout_s
        for m in update_info.buckets:
            b = bucket_from_msg(m)
            flat = torch.empty(b.size_bytes, dtype=torch.uint8, device=self.device)
            wait_work(group.broadcast(flat), deadline, sliced=group.sliced_waits)
            self.glue.load(list(tensor_views(flat, b.tensors)))
