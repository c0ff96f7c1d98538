"""The safetensors format, read through an open file: its header (bounded), and one tensor's bytes at a time.

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON (tensor name -> ``dtype``, ``shape``, ``data_offsets`` into the
data that follows; an optional ``__metadata__`` of strings), then the data.
The ``safetensors`` library opens files by path, so it cannot read a file
the engine opened beneath a root (:mod:`~wsync_grpc.transports.disk.confined`);
this module reads the same format through the descriptor with ``pread``,
with the library's checks (offsets in bounds, covering the data without
holes or overlaps, sizes matching shapes) and the engine's bounds
(:data:`MAX_HEADER_BYTES`, :data:`MAX_FILE_TENSORS`). Error messages name
what is wrong, never the file's bytes.

Units: sizes and offsets in bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.transports.disk.confined import OpenFile, shown

MAX_HEADER_BYTES = 64 << 20
"""Largest safetensors header read, in bytes (a 100k-tensor checkpoint's headers total about 15 MB)."""

MAX_FILE_TENSORS = 1 << 20
"""Most tensors one file's header may list."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""Safetensors dtype tag (its header's ``dtype``) -> torch dtype."""


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a safetensors header lists it.

    Attributes:
        name: its name.
        dtype: its dtype tag (``"BF16"``); one weight sync does not carry is kept for the validator to refuse.
        shape: its shape.
        begin, end: where its bytes lie in the file (absolute offsets, ``end`` excluded).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Its size, in bytes."""
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header.

    Attributes:
        entries: its tensors, sorted by name (as ``safetensors.safe_open(...).keys()``).
        nbytes: its size in the file, in bytes (the 8-byte length included).
    """

    entries: list[HeaderEntry]
    nbytes: int


def _bad(f: OpenFile, what: str) -> InvalidArgument:
    return InvalidArgument(
        "BAD_CHECKPOINT_FILE", f"{shown(f.name)} is not a valid safetensors file: {what}", path=shown(f.name)
    )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a name is listed twice")
    return out


def read_header(f: OpenFile, max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsHeader:
    """``f``'s header: every tensor it lists, checked, read through the open file.

    Raises:
        InvalidArgument: BAD_CHECKPOINT_FILE (not safetensors: a short file, a header that is not a JSON
            object of tensors, offsets out of bounds, overlapping or leaving holes, a size that does not
            match a shape); HEADER_TOO_LARGE (over ``max_header_bytes`` or :data:`MAX_FILE_TENSORS`).
        OSError: a read failed.
    """
    if f.size < 8:
        raise _bad(f, "shorter than its 8-byte header length")
    n = int.from_bytes(f.read_at(0, 8), "little")
    if 8 + n > f.size:
        raise _bad(f, "its header runs past the end of the file")
    if n > max_header_bytes:
        raise InvalidArgument(
            "HEADER_TOO_LARGE",
            f"{shown(f.name)}'s safetensors header has {n} bytes; at most {max_header_bytes} are read",
            path=shown(f.name),
        )
    raw = f.read_at(8, n)
    if not raw.startswith(b"{"):
        raise _bad(f, "its header is not a JSON object")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):
        raise _bad(f, "its header is not valid UTF-8 JSON with unique names") from None
    if not isinstance(header, dict):
        raise _bad(f, "its header is not a JSON object")
    header.pop("__metadata__", None)
    if len(header) > MAX_FILE_TENSORS:
        raise InvalidArgument(
            "HEADER_TOO_LARGE",
            f"{shown(f.name)} lists {len(header)} tensors; at most {MAX_FILE_TENSORS} are read",
            path=shown(f.name),
        )
    data_start, data_len = 8 + n, f.size - 8 - n
    entries = [_entry(f, name, spec, data_start) for name, spec in header.items()]
    end = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin - data_start != end:
            raise _bad(f, "its tensors' data overlap or leave a hole")
        end = e.end - data_start
    if end != data_len:
        raise _bad(f, "its tensors do not cover its data exactly")
    return SafetensorsHeader(sorted(entries, key=lambda e: e.name), 8 + n)


def _entry(f: OpenFile, name: str, spec: Any, data_start: int) -> HeaderEntry:
    """One header entry, checked (its offsets made absolute)."""
    if not isinstance(spec, Mapping):
        raise _bad(f, "a tensor's entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list):
        raise _bad(f, "a tensor's entry lacks its dtype, shape or data_offsets")
    if not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 64:
        raise _bad(f, "a tensor's shape is not a list of non-negative integers")
    if len(offsets) != 2 or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]:
        raise _bad(f, "a tensor's data_offsets are not two increasing offsets")
    known = SAFETENSORS_DTYPES.get(dtype)
    if known is not None and math.prod(shape) * known.itemsize != offsets[1] - offsets[0]:
        raise _bad(f, "a tensor's data size does not match its shape and dtype")
    return HeaderEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_tensor(f: OpenFile, e: HeaderEntry) -> torch.Tensor:
    """Tensor ``e`` read from ``f`` into new CPU memory (a copy: the file may change afterwards).

    Raises:
        ValueError: a dtype weight sync does not carry.
        InvalidArgument: BAD_CHECKPOINT_FILE (the file got shorter).
        OSError: a read failed.
    """
    dtype = SAFETENSORS_DTYPES.get(e.dtype)
    if dtype is None:
        raise ValueError(f"checkpoint dtype {e.dtype[:20]} is not supported")
    out = torch.empty(e.nbytes, dtype=torch.uint8)
    if e.nbytes:
        f.read_into(memoryview(out.numpy()).cast("B"), e.begin)  # type: ignore[arg-type]
    return out.view(dtype).reshape(e.shape)
