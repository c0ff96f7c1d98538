"""The served weights of the reference engine: canonical names, tied aliases, sizes.

:func:`collect_weights` finds every weight of a ``torch.nn.Module`` under its
Hugging Face name, one canonical name per tensor (tied embeddings have
aliases); :class:`ParameterSummary` sums their sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from wsync_grpc.core.engine import ParamSpec


@dataclass(frozen=True)
class ParameterSummary:
    """Size of the served weights, ties counted once.

    Attributes:
        tensors: number of canonical tensors (what an update carries).
        parameters: total number of elements.
        nbytes: total size in the served dtypes, in bytes.
        dtypes: the served dtype names, sorted.
    """

    tensors: int
    parameters: int
    nbytes: int
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, specs: Mapping[str, ParamSpec]) -> ParameterSummary:
        """The summary of the canonical tensors ``specs`` (canonical name -> spec)."""
        values = specs.values()
        return cls(
            tensors=len(specs),
            parameters=sum(s.numel for s in values),
            nbytes=sum(s.nbytes for s in values),
            dtypes=tuple(sorted({str(s.dtype).removeprefix("torch.") for s in values})),
        )

    def __str__(self) -> str:
        return (
            f"{self.tensors} tensors, {self.parameters / 1e6:.1f}M parameters, "
            f"{self.nbytes / 2**20:.1f} MiB ({'/'.join(self.dtypes)})"
        )


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    """Identity of the memory a tensor views: two names with the same key are one tied tensor."""
    if t.numel() == 0 or t.device.type == "meta":
        return ("id", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def collect_weights(
    model: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, ParamSpec], dict[str, str]]:
    """Canonical name -> tensor, canonical name -> spec, alias -> canonical, in ``state_dict`` order.

    The canonical name of a tied tensor is the first name
    ``named_parameters(remove_duplicate=False)`` yields for it; persistent
    buffers (part of ``state_dict``) count as weights, non-persistent ones not.

    Raises:
        RuntimeError: a tied name whose canonical tensor is not in ``state_dict``.
    """
    canonical_of: dict[tuple[object, ...], str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical_of.setdefault(_storage_key(p), name)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    entries = list(model.state_dict(keep_vars=True).items())
    seen = {name for name, _ in entries}
    entries += [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if n not in seen]
    for name, t in entries:
        key = _storage_key(t)
        canonical = canonical_of.setdefault(key, name)
        if canonical == name:
            tensors[name] = t.data
        else:
            aliases[name] = canonical
    for alias, canonical in aliases.items():  # a tied name ordered before its canonical one
        if canonical not in tensors:  # pragma: no cover - only for exotic modules
            raise RuntimeError(f"tied parameter {alias!r} -> {canonical!r} not found in state_dict")
    specs = {name: ParamSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    return tensors, specs, aliases
