"""Torch dtype names as they travel in ``TensorSpec.dtype``.

The names are torch's own (``str(torch.bfloat16)`` without the ``torch.``
prefix), the same strings SGLang's ``UpdateWeightsFromDistributedReqInput.dtypes``
carries, so a trainer can fill the field with ``str(t.dtype).removeprefix("torch.")``.
"""

from __future__ import annotations

import torch

#: Dtype name -> torch dtype, for every dtype a weight update may carry.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}

_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the wire name of ``dtype`` (e.g. ``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: ``dtype`` is not one a weight update may carry.
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported for weight sync") from None


def parse_dtype(name: str) -> torch.dtype:
    """Return the torch dtype for the wire name ``name`` (``"torch."`` prefix accepted).

    Raises:
        ValueError: unknown name; the message lists the accepted ones.
    """
    key = name.removeprefix("torch.")
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; accepted: {', '.join(sorted(DTYPES))}") from None


def element_size(dtype: torch.dtype) -> int:
    """Size of one element of ``dtype``, in bytes (``torch.dtype.itemsize``)."""
    return dtype.itemsize


def wire_dtype(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in when an update's wire dtype is ``wire``: ``wire`` for a floating
    tensor (e.g. fp32 master weights sent as ``torch.bfloat16``), its own otherwise or when ``wire`` is ``None``."""
    return wire if wire is not None and dtype.is_floating_point else dtype


def can_convert(wire: torch.dtype, served: torch.dtype) -> bool:
    """Whether bytes of dtype ``wire`` may be applied to a parameter served as ``served``.

    Equal dtypes always may; floating dtypes convert into each other on apply
    (``Tensor.copy_`` semantics); anything else is refused.
    """
    return wire == served or (wire.is_floating_point and served.is_floating_point)
