"""What the engine's front process and its vLLM workers say to each other, as msgpack-native values.

vLLM carries a ``collective_rpc``'s arguments and results between its
processes with msgpack; anything else would need its pickle fallback
(``VLLM_ALLOW_INSECURE_SERIALIZATION``), which wsync never turns on. So
buckets, progress and errors cross as plain dicts, lists, strings and
numbers, built and read here and nowhere else. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from wsync_grpc.core.dtypes import dtype_name, parse_dtype
from wsync_grpc.core.engine import WorkerProgress
from wsync_grpc.core.errors import Cancelled, GroupError, GroupTimeout
from wsync_grpc.core.layout import Bucket, TensorSlot


def bucket_to_msg(b: Bucket) -> dict[str, Any]:
    """One bucket as a msgpack-native dict (inverse: :func:`bucket_from_msg`)."""
    return {
        "index": b.index,
        "size_bytes": b.size_bytes,
        "tensors": [
            [t.name, dtype_name(t.dtype), list(t.shape), t.offset, t.nbytes, t.canonical, t.load] for t in b.tensors
        ],
    }


def bucket_from_msg(m: Mapping[str, Any]) -> Bucket:
    """The bucket :func:`bucket_to_msg` wrote.

    Raises:
        KeyError, ValueError: not such a message.
    """
    slots = tuple(
        TensorSlot(
            name=str(name),
            dtype=parse_dtype(str(dtype)),
            shape=tuple(int(d) for d in shape),
            offset=int(offset),
            nbytes=int(nbytes),
            canonical=str(canonical),
            load=bool(load),
        )
        for name, dtype, shape, offset, nbytes, canonical, load in m["tensors"]
    )
    return Bucket(index=int(m["index"]), size_bytes=int(m["size_bytes"]), tensors=slots)


def buckets_to_msg(buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
    """Buckets as a list of :func:`bucket_to_msg` dicts."""
    return [bucket_to_msg(b) for b in buckets]


def tensor_to_msg(name: str, t: torch.Tensor) -> dict[str, Any]:
    """A tensor (any device) as ``{"name", "dtype", "shape", "data"}``, ``data`` its bytes in C order."""
    data = t.detach().to("cpu").contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"name": name, "dtype": dtype_name(data.dtype), "shape": list(data.shape), "data": raw}


def tensor_from_msg(m: Mapping[str, Any]) -> torch.Tensor:
    """The CPU tensor of a :func:`tensor_to_msg` dict (or of a ``wsync_served`` entry with ``data``).

    Raises:
        KeyError, ValueError: not such a message (a wrong dtype name, bytes that do not fill the shape).
    """
    data = bytearray(m["data"])
    dtype, shape = parse_dtype(str(m["dtype"])), [int(d) for d in m["shape"]]
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


_ERRORS: dict[str, type[BaseException]] = {
    "GroupError": GroupError,
    "GroupTimeout": GroupTimeout,
    "Cancelled": Cancelled,
}


def error_to_msg(e: BaseException | None) -> list[str] | None:
    """An exception as ``[kind, message]`` (``None`` for none): the kind keeps a group failure a group failure."""
    if e is None:
        return None
    kind = type(e).__name__ if type(e).__name__ in _ERRORS else "Error"
    return [kind, str(e)]


def error_from_msg(m: Sequence[str] | None) -> BaseException | None:
    """The exception :func:`error_to_msg` described: GroupError, GroupTimeout, Cancelled, or RuntimeError."""
    if m is None:
        return None
    kind, message = str(m[0]), str(m[1])
    cls = _ERRORS.get(kind, RuntimeError)
    return Cancelled() if cls is Cancelled else cls(message)


def progress_to_msg(p: WorkerProgress) -> dict[str, Any]:
    """A worker's progress as a msgpack-native dict (inverse: :func:`progress_from_msg`)."""
    return {
        "rank": p.rank,
        "armed": p.armed,
        "done": p.done,
        "buckets_done": p.buckets_done,
        "bytes_done": p.bytes_done,
        "last_arrival_at": p.last_arrival_at,
        "error": error_to_msg(p.error),
    }


def progress_from_msg(m: Mapping[str, Any]) -> WorkerProgress:
    """The progress :func:`progress_to_msg` wrote."""
    last = m.get("last_arrival_at")
    return WorkerProgress(
        rank=int(m["rank"]),
        armed=bool(m["armed"]),
        done=bool(m["done"]),
        buckets_done=int(m["buckets_done"]),
        bytes_done=int(m["bytes_done"]),
        last_arrival_at=None if last is None else float(last),
        error=error_from_msg(m.get("error")),
    )
