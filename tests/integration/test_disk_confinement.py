"""Disk updates read only regular files opened once beneath a root, never through a symlink, in bounded time.

Real parts only: a tensor engine behind a real gRPC server reading real safetensors files, with
real symlinks, FIFOs and sparse files put in place (and swapped while it reads) by the test; the
worker side's real :class:`~wsync_grpc.engines.host.WorkerHost` reading a plan that crossed as
the message vLLM's workers get. Whatever lies outside the root holds distinctive bytes that must
never reach the served weights nor an error message.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import save_file
from support import StatusProbe, code_of, status
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.errors import WsyncError
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.messages import plan_from_msg, plan_to_msg, progress_from_msg, progress_to_msg
from wsync_grpc.core.update import Payload, ReceivePlan
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.host import Swap, WorkerHost
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.controller import update_validator
from wsync_grpc.testing import in_process_server
from wsync_grpc.transports.disk.checkpoint import INDEX_FILE, MAX_CHECKPOINT_FILES, MAX_INDEX_BYTES, plan_disk_update
from wsync_grpc.transports.disk.roots import CheckpointRoots
from wsync_grpc.transports.disk.safetensors_file import MAX_HEADER_BYTES
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (calls answered within 1 s during a read): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

PRESET = "tiny"
MARKER = "OUTSIDE-THE-ROOT-7f3a"
"""Written into every file outside the root: it must never come back in an error message."""

DENIED = grpc.StatusCode.PERMISSION_DENIED


def values(seed: float) -> dict[str, torch.Tensor]:
    """Every canonical tensor of the tiny preset, filled with ``seed`` (recognisable wherever it lands)."""
    return {n: torch.full_like(t, seed) for n, t in synthetic.build(PRESET).items()}


def write_sharded(d: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """``tensors`` as a two-shard checkpoint with its index in directory ``d``; the two shards."""
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2
    a, b = d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors"
    save_file({n: tensors[n] for n in names[:half]}, str(a))
    save_file({n: tensors[n] for n in names[half:]}, str(b))
    weight_map = {n: (a if i < half else b).name for i, n in enumerate(names)}
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return a, b


class Disk:
    """A tensor engine (preset tiny, all ones) reading checkpoints under ``root``, behind a real server."""

    def __init__(self, engine: TensorEngine, stub: Any, root: Path, outside: Path) -> None:
        self.engine, self.stub, self.root, self.outside = engine, stub, root, outside
        self.before = {n: t.clone() for n, t in engine.tensors.items()}

    def prepare(self, path: str, version: str = "v") -> pb.PrepareResponse:
        header = pb.PrepareHeader(weight_version=version, transport=pb.TRANSPORT_DISK, checkpoint_path=path)
        return self.stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)

    def refused(self, path: str) -> grpc.RpcError:
        """The Prepare of ``path`` fails, says nothing of what lies outside, and changes nothing."""
        with pytest.raises(grpc.RpcError) as e:
            self.prepare(path)
        assert MARKER not in (e.value.details() or ""), e.value.details()  # type: ignore[attr-defined]
        assert MARKER not in str(e.value.trailing_metadata())  # type: ignore[attr-defined]
        self.unchanged()
        return e.value

    def unchanged(self) -> None:
        assert all(torch.equal(self.engine.tensors[n], t) for n, t in self.before.items())
        st = status(self.stub)
        assert st.state == pb.LIFECYCLE_STATE_UNINITIALIZED and not st.HasField("update")  # type: ignore[attr-defined]

    def serves(self, seed: float) -> bool:
        return all(bool((self.engine.tensors[n] == seed).all()) for n in self.before)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    # Outside the root: a valid checkpoint of distinctive values (-7), an index and configs holding MARKER.
    save_file(values(-7.0), str(outside / "model.safetensors"), metadata={"marker": MARKER})
    (outside / INDEX_FILE).write_text(MARKER)
    engine = TensorEngine(values(1.0), aliases=synthetic.aliases(PRESET))
    with in_process_server(engine, checkpoint_roots=[str(root)]) as (_, stub):
        yield Disk(engine, stub, root, outside)


def test_a_symlink_anywhere_on_the_way_is_permission_denied(disk: Disk) -> None:
    """The index, a shard, the checkpoint file, a directory: never followed, inside or out of the root."""
    root, outside = disk.root, disk.outside
    a, _ = write_sharded(root / "good", values(2.0))
    write_sharded(root / "index-link", values(2.0))
    (root / "index-link" / INDEX_FILE).unlink()
    (root / "index-link" / INDEX_FILE).symlink_to(outside / INDEX_FILE)  # outside content: MARKER
    _, b = write_sharded(root / "shard-out", values(2.0))
    b.unlink()
    b.symlink_to(outside / "model.safetensors")
    _, b = write_sharded(root / "shard-in", values(2.0))
    b.unlink()
    b.symlink_to(a)  # a symlink to a file inside the root is refused as well
    (root / "file-link.safetensors").symlink_to(outside / "model.safetensors")
    (root / "dir-link").symlink_to(root / "good")
    cases = [
        "index-link",
        "shard-out",
        "shard-in",
        "file-link.safetensors",
        "dir-link",
        "dir-link/model-00001-of-00002.safetensors",
        str(root / "dir-link"),
    ]
    for path in cases:
        err = disk.refused(path)
        assert (code_of(err), error_reason(err)) == (DENIED, "SYMLINK_IN_PATH"), (path, err.details())  # type: ignore[attr-defined]
        assert "symbolic link" in err.details()  # type: ignore[attr-defined]
    r = disk.prepare("good")  # the same files, reached through no symlink, are read
    assert disk.stub.Complete(pb.CompleteRequest(update_id=r.update_id), timeout=30).weight_version == "v"
    assert disk.serves(2.0)


def test_fifos_are_refused_at_once_and_the_engine_keeps_answering(disk: Disk) -> None:
    """A FIFO as the checkpoint, as a shard, as the index: refused without waiting for a writer."""
    root = disk.root
    os.mkfifo(root / "fifo.safetensors")
    _, b = write_sharded(root / "fifo-shard", values(2.0))
    b.unlink()
    os.mkfifo(b)
    write_sharded(root / "fifo-index", values(2.0))
    (root / "fifo-index" / INDEX_FILE).unlink()
    os.mkfifo(root / "fifo-index" / INDEX_FILE)
    with StatusProbe(disk.stub) as probe:
        for path in ["fifo.safetensors", "fifo-shard", "fifo-index"]:
            t0 = time.monotonic()
            err = disk.refused(path)
            assert time.monotonic() - t0 < 5, path
            assert (code_of(err), error_reason(err)) == (DENIED, "NOT_A_REGULAR_FILE"), (path, err.details())  # type: ignore[attr-defined]
    assert probe.calls > 0 and probe.slowest < 1.0


def test_side_files_headers_and_file_counts_are_bounded(disk: Disk) -> None:
    """Nothing is read past its cap: a huge index or header, too many files, an index naming a path out."""
    root = disk.root
    write_sharded(root / "big-index", values(2.0))
    with (root / "big-index" / INDEX_FILE).open("r+b") as f:  # sparse: costs no disk
        f.truncate(MAX_INDEX_BYTES + 1)
    big_header = root / "big-header.safetensors"
    with big_header.open("wb") as f:
        f.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
        f.truncate(MAX_HEADER_BYTES + 64)
    many = root / "many"
    many.mkdir()
    weight_map = {f"t{i}": f"s{i}.safetensors" for i in range(MAX_CHECKPOINT_FILES + 1)}
    (many / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    for name, target in [("abs-index", str(disk.outside / "model.safetensors")), ("up-index", "../x.safetensors")]:
        (root / name).mkdir()
        (root / name / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.norm.weight": target}}))
    cases = {
        "big-index": (grpc.StatusCode.INVALID_ARGUMENT, "INDEX_TOO_LARGE"),
        "big-header.safetensors": (grpc.StatusCode.INVALID_ARGUMENT, "HEADER_TOO_LARGE"),
        "many": (grpc.StatusCode.INVALID_ARGUMENT, "TOO_MANY_FILES"),
        "abs-index": (DENIED, "PATH_OUTSIDE_ROOTS"),
        "up-index": (DENIED, "PATH_OUTSIDE_ROOTS"),
    }
    for path, expected in cases.items():
        t0 = time.monotonic()
        err = disk.refused(path)
        assert (code_of(err), error_reason(err)) == expected, (path, err.details())  # type: ignore[attr-defined]
        assert time.monotonic() - t0 < 5, path


class Flipper:
    """Swaps what one shard's name is, over and over: the real file, a FIFO, a symlink out of the root."""

    def __init__(self, shard: Path, real: Path, outside: Path) -> None:
        self.shard, self.real, self.outside = shard, real, outside
        self.flips = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tmp = self.shard.with_name(".flip")
        while not self.stop.is_set():
            tmp.unlink(missing_ok=True)  # renaming a hard link onto the same file leaves it in place
            kind = self.flips % 3
            if kind == 0:
                os.link(self.real, tmp)  # the inside file itself (same inode)
            elif kind == 1:
                os.mkfifo(tmp)
            else:
                tmp.symlink_to(self.outside)
            os.replace(tmp, self.shard)
            self.flips += 1
            time.sleep(0.0005)


@pytest.mark.timeout(300)
def test_a_shard_flipping_between_a_file_a_fifo_and_a_symlink_never_leaks_nor_stalls(disk: Disk) -> None:
    """While one shard's name flips thousands of times, Prepares fail cleanly or read the inside file only.

    GetStatus answers within 1 s throughout; every update that applies serves the inside values, never
    the outside file's; no error message repeats what lies outside.
    """
    _, b = write_sharded(disk.root / "ck", values(3.0))
    real = disk.root / "b-real.safetensors"
    os.link(b, real)
    flipper = Flipper(b, real, disk.outside / "model.safetensors")
    reasons: dict[str, int] = {}
    applied = 0
    with StatusProbe(disk.stub) as probe:
        flipper.thread.start()
        try:
            while flipper.flips < 3000 or sum(reasons.values()) + applied < 30:
                assert flipper.thread.is_alive()
                try:
                    r = disk.prepare("ck", f"v{applied}")
                except grpc.RpcError as e:
                    assert MARKER not in (e.details() or "")  # type: ignore[attr-defined]
                    reasons[error_reason(e)] = reasons.get(error_reason(e), 0) + 1
                    continue
                done = disk.stub.Complete(pb.CompleteRequest(update_id=r.update_id), timeout=30)
                assert done.weight_version == f"v{applied}"
                assert disk.serves(3.0), "a byte from outside the root was served"
                applied += 1
        finally:
            flipper.stop.set()
            flipper.thread.join(10)
    assert probe.calls > 0 and probe.slowest < 1.0, (probe.calls, probe.slowest)
    assert set(reasons) <= {"NOT_A_REGULAR_FILE", "SYMLINK_IN_PATH", "CHECKPOINT_NOT_FOUND"}, reasons
    assert reasons.get("NOT_A_REGULAR_FILE") and reasons.get("SYMLINK_IN_PATH"), reasons
    assert applied > 0, reasons
    assert flipper.flips >= 3000


class DictGlue:
    """A worker's model as a dict of tensors (a :class:`~wsync_grpc.engines.host.ModelGlue`)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def begin_reload(self) -> None:
        pass

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.tensors.update((n, t.clone()) for n, t in tensors)

    def end_reload(self) -> None:
        pass

    def prepare(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> Swap | None:
        return None


def worker_plan(root: Path, path: str) -> tuple[ReceivePlan, Any]:
    """A disk update of ``path`` planned as the front does, its plan as a worker process receives it."""
    engine = TensorEngine(values(1.0), aliases=synthetic.aliases(PRESET))
    validator = update_validator(engine)
    validator.header_message(
        UpdateHeader("", "v", Layout.INDIVIDUAL, ApplyMode.STAGED, 0, 0, False, Transport.DISK, path)
    )
    validator.finish_stream()
    assert validator.header is not None
    planned = plan_disk_update(CheckpointRoots([root]), validator.header, validator)
    plan = ReceivePlan(
        Transport.DISK,
        Payload.WEIGHTS,
        Layout.INDIVIDUAL,
        ApplyMode.STAGED,
        tuple(planned.buckets),
        True,
        planned.files,
    )
    return plan_from_msg(plan_to_msg(plan)), planned


def test_a_worker_reads_only_the_file_the_front_opened(tmp_path: Path) -> None:
    """A worker process opens each file again beneath the root: only the very file Prepare opened is read.

    Swapped after Prepare (another regular file renamed into place, a symlink out, a FIFO), the file
    is refused, and the front learns why (the reason crosses as the worker's progress does).
    """
    root = tmp_path / "root"
    _, b = write_sharded(root / "ck", values(4.0))
    outside = tmp_path / "outside.safetensors"
    save_file(values(-7.0), str(outside))

    plan, planned = worker_plan(root, "ck")
    planned.release()  # as the front does once its receivers exist: the worker holds nothing of it
    assert all(f.handle is None for f in plan.files.values())  # an open file never crosses a process
    glue = DictGlue()
    host = WorkerHost(glue, torch.device("cpu"), 0)  # type: ignore[arg-type]
    host.arm(plan)
    assert host.apply(30) == len(values(4.0))
    assert glue.tensors.keys() == values(4.0).keys() and all(bool((t == 4.0).all()) for t in glue.tensors.values())

    half = sorted(values(5.0))[len(values(5.0)) // 2 :]
    for swap, reason in [
        ("replaced", "CHECKPOINT_CHANGED"),
        ("symlink", "SYMLINK_IN_PATH"),
        ("fifo", "NOT_A_REGULAR_FILE"),
    ]:
        plan, planned = worker_plan(root, "ck")
        planned.release()
        tmp, saved = b.with_name(".swap"), b.with_name(".saved")
        if swap == "replaced":  # the same tensors, other values: only its identity tells it apart
            save_file({n: values(5.0)[n] for n in half}, str(tmp))
        elif swap == "symlink":
            tmp.symlink_to(outside)
        else:
            os.mkfifo(tmp)
        os.replace(b, saved)
        os.replace(tmp, b)
        glue = DictGlue()
        host = WorkerHost(glue, torch.device("cpu"), 0)  # type: ignore[arg-type]
        host.arm(plan)
        assert host.receiver is not None and host.receiver.done.wait(10), swap
        seen = progress_from_msg(progress_to_msg(host.progress())).error  # what the front process gets
        assert isinstance(seen, WsyncError) and seen.reason == reason, (swap, seen)
        with pytest.raises(RuntimeError):
            host.apply(5)
        assert not glue.tensors
        host.abandon()
        os.replace(saved, b)
