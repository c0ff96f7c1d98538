"""Synthetic models with realistic LLM tensor names and shapes, for tests and benchmarks.

Shapes follow Hugging Face's Llama layout (``model.layers.N.self_attn.q_proj.weight``
...), and a Mixtral-like MoE layout for many-tensor cases. Values are
deterministic (seeded) so a trainer and an engine can build the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a Llama-style decoder.

    Attributes:
        hidden: hidden size.
        intermediate: MLP intermediate size.
        layers: number of decoder layers.
        vocab: vocabulary size.
        heads: attention heads; kv_heads: key/value heads (GQA).
        experts: MoE experts per layer (0 = dense MLP).
        tied: whether ``lm_head.weight`` is tied to the embeddings.
    """

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    experts: int = 0
    tied: bool = False


PRESETS: dict[str, LlamaShape] = {
    # ~0.3 MB in bf16: fast tests.
    "tiny": LlamaShape(hidden=64, intermediate=172, layers=2, vocab=1000, heads=4, kv_heads=2, tied=True),
    # SmolLM2-135M's exact shapes (272 tensors, tied embeddings): 0.27 GB in bf16.
    "smollm2-shapes": LlamaShape(576, 1536, 30, 49152, 9, 3, tied=True),
    # ~0.25 GB, ~1 GB and ~4 GB in bf16.
    "0.25gb": LlamaShape(1024, 2816, 5, 32000, 16, 8),
    "1gb": LlamaShape(2048, 5632, 8, 32000, 16, 8),
    "4gb": LlamaShape(3072, 8192, 18, 32000, 24, 8),
    # MoE-like: ~20k tensors.
    "moe-20k": LlamaShape(256, 64, 24, 8000, 4, 2, experts=272),
}


def tensor_shapes(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """Return ``(name, shape)`` for every tensor, in model order (tied lm_head omitted)."""
    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if shape.experts:
            out.append((p + "block_sparse_moe.gate.weight", (shape.experts, h)))
            for e in range(shape.experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                out += [
                    (q + "w1.weight", (shape.intermediate, h)),
                    (q + "w2.weight", (h, shape.intermediate)),
                    (q + "w3.weight", (shape.intermediate, h)),
                ]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (shape.intermediate, h)),
                (p + "mlp.up_proj.weight", (shape.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, shape.intermediate)),
            ]
    out.append(("model.norm.weight", (h,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, h)))
    return out


def build(
    preset: str | LlamaShape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Build the tensors of ``preset``, filled deterministically from ``seed``.

    Cheap fill: each tensor is a seeded normal vector of at most 4096
    elements tiled over the tensor, so building 4 GB takes seconds, and two
    different seeds give different values in every tensor.

    Raises:
        KeyError: unknown preset name (see :data:`PRESETS`).
    """
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dims in tensor_shapes(shape):
        t = torch.empty(dims, dtype=dtype, device=device)
        flat = t.view(-1)
        pattern = torch.randn(min(4096, flat.numel()), generator=gen).to(dtype)
        reps = -(-flat.numel() // pattern.numel())
        flat.copy_(pattern.repeat(reps)[: flat.numel()])
        out[name] = t
    return out


def aliases(preset: str | LlamaShape) -> dict[str, str]:
    """Alias -> canonical names of ``preset`` (the tied lm_head, if any)."""
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    return {"lm_head.weight": "model.embed_tokens.weight"} if shape.tied else {}


def nbytes(preset: str | LlamaShape, dtype: torch.dtype = torch.bfloat16) -> int:
    """Total size of ``preset`` in ``dtype``, in bytes."""
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    esize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for _, dims in tensor_shapes(shape):
        n = 1
        for d in dims:
            n *= d
        total += n * esize
    return total


def register_parameters(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Register every tensor of ``tensors`` as a parameter of ``module`` under its dotted name (submodules made as
    needed), so that ``module.named_parameters()`` yields the same names (e.g. a toy policy with :func:`build`'s
    Llama names and shapes, for a trainer to train and sync); returns ``module``.

    Raises:
        KeyError: a name is registered already.
    """
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        owner = module
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        if leaf in owner._parameters:
            raise KeyError(f"parameter {name!r} is registered already")
        owner.register_parameter(leaf, torch.nn.Parameter(tensor))
    return module
