"""Read what a vLLM worker serves back in checkpoint coordinates, for bit-exact checksums.

vLLM serves a model in its own layout: ``q_proj``/``k_proj``/``v_proj``
fused into one ``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``,
every tensor-parallel rank holding a slice, and, on the CPU backend, every
linear layer's weight (and the LM head's) prepacked into a oneDNN handle
after loading (a linear's ``weight`` parameter is then empty, so vLLM's own
``compute_weight_checksums`` hashes nothing for them; the LM head keeps a
``weight`` that its kernel no longer reads). This module undoes all three
for one worker: it reads each served weight back (one with a kernel by
multiplying the identity matrix through it, which returns ``W^T`` exactly:
every output element is one product by 1.0 plus products by 0.0), splits
fused layers along the sizes the layer declares, and reports which slice of
the checkpoint tensor this rank holds. For checksums the slices of all ranks
are gathered onto the first rank of the tensor-parallel group
(:func:`gather_shards`, over vLLM's own CPU process group), which hashes the
whole tensor; the front process joins slices only when it asks for bytes.

Runs inside a worker process, between two inference steps (the probe uses
the layer's kernel, which is not thread-safe against a running step).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PROBE_ROWS = 512
"""Rows of the identity multiplied through a prepacked layer at a time (bounds the probe's memory)."""


@dataclass(frozen=True)
class Shard:
    """Which slice of a checkpoint tensor a rank holds: part ``rank`` of ``count`` equal parts along ``dim``."""

    dim: int
    rank: int
    count: int


@dataclass(frozen=True)
class ServedTensor:
    """One checkpoint tensor (or this rank's slice of it) as the worker serves it.

    Attributes:
        name: the checkpoint name (``model.layers.0.self_attn.q_proj.weight``).
        tensor: the served values, in checkpoint orientation (``[out, in]`` for a linear weight).
        shard: the slice this rank holds; ``None`` when it holds the whole tensor.
    """

    name: str
    tensor: torch.Tensor
    shard: Shard | None


def _weight(module: Any) -> torch.Tensor:
    """A linear layer's served weight ``[out_local, in_local]``, probed through its kernel where it has one.

    On CPU a layer multiplies through the kernel its weight processing
    built (``cpu_linear``), which may hold its own packed copy of the
    weight even where the ``weight`` parameter is kept (the LM head): what
    that kernel computes is what is served, so it is what is read. The
    weight is passed as vLLM's ``apply`` passes it: a prepacked kernel
    ignores it, the ``torch.nn.functional.linear`` fallback (taken where
    oneDNN cannot build a matmul for the dtype, e.g. bfloat16 without
    AVX-512) multiplies by it.
    """
    w: torch.Tensor = module.weight
    if not callable(getattr(module, "cpu_linear", None)):
        return w.detach()
    k = int(getattr(module, "input_size_per_partition", 0) or module.embedding_dim)
    rows = []
    with torch.no_grad():
        for r0 in range(0, k, PROBE_ROWS):
            n = min(PROBE_ROWS, k - r0)
            eye = torch.zeros(n, k, dtype=w.dtype, device=w.device)
            eye[torch.arange(n), torch.arange(r0, r0 + n)] = 1
            rows.append(module.cpu_linear(eye, w, None))
    return torch.cat(rows).t().contiguous()


def _shard(dim: int, rank: int, count: int) -> Shard | None:
    return Shard(dim, rank, count) if count > 1 else None


def _linear(name: str, module: Any, packed: dict[str, list[str]], wanted: Collection[str]) -> Iterator[ServedTensor]:
    """The checkpoint tensors of one linear layer (fused ones split into their parts).

    A layer none of whose checkpoint tensors is in ``wanted`` (when it is not empty) is not read: its probe
    through the kernel is skipped, as is everything else.
    """
    kind = type(module).__name__
    tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
    prefix, _, leaf = name.rpartition(".")
    parts = packed.get(leaf, [leaf])
    pnames = ["weight"] + (["bias"] if getattr(module, "bias", None) is not None else [])
    if wanted and not any(_part_name(prefix, part, p) in wanted for part in parts for p in pnames):
        return
    params = [("weight", _weight(module))]
    if "bias" in pnames:
        params.append(("bias", module.bias.detach()))
    for pname, value in params:
        if "QKVParallelLinear" in kind:
            replicas = int(getattr(module, "num_kv_head_replicas", 1))
            sizes = [
                module.num_heads * module.head_size,
                module.num_kv_heads * module.head_size,
                module.num_kv_heads * module.v_head_size,
            ]
            shards = [_shard(0, tp_rank, tp_size)] + [_shard(0, tp_rank // replicas, tp_size // replicas)] * 2
        elif hasattr(module, "output_sizes") and len(parts) > 1:
            sizes = [s // tp_size for s in module.output_sizes]
            shards = [_shard(0, tp_rank, tp_size)] * len(sizes)
        else:
            row = "RowParallel" in kind
            sizes = [value.shape[0]]
            shards = [None if row and pname == "bias" else _shard(1 if row else 0, tp_rank, tp_size)]
        for part, piece, shard in zip(parts, torch.split(value, sizes, dim=0), shards, strict=True):
            yield ServedTensor(_part_name(prefix, part, pname), piece, shard)


def _part_name(prefix: str, part: str, pname: str) -> str:
    """The checkpoint name of parameter ``pname`` of part ``part`` of a layer under ``prefix``."""
    return f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}"


def _embedding(name: str, module: Any) -> ServedTensor:
    """A vocabulary-parallel embedding (its table) or LM head (its kernel): this rank's rows, padding cut off."""
    idx = module.shard_indices
    rows = int(idx.org_vocab_end_index - idx.org_vocab_start_index)
    head = any(c.__name__ == "ParallelLMHead" for c in type(module).__mro__)
    w = (_weight(module) if head else module.weight.detach())[:rows]
    return ServedTensor(f"{name}.weight", w, _shard(0, int(getattr(module, "tp_rank", 0)), int(module.tp_size)))


def served_tensors(model: torch.nn.Module, names: Collection[str] = ()) -> Iterator[ServedTensor]:
    """The checkpoint tensors the worker's ``model`` serves, read back, in module order.

    ``names`` selects checkpoint names (empty: every tensor). A layer is read only when one of its
    tensors is selected, so asking for a few names costs only their layers' probes. A selected layer
    may yield its other parts too (a fused layer's siblings): the caller filters by name.

    Names are the module paths of vLLM's model with fused layers named by
    their parts (the model's ``packed_modules_mapping``), which for the
    Hugging Face architectures vLLM loads without a name mapper are the
    checkpoint's names. With ``--enable-lora`` vLLM wraps layers
    (``QKVParallelLinearWithLoRA``...) around the served one, its
    ``base_layer``: the wrapper holds only adapter slots and is skipped, the
    base layer is named as the layer it wraps.
    """
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("WithLoRA"):
            continue
        name = path.replace(".base_layer", "")
        if hasattr(module, "shard_indices"):
            if not names or f"{name}.weight" in names:
                yield _embedding(name, module)
        elif kind.endswith("Linear") and hasattr(module, "weight"):
            yield from _linear(name, module, packed, names)
        else:
            for pname, p in module.named_parameters(recurse=False):
                yield ServedTensor(f"{name}.{pname}" if name else pname, p.detach(), None)


def tensor_parallel_group() -> Any | None:
    """vLLM's tensor-parallel ``GroupCoordinator`` of this worker; ``None`` with tensor parallel size 1."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return tp if int(tp.world_size) > 1 else None


def gather_shards(tp: Any, part: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """The whole tensor from every tensor-parallel rank's ``part``, on the group's first rank; ``None`` elsewhere.

    A collective over ``tp.cpu_group`` (vLLM's gloo group of the tensor-parallel ranks): every rank calls
    it for the same tensor. Slices may differ in length along ``shard.dim`` (a vocabulary's last rows):
    each is padded to the longest, sent as bytes, and cut back. Ranks holding the same slice (replicated
    key/value heads) send it once each; the first copy is kept.

    Args:
        tp: the ``GroupCoordinator`` (``world_size``, ``rank_in_group``, ``ranks``, ``cpu_group``).
        part: this rank's slice, on the CPU, contiguous.
        shard: which slice it is (``dim``, ``rank`` of ``count``).

    Returns:
        The checkpoint tensor (``count`` slices joined along ``dim``, C order) on the first rank.

    Raises:
        RuntimeError: the ranks' slices do not make up ``shard.count`` distinct parts.
    """
    meta = torch.tensor([part.shape[shard.dim], shard.rank], dtype=torch.int64)
    metas = [torch.zeros_like(meta) for _ in range(int(tp.world_size))]
    dist.all_gather(metas, meta, group=tp.cpu_group)
    longest = max(int(m[0]) for m in metas)
    shape = list(part.shape)
    shape[shard.dim] = longest
    padded = torch.zeros(shape, dtype=part.dtype)
    padded.narrow(shard.dim, 0, part.shape[shard.dim]).copy_(part)
    flat = padded.reshape(-1).view(torch.uint8)
    first = int(tp.rank_in_group) == 0
    received = [torch.empty_like(flat) for _ in metas] if first else None
    dist.gather(flat, received, dst=int(tp.ranks[0]), group=tp.cpu_group)
    if received is None:
        return None
    slices: dict[int, torch.Tensor] = {}
    for m, raw in zip(metas, received, strict=True):
        rows, index = int(m[0]), int(m[1])
        slices.setdefault(index, raw.view(part.dtype).reshape(shape).narrow(shard.dim, 0, rows))
    if sorted(slices) != list(range(shard.count)):
        raise RuntimeError(f"the tensor-parallel ranks hold slices {sorted(slices)} of {shard.count}")
    return torch.cat([slices[i] for i in range(shard.count)], dim=shard.dim).contiguous()
