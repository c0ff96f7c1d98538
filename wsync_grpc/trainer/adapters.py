"""A LoRA adapter as an update: a PEFT directory the engines read, or a live PEFT model's spec and tensors, in the
names engines expect, sent by the transport the caller chose.

What :meth:`~wsync_grpc.trainer.client.TrainerClient.sync_adapter` sends
for a ``peft.PeftModel``: the active adapter's ``LoraConfig`` fields (rank,
alpha, target modules) and ``peft.get_peft_model_state_dict`` (names such as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the names
``adapter_model.safetensors`` holds), by broadcast over the weight-sync group or
through shared memory on the engines' host (:func:`adapter_update`). ``peft`` is
imported only here, and only when called.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from wsync_grpc.core.layout import Transport
from wsync_grpc.core.lora import PEFT_PREFIX, LoraSpec, check_spec
from wsync_grpc.trainer.options import check_version, transport_of
from wsync_grpc.trainer.request import DiskRequest, UpdateRequest, live_adapter_request
from wsync_grpc.trainer.source import NamedTensors


def adapter_update(
    adapter: Any,
    name: str,
    version: str,
    transport: str,
    bucket_bytes: int,
    *,
    update_id: str | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> tuple[UpdateRequest, NamedTensors | None]:
    """The update that loads ``adapter`` as ``name`` at ``version``, and the tensors the trainer sends for it.

    Args:
        adapter: a PEFT directory as the engines see it (``str`` or ``os.PathLike``), read by each engine
            (a :class:`~wsync_grpc.trainer.request.DiskRequest`, no tensors sent); or a live ``peft.PeftModel``,
            whose active LoRA adapter's tensors the trainer sends by ``transport``.
        transport: how a live adapter's tensors travel, the caller's
            :data:`~wsync_grpc.trainer.options.TransportName`: ``"broadcast"`` (over the weight-sync group) or
            ``"shared_memory"`` (engines on this host) or ``"cuda_ipc"`` (tensors on a GPU, engines on that GPU). A
            directory's files are read by the engines
            (``TRANSPORT_DISK``): it takes the default only.
        bucket_bytes: bucket capacity of a live adapter's tensors, in bytes.
        update_id, on_phase: as :meth:`TrainerClient.sync <wsync_grpc.trainer.client.TrainerClient.sync>`'s.

    Returns:
        ``(request, tensors)``: ``tensors`` is ``None`` for a directory.

    Raises:
        ValueError: an unknown ``transport`` or an empty ``version`` (both checked before the model is read), a
            directory with ``transport="shared_memory"``, an object that is neither a path nor a PEFT LoRA model.
    """
    kind = transport_of(transport)
    check_version(version)
    if isinstance(adapter, str | os.PathLike):  # its spec comes from the directory's adapter_config.json
        if kind is not Transport.BROADCAST:
            raise ValueError(
                f"a PEFT directory is read by the engines from disk: transport {transport!r} is for a live PEFT model"
            )
        request = DiskRequest.create(adapter, version, "staged", update_id=update_id, on_phase=on_phase, adapter=name)
        return request, None
    spec, tensors = adapter_tensors(adapter, name)
    sent = live_adapter_request(spec, version, bucket_bytes, kind, update_id=update_id, on_phase=on_phase)
    return sent, NamedTensors(tensors.items())


def adapter_tensors(model: Any, name: str) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """The spec (named ``name``) and tensors of ``model``'s active LoRA adapter.

    A ``target_modules`` regex is resolved to the module names it matched
    (the contract carries names).

    Raises:
        ValueError: ``model`` is not a PEFT model with an active LoRA adapter, or its config is unusable.
    """
    try:
        from peft import get_peft_model_state_dict
    except ImportError as e:  # pragma: no cover - peft comes with the adapter
        raise ValueError(f"a live adapter needs peft installed: {e}") from None
    configs = getattr(model, "peft_config", None)
    active = getattr(model, "active_adapter", None)
    if not isinstance(configs, dict) or not isinstance(active, str) or active not in configs:
        raise ValueError(f"expected a PEFT LoRA model or a PEFT directory path, got {type(model).__name__}")
    config = configs[active]
    if str(getattr(config, "peft_type", "")).upper().removeprefix("PEFTTYPE.") != "LORA":
        raise ValueError(f"the active adapter {active!r} is not a LoRA adapter")
    tensors = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=active).items()}
    targets = config.target_modules
    if isinstance(targets, str):
        targets = {k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in tensors}
    spec = LoraSpec(name, int(config.r), float(config.lora_alpha), tuple(sorted(targets)))
    try:
        check_spec(spec)
    except Exception as e:
        raise ValueError(str(e)) from None
    return spec, tensors
