"""Safetensors checkpoints on the engine's disk: where it may read them, and what they hold (headers only).

A disk update (``TRANSPORT_DISK``, SGLang's ``update_weights_from_disk``,
vLLM's ``reload_weights``) names a checkpoint by path. The engine's operator
allows a few directories (``wsync serve --checkpoint-root DIR``, repeatable);
:class:`~wsync_grpc.transports.disk.roots.CheckpointRoots` places a caller's
path beneath one of them and opens it there, one component at a time, never
through a symlink (:mod:`~wsync_grpc.transports.disk.confined`). Every file a disk update reads
(the index, the shards, an adapter's config and weights) is opened once,
must be a regular file, and is read through that open file only:
:func:`read_checkpoint` reads the files' headers (names, dtypes, shapes,
never a tensor's data) so that the update is validated like broadcast
metadata before a byte is loaded, and the readers
(:class:`~wsync_grpc.transports.disk.receiver.DiskReceiver`) read the tensors
through the same open files later. Planning is bounded: side files, headers,
files and tensors all have caps. Only safetensors: a pickle checkpoint
(``.bin``, ``.pt``...) is refused, never opened, since loading one runs
whatever code it carries.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.errors import Aborted, InvalidArgument, NotFound
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.lora import LoraSpec, lora_spec_from_config
from wsync_grpc.core.update import PlannedUpdate, SourceFile
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports.disk.confined import OpenDir, OpenFile, SharedFile, path_parts, shown
from wsync_grpc.transports.disk.roots import CheckpointRoots
from wsync_grpc.transports.disk.safetensors_file import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, read_header

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded Hugging Face checkpoint (``weight_map``: tensor name -> file)."""

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""File suffixes of pickle checkpoints (``torch.save``): refused, never opened."""

DISK_BUCKET_BYTES = 64 << 20
"""A disk update's buckets: consecutive tensors of one file, up to this many bytes each (one tensor may exceed it)."""

MAX_INDEX_BYTES = 64 << 20
"""Largest ``model.safetensors.index.json`` read, in bytes (a 100k-tensor index is about 10 MB)."""

MAX_ADAPTER_CONFIG_BYTES = 1 << 20
"""Largest ``adapter_config.json`` read, in bytes (PEFT writes about 1 KB)."""

MAX_DIR_ENTRIES = 100_000
"""Most entries a checkpoint directory may hold (it is listed to find its files)."""

MAX_CHECKPOINT_FILES = 4096
"""Most safetensors files one checkpoint may have."""

MAX_CHECKPOINT_TENSORS = 1 << 20
"""Most tensors one checkpoint's headers may list, in all."""

MAX_HEADERS_BYTES = 256 << 20
"""Most bytes of safetensors headers one checkpoint's planning reads, in all."""


def torch_dtype(tag: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype tag (e.g. ``"BF16"``).

    Raises:
        ValueError: a tag weight sync does not carry.
    """
    try:
        return SAFETENSORS_DTYPES[tag]
    except KeyError:
        raise ValueError(f"checkpoint dtype {tag} is not supported") from None


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a checkpoint, as its file's header describes it.

    Attributes:
        name: its name in the checkpoint (Hugging Face naming).
        dtype: its dtype name as weight sync spells it (``"bfloat16"``), or the raw tag when unsupported.
        shape: its shape.
        nbytes: its size, in bytes (from the header's data offsets).
        file: the open file holding it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: OpenFile


def _suffix_checked(name: str) -> str:
    """``name`` if it names a safetensors file.

    Raises:
        InvalidArgument: PICKLE_CHECKPOINT, NOT_SAFETENSORS.
    """
    suffix = PurePosixPath(name).suffix
    if suffix in PICKLE_SUFFIXES:
        raise _pickle_refused(name)
    if suffix != ".safetensors":
        raise InvalidArgument("NOT_SAFETENSORS", f"{shown(name)} is not a .safetensors file", path=shown(name))
    return name


def open_checkpoint(target: OpenDir | OpenFile) -> list[OpenFile]:
    """The safetensors files of a checkpoint, opened: ``target`` itself, or a directory's (through its index).

    Every file is opened beneath ``target`` (so beneath its root), never
    through a symlink, and must be a regular file. The index is read through
    its own open file, at most :data:`MAX_INDEX_BYTES`. On error, nothing
    stays open but ``target`` (the caller's).

    Raises:
        InvalidArgument: PICKLE_CHECKPOINT (a pickle file, or a directory with pickle files and no
            safetensors), NOT_SAFETENSORS, BAD_INDEX, INDEX_TOO_LARGE, TOO_MANY_FILES.
        NotFound: CHECKPOINT_NOT_FOUND (no safetensors file; a file the index names is missing).
        PermissionDenied: PATH_OUTSIDE_ROOTS (an index naming a file by an absolute path or through ``..``),
            SYMLINK_IN_PATH, NOT_A_REGULAR_FILE.
    """
    if isinstance(target, OpenFile):
        _suffix_checked(target.name)
        return [target]
    names = target.names(MAX_DIR_ENTRIES)
    where = "/".join(target.path) or "the checkpoint root"
    if INDEX_FILE in names:
        with target.open_file((INDEX_FILE,)) as index:
            files = _index_files(index.read_all(MAX_INDEX_BYTES, "INDEX_TOO_LARGE"))
    else:
        files = [(n,) for n in names if n.endswith(".safetensors")]
        if not files:
            pickles = [n for n in names if PurePosixPath(n).suffix in PICKLE_SUFFIXES]
            if pickles:
                raise _pickle_refused(pickles[0])
            raise NotFound("CHECKPOINT_NOT_FOUND", f"no safetensors file in {shown(where)}", path=shown(where))
    if len(files) > MAX_CHECKPOINT_FILES:
        raise InvalidArgument(
            "TOO_MANY_FILES", f"the checkpoint has {len(files)} files; at most {MAX_CHECKPOINT_FILES} are read"
        )
    out: list[OpenFile] = []
    try:
        for parts in files:
            _suffix_checked(parts[-1])
            out.append(target.open_file(parts))
    except BaseException:
        for f in out:
            f.close()
        raise
    return out


def _index_files(raw: bytes) -> list[tuple[str, ...]]:
    """The files a ``model.safetensors.index.json`` names (each as path components), sorted, each once.

    Raises:
        InvalidArgument: BAD_INDEX (not an index; the message never repeats its content).
        PermissionDenied: PATH_OUTSIDE_ROOTS (an absolute path, a ``..``).
    """
    try:
        weight_map = json.loads(raw.decode("utf-8"))["weight_map"]
        names = set(weight_map.values())
        if not all(isinstance(n, str) and n for n in names):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise InvalidArgument(
            "BAD_INDEX", f"{INDEX_FILE} is not a safetensors index (a weight_map of tensor names to file names)"
        ) from None
    files = {path_parts(n) for n in names}
    files.discard(())
    return sorted(files)


def model_checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the model directory an engine was started with (its operator's, not a caller's).

    Symlinks are followed (a Hugging Face cache snapshot is made of them): never give it a path a caller chose.

    Raises:
        NotFound: CHECKPOINT_NOT_FOUND (no safetensors file).
        InvalidArgument: BAD_INDEX.
    """
    if path.is_file():
        return [path]
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            return [path / f for f in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument("BAD_INDEX", f"{INDEX_FILE} in {path} is not a safetensors index: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotFound("CHECKPOINT_NOT_FOUND", f"no safetensors file in {path}", path=str(path)[:200])
    return files


def _pickle_refused(name: str) -> InvalidArgument:
    return InvalidArgument(
        "PICKLE_CHECKPOINT",
        f"{name[:200]} is a pickle checkpoint: only safetensors are read (a pickle file can run code when loaded)",
        path=name[:200],
    )


def read_checkpoint(files: Sequence[OpenFile], cancel: threading.Event | None = None) -> list[CheckpointTensor]:
    """Every tensor of ``files``, in file order then name order, from the headers alone (read through each file).

    Bounded: at most :data:`MAX_CHECKPOINT_TENSORS` tensors and :data:`MAX_HEADERS_BYTES` of headers in all.

    Args:
        cancel: when set, reading stops before the next file.

    Raises:
        InvalidArgument: BAD_CHECKPOINT_FILE (not a valid safetensors file, or unreadable), HEADER_TOO_LARGE,
            TOO_MANY_TENSORS.
        Aborted: UPDATE_CANCELLED (``cancel`` was set).
    """
    out: list[CheckpointTensor] = []
    budget = MAX_HEADERS_BYTES
    for f in files:
        if cancel is not None and cancel.is_set():
            raise Aborted("UPDATE_CANCELLED", "the update was cancelled while its checkpoint was being read")
        try:
            header = read_header(f, min(MAX_HEADER_BYTES, budget))
        except OSError as e:
            raise InvalidArgument(
                "BAD_CHECKPOINT_FILE", f"{shown(f.name)} could not be read: {e.strerror}", path=shown(f.name)
            ) from None
        budget -= header.nbytes
        entries = header.entries
        if len(out) + len(entries) > MAX_CHECKPOINT_TENSORS:
            raise InvalidArgument(
                "TOO_MANY_TENSORS", f"the checkpoint lists more than {MAX_CHECKPOINT_TENSORS} tensors"
            )
        for entry in entries:
            dtype = SAFETENSORS_DTYPES.get(entry.dtype)  # None: the validator refuses the raw tag
            shown_dtype = dtype_name(dtype) if dtype else entry.dtype[:20]
            out.append(CheckpointTensor(entry.name, shown_dtype, entry.shape, entry.nbytes, f))
    return out


@dataclass(frozen=True)
class _Whole:
    """A checkpoint tensor is read whole (:class:`~wsync_grpc.core.validation.ShardFields` of no piece)."""

    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()


@dataclass(frozen=True)
class _NoDelta:
    """No delta (``wsync.v1.TensorDelta`` unset): a checkpoint's tensors are whole."""

    positions: int = 0
    changed_elements: int = 0
    positions_bytes: int = 0


@dataclass(frozen=True)
class _TensorSpec:
    """A checkpoint tensor as bucket metadata (:class:`~wsync_grpc.core.validation.TensorSpecFields`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int = 0
    shard: _Whole = _Whole()
    delta: _NoDelta = _NoDelta()


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


def files_of(
    buckets: Sequence[Bucket], tensors: Sequence[CheckpointTensor], sources: dict[OpenFile, SourceFile]
) -> dict[str, SourceFile]:
    """Tensor name -> the file holding it (``sources``: each open file as the plan names it), for ``buckets``."""
    where = {t.name: sources[t.file] for t in tensors}
    return {s.name: where[s.name] for b in buckets for s in b.tensors}


ADAPTER_CONFIG = "adapter_config.json"
"""A PEFT adapter directory's configuration (JSON)."""

ADAPTER_FILE = "adapter_model.safetensors"
"""A PEFT adapter directory's tensors."""


def adapter_checkpoint(target: OpenDir | OpenFile, name: str) -> tuple[LoraSpec, OpenFile]:
    """The spec and open weights file of the PEFT adapter directory ``target`` (``save_pretrained``'s output).

    ``adapter_config.json`` is opened beneath ``target``, never through a
    symlink, a regular file of at most :data:`MAX_ADAPTER_CONFIG_BYTES`, and
    read through that open file; so is ``adapter_model.safetensors``. Error
    messages never repeat the config's content.

    Raises:
        InvalidArgument: NOT_A_PEFT_DIRECTORY, BAD_ADAPTER_CONFIG (not a JSON object),
            ADAPTER_CONFIG_TOO_LARGE, PICKLE_CHECKPOINT (``adapter_model.bin`` only), and the reasons of
            :func:`~wsync_grpc.core.lora.lora_spec_from_config`.
        NotFound: CHECKPOINT_NOT_FOUND (no ``adapter_model.safetensors``).
        PermissionDenied: SYMLINK_IN_PATH, NOT_A_REGULAR_FILE.
    """
    if isinstance(target, OpenFile):
        raise InvalidArgument("NOT_A_PEFT_DIRECTORY", f"{shown(target.name)} is a file, not a PEFT adapter directory")
    names = target.names(MAX_DIR_ENTRIES)
    where = "/".join(target.path) or "the checkpoint root"
    if ADAPTER_CONFIG not in names:
        raise InvalidArgument(
            "NOT_A_PEFT_DIRECTORY", f"{shown(where)} is not a PEFT adapter directory (no {ADAPTER_CONFIG})"
        )
    with target.open_file((ADAPTER_CONFIG,)) as config:
        raw = config.read_all(MAX_ADAPTER_CONFIG_BYTES, "ADAPTER_CONFIG_TOO_LARGE")
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise InvalidArgument("BAD_ADAPTER_CONFIG", f"{ADAPTER_CONFIG} is not UTF-8 JSON") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument("BAD_ADAPTER_CONFIG", f"{ADAPTER_CONFIG} is not a JSON object")
    spec = lora_spec_from_config(name, parsed)
    if ADAPTER_FILE not in names:
        if "adapter_model.bin" in names:
            raise _pickle_refused("adapter_model.bin")
        raise NotFound("CHECKPOINT_NOT_FOUND", f"no {ADAPTER_FILE} in {shown(where)}", path=shown(where))
    return spec, target.open_file((ADAPTER_FILE,))


def plan_disk_update(
    roots: CheckpointRoots,
    header: UpdateHeader,
    validator: UpdateValidator,
    cancel: threading.Event | None = None,
) -> PlannedUpdate:
    """A disk update's buckets, validated, and where each tensor is: everything Prepare does before loading.

    Opens ``header.checkpoint_path`` beneath ``roots``, opens its files (an
    adapter's: its PEFT directory's, its spec from ``adapter_config.json``),
    reads their headers through those open files and validates every tensor
    with ``validator`` (which then holds the update's declarations, as after
    a broadcast's Prepare stream). The files stay open, shared by the
    update's readers in this process; ``PlannedUpdate.release`` lets go of
    planning's references (it closes them when no reader took one).

    Args:
        cancel: when set (a Cancel while the update is planned), planning stops between two files.

    Raises:
        PermissionDenied, NotFound, InvalidArgument: see :meth:`CheckpointRoots.open`,
            :func:`open_checkpoint`, :func:`adapter_checkpoint`, :func:`read_checkpoint` and
            :meth:`~wsync_grpc.core.validation.UpdateValidator.disk_buckets`.
        Aborted: UPDATE_CANCELLED (``cancel`` was set).
        Unimplemented: an adapter on an engine that serves none.
    """
    _, parts = roots.locate(header.checkpoint_path)
    if parts and PurePosixPath(parts[-1]).suffix in PICKLE_SUFFIXES:  # refused before it is even opened
        raise _pickle_refused(parts[-1])
    target = roots.open(header.checkpoint_path)
    files: list[OpenFile] = []
    try:
        if header.adapter is not None:
            spec, weights = adapter_checkpoint(target, header.adapter.name)
            files = [weights]
            validator.use_specs(validator.adapter_specs(spec), {})
            header = dataclasses.replace(header, adapter=spec)
        else:
            files = open_checkpoint(target)
        tensors = read_checkpoint(files, cancel)
        buckets = validator.source_buckets(bucket_specs(tensors))
    except BaseException:
        for f in files:
            f.close()
        if isinstance(target, OpenFile):
            target.close()
        raise
    finally:
        if isinstance(target, OpenDir):
            target.close()
    shared = {f: SharedFile(f) for f in files}
    sources = {f: f.source(shared[f]) for f in files}
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):  # the first call only
            for s in shared.values():
                s.release()

    return PlannedUpdate(header, buckets, files_of(buckets, tensors, sources), release)
