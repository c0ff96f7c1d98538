"""What the engine's front process and its vLLM workers say to each other, as msgpack-native values.

vLLM carries a ``collective_rpc``'s arguments and results between its
processes with msgpack; anything else would need its pickle fallback
(``VLLM_ALLOW_INSECURE_SERIALIZATION``), which wsync never turns on. So
buckets, progress and errors cross as plain dicts, lists, strings and
numbers, built and read here and nowhere else. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wsync_grpc.core.dtypes import dtype_name, parse_dtype
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


@dataclass(frozen=True)
class WorkerProgress:
    """Where one vLLM worker's receive of the update in flight stands.

    Attributes:
        rank: the worker's rank in the weight-sync group.
        armed: its first receive is posted (or nothing is declared yet).
        done: its receiver ended (every bucket arrived, or it failed).
        buckets_done: buckets received.
        bytes_done: bytes received.
        last_arrival_at: when the last bucket arrived, on the host's monotonic clock (seconds); ``None`` before.
        error: why its receiver failed, ``None`` while it has not.
    """

    rank: int
    armed: bool
    done: bool
    buckets_done: int
    bytes_done: int
    last_arrival_at: float | None
    error: BaseException | None

    def to_msg(self) -> dict[str, Any]:
        """As a msgpack-native dict (inverse: :meth:`from_msg`)."""
        return {
            "rank": self.rank,
            "armed": self.armed,
            "done": self.done,
            "buckets_done": self.buckets_done,
            "bytes_done": self.bytes_done,
            "last_arrival_at": self.last_arrival_at,
            "error": error_to_msg(self.error),
        }

    @classmethod
    def from_msg(cls, m: Mapping[str, Any]) -> WorkerProgress:
        """The progress :meth:`to_msg` wrote."""
        last = m.get("last_arrival_at")
        return cls(
            rank=int(m["rank"]),
            armed=bool(m["armed"]),
            done=bool(m["done"]),
            buckets_done=int(m["buckets_done"]),
            bytes_done=int(m["bytes_done"]),
            last_arrival_at=None if last is None else float(last),
            error=error_from_msg(m.get("error")),
        )
