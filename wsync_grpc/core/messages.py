"""What an engine's front process and its worker processes say to each other, as msgpack-native values.

Engines whose workers are other processes carry calls between them with
their own IPC: vLLM's ``collective_rpc`` encodes arguments and results with
msgpack, and anything else would need its pickle fallback
(``VLLM_ALLOW_INSECURE_SERIALIZATION``), which wsync never turns on. So receive
plans, buckets, progress, errors and tensors cross as plain dicts, lists,
strings, numbers and bytes, built and read here and nowhere else. Pure: no
engine import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from wsync_grpc.core.delta import DeltaCoding, Positions
from wsync_grpc.core.digests import Digest, DigestAlgorithm
from wsync_grpc.core.dtypes import dtype_name, parse_dtype
from wsync_grpc.core.engine import ReceiverProgress
from wsync_grpc.core.errors import (
    Aborted,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    GroupError,
    GroupTimeout,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    WsyncError,
)
from wsync_grpc.core.header import CudaIpcMemory, SharedMemoryHandle
from wsync_grpc.core.layout import ApplyMode, Bucket, Layout, Piece, TensorSlot, Transport
from wsync_grpc.core.update import Payload, ReceivePlan, SourceFile


def digest_to_msg(d: Digest | None) -> list[Any] | None:
    """A digest as ``[algorithm, value]`` (``None`` for none; inverse: :func:`digest_from_msg`)."""
    return None if d is None else [d.algorithm.value, d.value]


def digest_from_msg(m: Sequence[Any] | None) -> Digest | None:
    """The digest :func:`digest_to_msg` wrote.

    Raises:
        ValueError: not such a message.
    """
    return None if m is None else Digest(DigestAlgorithm(str(m[0])), bytes(m[1]))


def digests_to_msg(digests: Mapping[int, Digest]) -> list[list[Any]]:
    """Late-declared digests (bucket index -> digest) as ``[[index, algorithm, value], ...]``."""
    return [[i, d.algorithm.value, d.value] for i, d in digests.items()]


def digests_from_msg(m: Sequence[Sequence[Any]]) -> dict[int, Digest]:
    """The digests :func:`digests_to_msg` wrote.

    Raises:
        ValueError: not such a message.
    """
    return {int(i): Digest(DigestAlgorithm(str(a)), bytes(v)) for i, a, v in m}


def _delta_to_msg(d: DeltaCoding) -> dict[str, Any]:
    """A slot's delta coding, as the one dict that may end its list (a piece is two lists there)."""
    return {"delta": [d.positions.value, d.changed, d.positions_bytes]}


def _delta_from_msg(extra: Sequence[Any]) -> DeltaCoding | None:
    """The delta coding at the end of a slot's list, if any."""
    if len(extra) == 1 and isinstance(extra[0], Mapping):
        positions, changed, positions_bytes = extra[0]["delta"]
        return DeltaCoding(Positions(str(positions)), int(changed), int(positions_bytes))
    return None


def _piece_from_msg(extra: Sequence[Any]) -> Piece | None:
    """The piece at the end of a slot's list (its global shape and offsets), if any."""
    if len(extra) == 2:
        return Piece(tuple(int(d) for d in extra[0]), tuple(int(o) for o in extra[1]))
    return None


def bucket_to_msg(b: Bucket) -> dict[str, Any]:
    """One bucket as a msgpack-native dict (inverse: :func:`bucket_from_msg`)."""
    return {
        "index": b.index,
        "size_bytes": b.size_bytes,
        "src": b.src,
        "digest": digest_to_msg(b.digest),
        "tensors": [
            [t.name, dtype_name(t.dtype), list(t.shape), t.offset, t.nbytes, t.canonical, t.load]
            + ([] if t.piece is None else [list(t.piece.global_shape), list(t.piece.offsets)])
            + ([] if t.delta is None else [_delta_to_msg(t.delta)])
            for t in b.tensors
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
            piece=_piece_from_msg(extra),
            delta=_delta_from_msg(extra),
        )
        for name, dtype, shape, offset, nbytes, canonical, load, *extra in m["tensors"]
    )
    return Bucket(
        index=int(m["index"]),
        size_bytes=int(m["size_bytes"]),
        tensors=slots,
        src=int(m.get("src", 0)),
        digest=digest_from_msg(m.get("digest")),
    )


def buckets_to_msg(buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
    """Buckets as a list of :func:`bucket_to_msg` dicts."""
    return [bucket_to_msg(b) for b in buckets]


def plan_to_msg(p: ReceivePlan) -> dict[str, Any]:
    """A receive plan as a msgpack-native dict (inverse: :func:`plan_from_msg`); enums by their values."""
    return {
        "transport": p.transport.value,
        "payload": p.payload.value,
        "layout": p.layout.value,
        "apply_mode": p.apply_mode.value,
        "buckets": buckets_to_msg(p.buckets),
        "closed": p.closed,
        # Where each file lies and which file it was; never the open file itself (this process's own).
        "files": {name: [f.root, f.path, f.device, f.inode] for name, f in p.files.items()},
        "timeout_s": p.timeout_s,
        "digests_follow": p.digests_follow,
        "update_id": p.update_id,
        "shared_memory": dataclasses.asdict(p.shared_memory) if p.shared_memory is not None else None,
        "keep_base": p.keep_base,
        "shared_memory_ranks": [dataclasses.asdict(h) for h in p.shared_memory_ranks],
    }


def plan_from_msg(m: Mapping[str, Any]) -> ReceivePlan:
    """The receive plan :func:`plan_to_msg` wrote.

    Raises:
        KeyError, ValueError: not such a message.
    """
    return ReceivePlan(
        transport=Transport(m["transport"]),
        payload=Payload(m["payload"]),
        layout=Layout(m["layout"]),
        apply_mode=ApplyMode(m["apply_mode"]),
        buckets=tuple(bucket_from_msg(b) for b in m["buckets"]),
        closed=bool(m["closed"]),
        update_id=str(m["update_id"]),
        shared_memory=handle_from_msg(m["shared_memory"]) if m["shared_memory"] is not None else None,
        files={
            str(name): SourceFile(str(root), str(path), int(device), int(inode))
            for name, (root, path, device, inode) in m["files"].items()
        },
        timeout_s=float(m["timeout_s"]),
        digests_follow=bool(m.get("digests_follow", False)),
        keep_base=bool(m.get("keep_base", False)),
        shared_memory_ranks=tuple(handle_from_msg(h) for h in m.get("shared_memory_ranks", ())),
    )


def handle_from_msg(m: Mapping[str, Any]) -> SharedMemoryHandle:
    """A ring's handle as :func:`plan_to_msg` wrote it (``dataclasses.asdict``: its ``cuda_ipc`` a dict or ``None``).

    Raises:
        KeyError, TypeError: not such a message.
    """
    fields = dict(m)
    cuda_ipc = fields.pop("cuda_ipc", None)
    return SharedMemoryHandle(**fields, cuda_ipc=CudaIpcMemory(**cuda_ipc) if cuda_ipc is not None else None)


def buckets_from_msg(ms: Sequence[Mapping[str, Any]]) -> list[Bucket]:
    """The buckets :func:`buckets_to_msg` wrote."""
    return [bucket_from_msg(m) for m in ms]


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

_WSYNC_ERRORS: dict[str, type[WsyncError]] = {
    cls.__name__: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        Aborted,
        DeadlineExceeded,
        Unavailable,
        PermissionDenied,
        NotFound,
        DataLoss,
        Internal,
    )
}
"""Categories a worker's error keeps across the process boundary, with its reason (e.g. CHECKPOINT_CHANGED,
BUCKET_DIGEST_MISMATCH) and its metadata (e.g. the bucket named)."""


def error_to_msg(e: BaseException | None) -> list[Any] | None:
    """An exception as ``[kind, message]`` (``None`` for none), ``[kind, message, reason, metadata]`` for a
    categorized one.

    The kind keeps a group failure a group failure, and a categorized error
    (:class:`~wsync_grpc.core.errors.WsyncError`) its category, reason and metadata.
    """
    if e is None:
        return None
    if isinstance(e, WsyncError) and type(e).__name__ in _WSYNC_ERRORS:
        return [type(e).__name__, e.message, e.reason, dict(e.metadata)]
    kind = type(e).__name__ if type(e).__name__ in _ERRORS else "Error"
    return [kind, str(e)]


def error_from_msg(m: Sequence[Any] | None) -> BaseException | None:
    """The exception :func:`error_to_msg` described: GroupError, GroupTimeout, Cancelled, a categorized
    error with its reason and metadata, or RuntimeError."""
    if m is None:
        return None
    kind, message = str(m[0]), str(m[1])
    if len(m) > 2 and kind in _WSYNC_ERRORS:
        metadata = {str(k): str(v) for k, v in dict(m[3]).items()} if len(m) > 3 else {}
        return _WSYNC_ERRORS[kind](str(m[2]), message, **metadata)
    cls = _ERRORS.get(kind, RuntimeError)
    return Cancelled() if cls is Cancelled else cls(message)


def progress_to_msg(p: ReceiverProgress) -> dict[str, Any]:
    """A worker's progress as a msgpack-native dict (inverse: :func:`progress_from_msg`)."""
    return {
        "rank": p.rank,
        "armed": p.armed,
        "done": p.done,
        "buckets_done": p.buckets_done,
        "bytes_done": p.bytes_done,
        "last_arrival_at": p.last_arrival_at,
        "error": error_to_msg(p.error),
        "buckets_verified": p.buckets_verified,
    }


def progress_from_msg(m: Mapping[str, Any]) -> ReceiverProgress:
    """The progress :func:`progress_to_msg` wrote."""
    last = m.get("last_arrival_at")
    return ReceiverProgress(
        rank=int(m["rank"]),
        armed=bool(m["armed"]),
        done=bool(m["done"]),
        buckets_done=int(m["buckets_done"]),
        bytes_done=int(m["bytes_done"]),
        last_arrival_at=None if last is None else float(last),
        error=error_from_msg(m.get("error")),
        buckets_verified=int(m.get("buckets_verified", 0)),
    )
