"""Packing a bucket into one flat buffer and viewing a received one as its tensors (pure torch, no I/O).

The sender side of :mod:`wsync_grpc.core.layout`'s model: :func:`pack_bucket`
fills a flat ``uint8`` buffer, :func:`bucket_bytes_view` sends a lone tensor as
it lies in memory, :func:`wire_tensor` gives the tensor the individual layout
broadcasts. The receiver side: :func:`tensor_views` views a received flat
buffer as its tensors (no copy). Packing then viewing gives back the tensors
bit for bit, in the wire dtype (vLLM's ``packed_tensor.py`` keeps the same
pair together). Sizes are in bytes throughout.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor

import torch

from wsync_grpc.core.layout import Bucket, TensorSlot

NamedTensors = list[tuple[str, torch.Tensor]]
"""``(name, tensor)`` pairs, in order."""


def _typed_slice(flat: torch.Tensor, t: TensorSlot) -> torch.Tensor:
    """View bytes ``t.offset .. t.end`` of ``flat`` as ``t`` (no copy)."""
    return flat[t.offset : t.end].view(t.dtype).view(t.shape)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _memmove_source(src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes can be copied with one plain ``memmove`` (see :func:`pack_bucket`).

    True for plain, strided, contiguous CPU tensors (no subclass, no lazy
    conjugate or negative bit, not quantized): their ``numel * element_size``
    bytes at ``data_ptr()`` are the tensor.
    """
    return (
        src.is_cpu
        and src.layout == torch.strided
        and type(src) in _PLAIN_TENSORS
        and not src.is_quantized
        and not src.is_conj()
        and not src.is_neg()
        and src.is_contiguous()
    )


SPLIT_BYTES = 4 << 20
"""The smallest copy :func:`pack_bucket` shares with its ``helper``, in bytes."""


def _memmove(dst: int, src: int, nbytes: int, helper: Executor | None) -> None:
    """``memmove`` of ``nbytes`` bytes from address ``src`` to ``dst``, its second half on ``helper`` when it is
    given and the copy is at least :data:`SPLIT_BYTES`."""
    if helper is None or nbytes < SPLIT_BYTES:
        ctypes.memmove(dst, src, nbytes)
        return
    half = nbytes // 2
    second = helper.submit(ctypes.memmove, dst + half, src + half, nbytes - half)
    try:
        ctypes.memmove(dst, src, half)
    finally:
        second.result()


def pack_bucket(
    bucket: Bucket,
    tensors_by_name: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    *,
    zero_padding: bool = False,
    helper: Executor | None = None,
) -> torch.Tensor:
    """Copy each of ``bucket``'s tensors into its byte range of ``out``; return ``out``.

    Each tensor is written through a view of its byte range in the wire
    dtype (``Tensor.copy_``), which converts the dtype, makes a
    non-contiguous source contiguous and crosses devices in one pass, with
    no temporary. With equal dtypes the bytes are copied bit for bit; into a
    CPU buffer, a contiguous CPU tensor already in the wire dtype is copied
    with one single-threaded ``memmove`` instead (see the comment in the body).

    Padding bytes between tensors are left as they are unless
    ``zero_padding`` is true: receivers never read them, and not touching
    them saves a pass over a reused buffer. Zero them when the buffer's
    bytes are compared or hashed as a whole.

    Args:
        bucket: the planned bucket.
        tensors_by_name: the tensors, by the names planned (extra names are
            ignored); each must have the planned shape (a delta entry's: its encoded bytes,
            1-D ``uint8``, :attr:`~wsync_grpc.core.delta.EncodedTensor.payload`).
        out: a 1-D ``torch.uint8`` tensor of exactly ``bucket.size_bytes``
            elements, contiguous, on the device the broadcast runs on.
        zero_padding: also zero the padding bytes.
        helper: where to copy the second half of each ``memmove`` of at least :data:`SPLIT_BYTES` (a thread of
            the caller's; ``ctypes`` releases the GIL), while this thread copies the first: for a caller with a
            core to spare, such as the shared-memory ring, whose engines copy out of another slot meanwhile.
            ``None``: every copy on this thread (a broadcast's collective needs the other cores).

    Returns:
        ``out``.

    Raises:
        ValueError: ``out`` has the wrong dtype, size or layout, or a tensor's
            shape differs from the plan.
        KeyError: a planned tensor is missing from ``tensors_by_name``.
    """
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor, got {out.dtype} {tuple(out.shape)}")
    if out.numel() != bucket.size_bytes:
        raise ValueError(f"out holds {out.numel()} bytes but bucket {bucket.index} needs {bucket.size_bytes}")
    # On CPU, bytes already in the wire dtype are copied with one single-threaded memmove
    # (and padding zeroed with memset) instead of Tensor.copy_, which runs through torch's
    # intra-op thread pool: its threads spin between the many small parallel regions of a
    # bucket and take the cores the collective's own threads need. On a 2-core host with a
    # gloo broadcast in flight, packing measured about 2x slower with copy_. ctypes releases
    # the GIL for the copy.
    base = out.data_ptr() if out.is_cpu else 0
    prev_end = 0
    with torch.no_grad():
        for t in bucket.tensors:
            src = tensors_by_name[t.name]
            if t.delta is not None:  # a delta entry: its bytes as encoded (wsync_grpc.core.delta)
                if src.dtype != torch.uint8 or src.numel() != t.nbytes:
                    raise ValueError(f"the delta entry of {t.name!r} must be {t.nbytes} bytes of uint8")
                if zero_padding and t.offset > prev_end:
                    out[prev_end : t.offset].zero_()
                out[t.offset : t.end].copy_(src.reshape(-1))
                prev_end = max(prev_end, t.end)  # an empty entry may sit before the end
                continue
            if src.shape != t.shape:
                raise ValueError(f"tensor {t.name!r} has shape {tuple(src.shape)}, planned {t.shape}")
            if zero_padding and t.offset > prev_end:
                if base:
                    ctypes.memset(base + prev_end, 0, t.offset - prev_end)
                else:
                    out[prev_end : t.offset].zero_()
            if t.nbytes:
                src = src.detach()
                if base and src.dtype == t.dtype and _memmove_source(src):
                    _memmove(base + t.offset, src.data_ptr(), t.nbytes, helper)
                else:
                    _typed_slice(out, t).copy_(src)
            prev_end = max(prev_end, t.end)  # an empty entry may sit before the end
    return out


def bucket_bytes_view(
    bucket: Bucket, tensors_by_name: Mapping[str, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The flat buffer of a single-tensor bucket as a view of the tensor itself, or None.

    A bucket holding one tensor at offset 0, with no padding, is that
    tensor's bytes: when the tensor is already contiguous, in its wire dtype
    and on ``device``, it can be broadcast as it is, with no packing. Large
    tensors often sit alone in their bucket (the embedding and the LM head of
    an LLM, anything larger than the bucket), and with the client's ramp the
    first bucket is usually the embedding: this saves their copy and starts
    the first broadcast at once.

    Returns:
        A 1-D ``uint8`` view of the tensor's ``bucket.size_bytes`` bytes, or
        None when the bucket must be packed.

    Raises:
        KeyError: the bucket's tensor is missing from ``tensors_by_name``.
    """
    t = bucket.lone
    if t is None:
        return None
    src = tensors_by_name[t.name].detach()
    if (
        src.device != device
        or src.dtype != t.dtype
        or src.shape != t.shape
        or src.layout != torch.strided
        or type(src) not in _PLAIN_TENSORS
        or src.is_quantized
        or src.is_conj()
        or src.is_neg()
        or not src.is_contiguous()
    ):
        return None
    return src.reshape(-1).view(torch.uint8)


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def tensor_views(flat: torch.Tensor, tensors: Iterable[TensorSlot]) -> NamedTensors:
    """View a flat bucket buffer as its tensors to load: ``(canonical name, tensor)``, no copy.

    ``flat`` is a 1-D ``uint8`` tensor holding the bucket (a view of a larger
    buffer is fine); each tensor comes out in its wire dtype and shape, as
    :func:`pack_bucket` wrote it. Tied aliases already in the update (``load``
    false) are left out. One ``as_strided`` per tensor over a typed view of
    the buffer: a bucket of a large MoE holds thousands of small tensors, and
    slicing then viewing each one costs several times more.
    """
    typed: dict[torch.dtype, torch.Tensor] = {}
    base = flat.storage_offset()  # bytes: flat is uint8
    out: NamedTensors = []
    for t in tensors:
        if not t.load:
            continue
        esize = t.dtype.itemsize
        view = typed.get(t.dtype)
        if view is None:
            if base % esize:  # not aligned for a typed view of the storage: slice it the slow way
                out.append((t.canonical, flat[t.offset : t.end].view(t.dtype).view(t.shape)))
                continue
            view = typed[t.dtype] = flat[: flat.numel() - flat.numel() % esize].view(t.dtype)
        # Offsets are multiples of the element size (validated at Prepare).
        out.append((t.canonical, view.as_strided(t.shape, _contiguous_strides(t.shape), (base + t.offset) // esize)))
    return out


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """View a flat bucket buffer as its tensors (no copy): name -> tensor of the wire dtype and shape.

    The inverse of :func:`pack_bucket`: :func:`tensor_views` (what an engine
    does with a received buffer) after checking ``flat`` holds the bucket.

    Raises:
        ValueError: ``flat`` is not a 1-D uint8 tensor of ``bucket.size_bytes`` elements.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != bucket.size_bytes:
        raise ValueError(
            f"flat must be a 1-D uint8 tensor of {bucket.size_bytes} bytes, got {flat.dtype} {tuple(flat.shape)}"
        )
    return dict(tensor_views(flat, bucket.tensors))


def wire_tensor(planned: TensorSlot, tensor: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """The tensor the individual layout broadcasts for ``planned``: contiguous, in the wire dtype.

    Returns ``tensor`` itself (detached, no copy) when it already is
    contiguous, of the wire dtype and on ``device``; a converted copy
    otherwise.

    Args:
        planned: the planned tensor.
        tensor: the trainer's tensor.
        device: where the broadcast runs; ``None`` keeps ``tensor``'s device.

    Raises:
        ValueError: ``tensor``'s shape differs from the plan.
    """
    if tuple(tensor.shape) != planned.shape:
        raise ValueError(f"tensor {planned.name!r} has shape {tuple(tensor.shape)}, planned {planned.shape}")
    target = torch.device(device) if device is not None else tensor.device
    return tensor.detach().to(device=target, dtype=planned.dtype).contiguous()
