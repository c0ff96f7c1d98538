"""A live PEFT LoRA model as an adapter update: its spec and its tensors, in the names engines expect.

What :meth:`~wsync_grpc.trainer.client.TrainerClient.sync_adapter` broadcasts
for a ``peft.PeftModel``: the active adapter's ``LoraConfig`` fields (rank,
alpha, target modules) and ``peft.get_peft_model_state_dict`` (names such as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the names
``adapter_model.safetensors`` holds). ``peft`` is imported only here, and only
when called.
"""

from __future__ import annotations

from typing import Any

import torch

from wsync_grpc.core.lora import PEFT_PREFIX, LoraSpec, check_spec


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
