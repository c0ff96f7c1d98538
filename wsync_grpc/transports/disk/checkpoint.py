"""Safetensors checkpoints on the engine's disk: where it may read them, and what they hold (headers only).

A disk update (``TRANSPORT_DISK``, SGLang's ``update_weights_from_disk``,
vLLM's ``reload_weights``) names a checkpoint by path. The engine's operator
allows a few directories (``wsync serve --checkpoint-root DIR``, repeatable);
:class:`CheckpointRoots` resolves a caller's path against them and refuses
anything that lands outside (``..``, a symlink out, an absolute path
elsewhere) with PERMISSION_DENIED. :func:`read_checkpoint` then reads only the
files' headers (names, dtypes, shapes), never a tensor's data, so that the
update is validated like broadcast metadata before a byte is loaded; the
tensors are read later by :class:`~wsync_grpc.transports.disk.receiver.DiskReceiver`.
Only safetensors: a pickle checkpoint (``.bin``, ``.pt``...) is refused, never
opened, since loading one runs whatever code it carries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.errors import InvalidArgument, NotFound, PermissionDenied
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.lora import LoraSpec, lora_spec_from_config
from wsync_grpc.core.update import PlannedUpdate
from wsync_grpc.core.validation import UpdateValidator

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded Hugging Face checkpoint (``weight_map``: tensor name -> file)."""

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""File suffixes of pickle checkpoints (``torch.save``): refused, never opened."""

DISK_BUCKET_BYTES = 64 << 20
"""A disk update's buckets: consecutive tensors of one file, up to this many bytes each (one tensor may exceed it)."""

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


def torch_dtype(tag: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype tag (e.g. ``"BF16"``).

    Raises:
        ValueError: a tag weight sync does not carry.
    """
    try:
        return SAFETENSORS_DTYPES[tag]
    except KeyError:
        raise ValueError(f"checkpoint dtype {tag} is not supported") from None


class CheckpointRoots:
    """The directories an engine may read checkpoints from (its operator's ``--checkpoint-root``).

    Args:
        roots: directories; each is resolved (symlinks followed) once, here.

    Raises:
        ValueError: a root that is not an existing directory.
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        self.roots: list[Path] = []
        for r in roots:
            real = Path(os.path.realpath(r))
            if not real.is_dir():
                raise ValueError(f"checkpoint root {str(r)!r} is not a directory")
            self.roots.append(real)

    def __bool__(self) -> bool:
        return bool(self.roots)

    def contains(self, real: Path) -> bool:
        """Whether the resolved path ``real`` lies inside some root."""
        return any(real == r or real.is_relative_to(r) for r in self.roots)

    def resolve(self, path: str) -> Path:
        """The real path of ``path`` (relative paths under the first root), if it lies inside a root.

        Raises:
            PermissionDenied: NO_CHECKPOINT_ROOT (the engine allows none),
                PATH_OUTSIDE_ROOTS (a ``..`` component, or the resolved path
                outside every root: an absolute path elsewhere, a symlink out).
            InvalidArgument: BAD_CHECKPOINT_PATH (empty, or a NUL byte).
            NotFound: CHECKPOINT_NOT_FOUND.
        """
        if not self.roots:
            raise PermissionDenied(
                "NO_CHECKPOINT_ROOT",
                "this engine reads no checkpoint from disk: start it with --checkpoint-root DIR",
            )
        if not path or "\x00" in path:
            raise InvalidArgument("BAD_CHECKPOINT_PATH", "checkpoint_path is empty or holds a NUL byte")
        shown = path[:200]
        p = Path(path)
        if ".." in p.parts:
            raise PermissionDenied("PATH_OUTSIDE_ROOTS", f"checkpoint path {shown!r} has a '..' component", path=shown)
        real = Path(os.path.realpath(p if p.is_absolute() else self.roots[0] / p))
        if not self.contains(real):
            raise PermissionDenied(
                "PATH_OUTSIDE_ROOTS",
                f"checkpoint path {shown!r} resolves outside the engine's checkpoint roots "
                f"({', '.join(str(r) for r in self.roots)})",
                path=shown,
            )
        if not real.exists():
            raise NotFound("CHECKPOINT_NOT_FOUND", f"no checkpoint at {shown!r}", path=shown)
        return real


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a checkpoint, as its file's header describes it.

    Attributes:
        name: its name in the checkpoint (Hugging Face naming).
        dtype: its dtype name as weight sync spells it (``"bfloat16"``), or the raw tag when unsupported.
        shape: its shape.
        nbytes: its size, in bytes (from the header's data offsets).
        file: the file holding it (resolved).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path


def checkpoint_files(path: Path, roots: CheckpointRoots | None = None) -> list[Path]:
    """The safetensors files of a checkpoint: ``path`` itself, or a directory's (through its index when it has one).

    Args:
        path: a resolved file or directory.
        roots: when given, every file (an index may name any) must resolve inside them.

    Raises:
        InvalidArgument: PICKLE_CHECKPOINT (a pickle file, or a directory with
            pickle files and no safetensors), NOT_SAFETENSORS, BAD_INDEX.
        NotFound: CHECKPOINT_NOT_FOUND (no safetensors file; a file the index names is missing).
        PermissionDenied: PATH_OUTSIDE_ROOTS (a file resolving outside ``roots``).
    """
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument("BAD_INDEX", f"{INDEX_FILE} in {path} is not a safetensors index: {e}") from None
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = [f.name for f in sorted(path.iterdir()) if f.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise _pickle_refused(pickles[0])
            raise NotFound("CHECKPOINT_NOT_FOUND", f"no safetensors file in {path}", path=str(path)[:200])
    out: list[Path] = []
    for f in files:
        if f.suffix in PICKLE_SUFFIXES:
            raise _pickle_refused(f.name)
        if f.suffix != ".safetensors":
            raise InvalidArgument("NOT_SAFETENSORS", f"{f.name} is not a .safetensors file", path=f.name[:200])
        real = Path(os.path.realpath(f))
        if roots is not None and not roots.contains(real):
            raise PermissionDenied("PATH_OUTSIDE_ROOTS", f"{f.name} resolves outside the checkpoint roots")
        if not real.is_file():
            raise NotFound("CHECKPOINT_NOT_FOUND", f"checkpoint file {f.name} is missing", path=f.name[:200])
        out.append(real)
    return out


def _pickle_refused(name: str) -> InvalidArgument:
    return InvalidArgument(
        "PICKLE_CHECKPOINT",
        f"{name[:200]} is a pickle checkpoint: only safetensors are read (a pickle file can run code when loaded)",
        path=name[:200],
    )


def read_checkpoint(files: Sequence[Path]) -> list[CheckpointTensor]:
    """Every tensor of ``files``, in file order then header order, from the headers alone.

    Raises:
        InvalidArgument: BAD_CHECKPOINT_FILE (not a valid safetensors file, or unreadable).
    """
    out: list[CheckpointTensor] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    sl = st.get_slice(name)
                    tag = sl.get_dtype()
                    shape = tuple(int(d) for d in sl.get_shape())
                    dtype = SAFETENSORS_DTYPES.get(tag)  # None: the validator refuses the raw tag
                    nbytes = math.prod(shape) * dtype.itemsize if dtype is not None else 0
                    out.append(CheckpointTensor(name, dtype_name(dtype) if dtype else tag, shape, nbytes, f))
        except (SafetensorError, OSError) as e:
            raise InvalidArgument(
                "BAD_CHECKPOINT_FILE", f"{f.name} is not a readable safetensors file: {e}", path=f.name[:200]
            ) from None
    return out


@dataclass(frozen=True)
class _Whole:
    """A checkpoint tensor is read whole (:class:`~wsync_grpc.core.validation.ShardFields` of no piece)."""

    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()


@dataclass(frozen=True)
class _TensorSpec:
    """A checkpoint tensor as bucket metadata (:class:`~wsync_grpc.core.validation.TensorSpecFields`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int = 0
    shard: _Whole = _Whole()


@dataclass(frozen=True)
class _BucketSpec:
    """A disk bucket as bucket metadata (:class:`~wsync_grpc.core.validation.BucketSpecFields`)."""

    index: int
    size_bytes: int
    tensors: tuple[_TensorSpec, ...]
    src_rank: int = 0


def bucket_specs(tensors: Sequence[CheckpointTensor], bucket_bytes: int = DISK_BUCKET_BYTES) -> list[_BucketSpec]:
    """A disk update's buckets (individual layout): consecutive tensors of one file, up to ``bucket_bytes`` each.

    Validated like a broadcast's (:meth:`~wsync_grpc.core.validation.UpdateValidator.disk_buckets`).
    """
    groups: list[list[CheckpointTensor]] = []
    size = 0
    for t in tensors:
        if not groups or groups[-1][0].file != t.file or size + t.nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return [
        _BucketSpec(i, sum(t.nbytes for t in g), tuple(_TensorSpec(t.name, t.dtype, t.shape) for t in g))
        for i, g in enumerate(groups)
    ]


def files_of(buckets: Sequence[Bucket], tensors: Sequence[CheckpointTensor]) -> dict[str, Path]:
    """Tensor name -> the file holding it, for the tensors of ``buckets``."""
    where = {t.name: t.file for t in tensors}
    return {s.name: where[s.name] for b in buckets for s in b.tensors}


ADAPTER_CONFIG = "adapter_config.json"
"""A PEFT adapter directory's configuration (JSON)."""

ADAPTER_FILE = "adapter_model.safetensors"
"""A PEFT adapter directory's tensors."""


def adapter_checkpoint(path: Path, name: str, roots: CheckpointRoots | None = None) -> tuple[LoraSpec, list[Path]]:
    """The spec and file of the PEFT adapter directory ``path`` (``save_pretrained``'s output), named ``name``.

    Raises:
        InvalidArgument: NOT_A_PEFT_DIRECTORY, BAD_ADAPTER_CONFIG (not JSON), PICKLE_CHECKPOINT
            (``adapter_model.bin`` only), and the reasons of :func:`~wsync_grpc.core.lora.lora_spec_from_config`.
        NotFound: CHECKPOINT_NOT_FOUND (no ``adapter_model.safetensors``).
    """
    config = path / ADAPTER_CONFIG
    if not path.is_dir() or not config.is_file():
        raise InvalidArgument(
            "NOT_A_PEFT_DIRECTORY", f"{path.name} is not a PEFT adapter directory (no {ADAPTER_CONFIG})"
        )
    try:
        parsed = json.loads(config.read_text())
    except (ValueError, OSError) as e:
        raise InvalidArgument("BAD_ADAPTER_CONFIG", f"{ADAPTER_CONFIG} is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument("BAD_ADAPTER_CONFIG", f"{ADAPTER_CONFIG} is not a JSON object")
    spec = lora_spec_from_config(name, parsed)
    if not (path / ADAPTER_FILE).exists() and (path / "adapter_model.bin").exists():
        raise _pickle_refused("adapter_model.bin")
    if not (path / ADAPTER_FILE).exists():
        raise NotFound("CHECKPOINT_NOT_FOUND", f"no {ADAPTER_FILE} in {path.name}", path=path.name[:200])
    return spec, checkpoint_files(path / ADAPTER_FILE, roots)


def plan_disk_update(roots: CheckpointRoots, header: UpdateHeader, validator: UpdateValidator) -> PlannedUpdate:
    """A disk update's buckets, validated, and where each tensor is: everything Prepare does before loading.

    Resolves ``header.checkpoint_path`` inside ``roots``, lists its files (an
    adapter's: its PEFT directory's, its spec from ``adapter_config.json``),
    reads their headers and validates every tensor with ``validator`` (which
    then holds the update's declarations, as after a broadcast's Prepare stream).

    Raises:
        PermissionDenied, NotFound, InvalidArgument: see :meth:`CheckpointRoots.resolve`,
            :func:`checkpoint_files`, :func:`adapter_checkpoint`, :func:`read_checkpoint` and
            :meth:`~wsync_grpc.core.validation.UpdateValidator.disk_buckets`.
        Unimplemented: an adapter on an engine that serves none.
    """
    path = roots.resolve(header.checkpoint_path)
    if header.adapter is not None:
        spec, files = adapter_checkpoint(path, header.adapter.name, roots)
        validator.use_specs(validator.adapter_specs(spec), {})
        header = dataclasses.replace(header, adapter=spec)
    else:
        files = checkpoint_files(path, roots)
    tensors = read_checkpoint(files)
    buckets = validator.source_buckets(bucket_specs(tensors))
    return PlannedUpdate(header, buckets, files_of(buckets, tensors))
