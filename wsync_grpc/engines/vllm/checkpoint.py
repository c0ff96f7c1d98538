"""What a vLLM engine's updates may carry: the tensors of the checkpoint it loaded, in checkpoint names.

A trainer sends its Hugging Face model's tensors (``q_proj``, not vLLM's
fused ``qkv_proj``), full-size, whatever vLLM's tensor parallelism. So the
names, shapes and dtypes an update is validated against are read from the
checkpoint directory the engine was started with: only the safetensors
headers, never a tensor's data. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from wsync_grpc.core.engine import ParamSpec
from wsync_grpc.transports.disk.checkpoint import model_checkpoint_files, torch_dtype


def checkpoint_specs(model_dir: Path, served_dtype: torch.dtype) -> dict[str, ParamSpec]:
    """Name -> spec of every tensor in the checkpoint, read from the files' headers.

    Floating tensors are served in ``served_dtype`` (vLLM's ``--dtype``);
    others keep the checkpoint's dtype. Shapes are the full, unsharded ones.

    Raises:
        NotFound: no safetensors file there (see :func:`~wsync_grpc.transports.disk.checkpoint.model_checkpoint_files`).
        ValueError: a dtype weight sync does not carry.
    """
    specs: dict[str, ParamSpec] = {}
    for f in model_checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = st.get_slice(name)
                dtype = torch_dtype(sl.get_dtype())
                served = served_dtype if dtype.is_floating_point else dtype
                specs[name] = ParamSpec(name, served, tuple(int(d) for d in sl.get_shape()))
    return specs


def tied_aliases(specs: Mapping[str, ParamSpec], tie_word_embeddings: bool) -> dict[str, str]:
    """``{"lm_head.weight": "model.embed_tokens.weight"}`` when the embeddings are tied and only those are stored."""
    if tie_word_embeddings and "lm_head.weight" not in specs and "model.embed_tokens.weight" in specs:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def fused_groups(names: Sequence[str], packed: Mapping[str, Sequence[str]]) -> list[tuple[str, ...]]:
    """The checkpoint names vLLM serves as one tensor, grouped.

    Args:
        names: checkpoint names.
        packed: the model's ``packed_modules_mapping`` (fused module -> its
            parts, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``).

    Returns:
        One tuple per fused tensor present in ``names`` (e.g. a layer's
        ``q_proj.weight``, ``k_proj.weight`` and ``v_proj.weight``).
    """
    present = set(names)
    groups: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for parts in packed.values():
        if len(parts) < 2:
            continue
        for name in names:
            prefix, dot, rest = name.partition(f".{parts[0]}.")
            if not dot or name in seen:
                continue
            group = tuple(f"{prefix}.{p}.{rest}" for p in parts)
            if all(g in present for g in group):
                groups.append(group)
                seen.update(group)
    return groups
