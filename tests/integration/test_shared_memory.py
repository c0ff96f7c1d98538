"""The shared-memory transport (issue 46, CPU half): a trainer on the engines' host packs each bucket into a ring of
slots in a memfd it hands over on an abstract Unix socket; every engine worker maps it read-only and copies each
bucket out; and the zero-copy path: tensors already in the trainer's shared memory (``share_memory_()``) are not
packed, each worker reads them from the trainer's storages with ``pread`` (never mapped).

Real gRPC servers on loopback ports serving synthetic :class:`TensorEngine` s and a reference engine (a tiny Llama),
a real :class:`TrainerClient` (``sync(..., transport="shared_memory")``), a real trainer process SIGKILLed
mid-update; checked against the engines' own ``GetWeightChecksums``, their tensors, and what this process and the
host hold afterwards (``/proc/self/maps``, ``/proc/self/fd``, ``/dev/shm``). The trainer and the in-process engines
share this process: the trainer's mapping of its kept segment is read-write (``rw-s``), an engine's read-only
(``r--s``).

Not covered here: a peer of another user (the engine refuses a trainer, the trainer an engine, whose
``SO_PEERCRED`` user is not its own): faking that needs a second user account (root to switch), which CI does not
have; the check is the same one-line comparison on both sides.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support import ENV, ROOT, VLLM_SHM_PREFIXES, assert_serve, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc import transports
from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.errors import Unavailable
from wsync_grpc.core.header import SharedMemoryHandle
from wsync_grpc.core.layout import ApplyMode, Bucket, Layout, TensorSlot, Transport
from wsync_grpc.core.update import Payload, ReceivePlan
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.reference import ReferenceEngine
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import in_process_server, spawn_engine, stop_all, wait_all
from wsync_grpc.trainer import FleetPolicy, SyncError, SyncProgress, TrainerClient
from wsync_grpc.trainer.options import ApplyMode as ApplyModeName
from wsync_grpc.transports import shared_memory
from wsync_grpc.transports.shared_memory.protocol import boot_id
from wsync_grpc.transports.shared_memory.receiver import SharedMemoryReceiver
from wsync_grpc.wire.status import error_info
from wsync_grpc.worker.buffers import BufferPool
from wsync_grpc.worker.feed import BucketFeed
from wsync_grpc.worker.receiver import Receiver, ReceiveSite

pytestmark = pytest.mark.timeout(120)

SMALL: dict[str, Any] = {"bucket_bytes": 32 << 10, "ramp_bytes": 0, "solo_bytes": 64 << 10}
"""Client settings that cut the tiny synthetic model in several buckets: the embedding alone, the rest packed."""

SEGMENT = "/memfd:wsync-shm"
"""How a segment shows in ``/proc/<pid>/maps`` and as the target of a descriptor in ``/proc/<pid>/fd``."""


def sums(tensors: dict[str, torch.Tensor], names: Any, aliases: dict[str, str]) -> dict[str, str]:
    """The SHA-256 the engine should report for each of ``names``, from the trainer's ``tensors``."""
    return {n: tensor_sha256(tensors[aliases.get(n, n)]) for n in names}


def served(client: TrainerClient) -> dict[str, dict[str, str]]:
    """Every engine's ``GetWeightChecksums``: target -> name -> SHA-256."""
    return {t: c.by_name for t, c in client.checksums().items()}


def mappings() -> dict[str, int]:
    """This process's mappings of segments by permissions (``rw-s``: a trainer's, ``r--s``: an engine's)."""
    found: dict[str, int] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        if SEGMENT in line:
            perms = line.split()[1]
            found[perms] = found.get(perms, 0) + 1
    return found


TRAINER_FDS = 2
"""Descriptors a trainer holds per kept segment: the read-only one it hands over, and the one Python's ``mmap``
keeps beside its mapping."""


def segment_fds() -> int:
    """This process's descriptors of segments (see :data:`TRAINER_FDS`)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(SEGMENT)
    return n


def listening_sockets() -> set[str]:
    """The abstract Unix socket names of this process's shared-memory handovers (``/proc/net/unix``, whose inodes
    this process holds: other processes of the host may run handovers of their own)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith("@wsync-shm-") and parts[6] in inodes:
            names.add(parts[7][1:])
    return names


def dev_shm() -> set[str]:
    """``/dev/shm``'s entries, but those of other jobs that may run on the host meanwhile (vLLM's and Python
    multiprocessing's: :data:`support.VLLM_SHM_PREFIXES`)."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith(VLLM_SHM_PREFIXES)}


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def one_bucket_receiver(engine: Any, bucket: Bucket, handle: SharedMemoryHandle, timeout_s: float) -> Receiver:
    """An engine worker's shared-memory receiver of one staged update of ``bucket`` (update id ``"u1"``) through
    ``handle``, for ``engine``'s CPU weights; not started."""
    plan = ReceivePlan(
        Transport.SHARED_MEMORY,
        Payload.WEIGHTS,
        Layout.FLATTENED,
        ApplyMode.STAGED,
        (bucket,),
        closed=True,
        timeout_s=timeout_s,
        update_id="u1",
        shared_memory=handle,
    )
    feed = BucketFeed()
    feed.extend([bucket])
    feed.close()
    cpu = torch.device("cpu")
    site = ReceiveSite(0, cpu, engine, feed, threading.Event(), lambda r: None, None, BufferPool(cpu, False))
    return shared_memory.PART.receiver(site, plan)


def test_the_registry_serves_the_part() -> None:
    assert transports.transport_for(Transport.SHARED_MEMORY) is shared_memory.PART
    assert not shared_memory.PART.needs_group and not shared_memory.PART.engine_builds_buckets


@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_two_tensor_engines_take_a_sync_through_shared_memory_bit_exact(apply_mode: ApplyModeName) -> None:
    """Two engines (each worker connects and maps the segment) in one sync; every bucket verified against its
    digest; no group; no engine mapping or descriptor outlives the update, and the trainer keeps one segment
    between syncs, gone when the client closes."""
    aliases = synthetic.aliases("tiny")
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (a, ea, sa),
        tensor_server("tiny", seed=1) as (b, eb, sb),
        TrainerClient([a.address, b.address], **SMALL) as client,
    ):
        progress: list[SyncProgress] = []
        phases: list[str] = []
        r = client.sync(
            new.items(),
            "v1",
            apply_mode=apply_mode,
            transport="shared_memory",
            progress=progress.append,
            on_phase=phases.append,
        )
        assert r.bucket_count > 3 and r.apply_mode == apply_mode and r.weight_version == "v1"
        assert [p.buckets_sent for p in progress] == list(range(1, r.bucket_count + 1))
        assert progress[-1].bytes_sent == r.wire_bytes
        assert phases[0] == "planned" and phases[-1] == "applied"
        assert {t: e.buckets_verified for t, e in r.engines.items()} == {
            a.address: r.bucket_count,
            b.address: r.bucket_count,
        }
        got = served(client)
        assert got == {t: sums(new, got[t], aliases) for t in (a.address, b.address)}
        for engine, stub in ((ea, sa), (eb, sb)):
            for n, t in new.items():
                assert torch.equal(engine.tensors[n], t), n
            st = status(stub)
            assert (st.weight_version, st.paused, st.dirty) == ("v1", False, False)
        assert client.group is None  # the transport needs none: nothing was formed
        assert mappings() == {"rw-s": 1} and segment_fds() == TRAINER_FDS  # the trainer's kept segment, no engine's
        assert not listening_sockets()

        newer = synthetic.build("tiny", seed=8)
        r2 = client.sync(newer.items(), "v2", apply_mode=apply_mode, transport="shared_memory")
        got = served(client)
        assert got == {t: sums(newer, got[t], aliases) for t in (a.address, b.address)}
        assert all(e.buckets_verified == r2.bucket_count for e in r2.engines.values())
        assert mappings() == {"rw-s": 1} and segment_fds() == TRAINER_FDS  # the same segment served the second sync
    assert mappings() == {} and segment_fds() == 0  # the client's close dropped it


def test_buckets_of_several_tensors_are_split_out_of_the_slot_into_what_the_engine_serves() -> None:
    """Staged, on an engine that serves a buffer it is handed (the tensor engine): every tensor of every bucket,
    several to a bucket included, is copied out of the slot into a buffer of its own and served from Complete on
    (nothing copied at Complete: every served tensor's memory changes), digests checked over the bucket's bytes,
    padding included; a second sync swaps again. Streaming without digests: each tensor is copied straight into the
    served one (its memory stays). Bit-exact throughout."""
    aliases = synthetic.aliases("tiny")
    with tensor_server("tiny", seed=0) as (a, engine, _), TrainerClient([a.address], **SMALL) as client:
        for i, seed in enumerate((7, 8)):
            new = synthetic.build("tiny", seed=seed)
            before = {n: t.data_ptr() for n, t in engine.tensors.items()}
            r = client.sync(new.items(), f"v{i}", apply_mode="staged", transport="shared_memory")
            assert r.engines[a.address].buckets_verified == r.bucket_count
            assert r.bucket_count < len(new)  # several tensors to a bucket
            assert all(engine.tensors[n].data_ptr() != before[n] for n in new), "a tensor was copied, not swapped"
            got = served(client)
            assert got == {a.address: sums(new, got[a.address], aliases)}
        newest = synthetic.build("tiny", seed=9)
        before = {n: t.data_ptr() for n, t in engine.tensors.items()}
        client.digests = False
        client.sync(newest.items(), "v2", apply_mode="streaming", transport="shared_memory")
        assert {n: engine.tensors[n].data_ptr() for n in newest} == {n: before[n] for n in newest}
        for n, t in newest.items():
            assert torch.equal(engine.tensors[n], t), n
        # The zero-copy path alike: each tensor read from the trainer's storage into its own buffer (staged, its
        # digest checked) or straight into the served tensor (streaming, no digests).
        shared = {n: t.share_memory_() for n, t in synthetic.build("tiny", seed=10).items()}  # type: ignore[no-untyped-call]
        for version, apply_mode, digests in (("v3", "staged", True), ("v4", "streaming", False)):
            for t in shared.values():
                t.add_(1)
            client.digests = digests
            before = {n: t.data_ptr() for n, t in engine.tensors.items()}
            r = client.sync(shared.items(), version, apply_mode=apply_mode, transport="shared_memory")  # type: ignore[arg-type]
            assert sm_sender(client).last_send.storage_buckets == r.bucket_count > 3
            assert r.engines[a.address].buckets_verified == (r.bucket_count if digests else 0)
            moved = {n for n in shared if engine.tensors[n].data_ptr() != before[n]}
            assert moved == (set(shared) if apply_mode == "staged" else set()), moved
            for n, t in shared.items():
                assert torch.equal(engine.tensors[n], t), n


def test_a_reference_engine_takes_staged_and_streaming_syncs(make_tiny_llama: Any, smollm2_tokenizer: Any) -> None:
    """The reference engine (a tiny Llama behind a real server) takes a staged then a streaming sync through shared
    memory bit-exact, and generates with the second."""
    with (
        ReferenceEngine(make_tiny_llama(seed=0), smollm2_tokenizer, name="tiny") as engine,
        in_process_server(engine) as (srv, stub),
        TrainerClient([srv.address]) as client,
    ):
        runs: tuple[tuple[str, ApplyModeName, int], ...] = (("v1", "staged", 1), ("v2", "streaming", 2))
        for version, apply_mode, seed in runs:
            new = make_tiny_llama(seed=seed)
            r = client.sync(
                new.named_parameters(),
                version,
                apply_mode=apply_mode,
                transport="shared_memory",
            )
            assert r.engines[srv.address].buckets_verified == r.bucket_count
            trained = new.state_dict()
            got = served(client)[srv.address]
            assert got == {n: tensor_sha256(trained[n]) for n in got}
            assert status(stub).weight_version == version
        assert client.group is None
        assert engine.generate("What is the capital of France?", 4).weight_versions == ("v2",)
        assert "r--s" not in mappings()


def ring_fields(**fields: Any) -> dict[str, Any]:
    """The fields of a well-formed ring handle of this host (its socket need not exist), ``fields`` on top."""
    base: dict[str, Any] = {
        "socket_name": "wsync-shm-0123456789abcdef",
        "token": bytes(32),
        "boot_id": boot_id(),
        "slot_bytes": 1 << 20,
        "slots": 2,
    }
    return {**base, **fields}


def raw_prepare(stub: Any, **handle: Any) -> grpc.RpcError:
    """A Prepare of one bucket over shared memory with a handle of this host but ``handle``'s fields; its error."""
    layout = handle.pop("layout", pb.BUCKET_LAYOUT_FLATTENED)
    fields = ring_fields(**handle)
    header = pb.PrepareHeader(
        weight_version="v1",
        transport=pb.TRANSPORT_SHARED_MEMORY,
        layout=layout,
        bucket_count=1,
        shared_memory=pb.SharedMemoryHandle(**fields),
    )
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
    return rpc.value


def test_the_engine_refuses_a_handle_from_another_host_or_layout() -> None:
    """Raw Prepare calls (the generated stub) whose handle names another boot, or none, or whose layout is
    individual: INVALID_ARGUMENT before anything is connected or changed. The trainer refuses an individual
    layout itself, before Prepare."""
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        old = {n: t.clone() for n, t in engine.tensors.items()}
        cases: list[tuple[dict[str, Any], str]] = [
            ({"boot_id": "00000000-0000-0000-0000-000000000000"}, "SHARED_MEMORY_HOST"),
            ({"token": b"short"}, "SHARED_MEMORY_HANDLE"),
            ({"slots": 1}, "SHARED_MEMORY_HANDLE"),
            ({"layout": pb.BUCKET_LAYOUT_INDIVIDUAL}, "SHARED_MEMORY_LAYOUT"),
        ]
        for fields, reason in cases:
            err = raw_prepare(stub, **fields)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, err)
            assert error_info(err)[0] == reason, (fields, err)
        header = pb.PrepareHeader(weight_version="v1", transport=pb.TRANSPORT_SHARED_MEMORY, bucket_count=1)
        with pytest.raises(grpc.RpcError) as rpc:  # no handle at all
            stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(rpc.value)[0] == "SHARED_MEMORY_HANDLE"

        with TrainerClient([srv.address], **SMALL) as client:
            with pytest.raises(SyncError) as e:
                client.sync(new.items(), "v1", layout="individual", transport="shared_memory")
            assert e.value.stage == "prepare", e.value
            assert "flattened" in str(e.value), e.value
        st = status(stub)
        assert (st.weight_version, st.paused, st.HasField("update")) == ("", False, False)
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n
        assert not listening_sockets() and mappings() == {}


NORM = "model.norm.weight"
"""bfloat16 [64] in the tiny preset (128 bytes)."""


def ring(**fields: Any) -> pb.SharedMemoryHandle:
    """A handle of this host's boot with ``fields`` replaced (its socket need not exist)."""
    base: dict[str, Any] = {
        "socket_name": "wsync-shm-0123456789abcdef",
        "token": bytes(32),
        "boot_id": boot_id(),
        "slot_bytes": 1 << 20,
        "slots": 2,
    }
    return pb.SharedMemoryHandle(**{**base, **fields})


def norm_halves(*srcs: int) -> list[pb.PrepareRequest]:
    """Two buckets, each a half of ``NORM`` as a piece (a sharded trainer's direct sends), sent by ``srcs``."""
    return [
        pb.PrepareRequest(
            bucket=pb.BucketSpec(
                index=i,
                size_bytes=64,
                src_rank=src,
                tensors=[
                    pb.TensorSpec(
                        name=NORM,
                        dtype="bfloat16",
                        shape=[32],
                        shard=pb.TensorShard(global_shape=[64], offsets=[32 * i]),
                    )
                ],
            )
        )
        for i, src in enumerate(srcs)
    ]


def test_the_engine_checks_the_rings_of_a_sharded_trainers_direct_sends() -> None:
    """Raw Prepare calls naming one ring per trainer rank (``shared_memory_ranks``): both fields set, an entry of
    another boot, a bucket whose rank has no ring, and pieces through a single ring are INVALID_ARGUMENT with their
    reasons; well-formed rings whose pieces tile the tensor pass the checks, and each worker connects to every
    rank's ring (the second rank's socket does not exist: SHARED_MEMORY_CONNECT naming it). Nothing changes."""
    from wsync_grpc.transports.shared_memory.handover import Handover, Segment

    def prepare(buckets: list[pb.PrepareRequest], **header: Any) -> grpc.RpcError:
        h = pb.PrepareHeader(
            weight_version="v1",
            transport=pb.TRANSPORT_SHARED_MEMORY,
            bucket_count=len(buckets),
            total_bytes=64 * len(buckets),
            **header,
        )
        with pytest.raises(grpc.RpcError) as rpc:
            stub.Prepare(iter([pb.PrepareRequest(header=h), *buckets]), timeout=30)
        return rpc.value

    segment = Segment(4096, 2)
    handover = Handover(segment, "u1")
    live = handover.handle(boot_id())
    rank0 = ring(socket_name=live.socket_name, token=live.token, slot_bytes=live.slot_bytes, slots=live.slots)
    try:
        with tensor_server("tiny", seed=0) as (_srv, engine, stub):
            old = {n: t.clone() for n, t in engine.tensors.items()}
            cases: list[tuple[list[pb.PrepareRequest], dict[str, Any], grpc.StatusCode, str, str]] = [
                (
                    norm_halves(0, 1),
                    {"shared_memory": ring(), "shared_memory_ranks": [ring(), ring()]},
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "SHARED_MEMORY_HANDLE",
                    "both set",
                ),
                (
                    norm_halves(0, 1),
                    {"shared_memory_ranks": [ring(), ring(boot_id="00000000-0000-0000-0000-000000000000")]},
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "SHARED_MEMORY_HOST",
                    "",
                ),
                (
                    norm_halves(0, 1),
                    {"shared_memory_ranks": [ring(), ring(slots=1)]},
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "SHARED_MEMORY_HANDLE",
                    "shared_memory_ranks[1]",
                ),
                (
                    norm_halves(0, 1),
                    {"shared_memory_ranks": [ring()]},
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "INVALID_SRC_RANK",
                    "src_rank 1",
                ),
                (
                    norm_halves(0, 0),
                    {"shared_memory": ring()},
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "SHARED_MEMORY_PIECES",
                    "shared_memory_ranks",
                ),
                (
                    norm_halves(0, 1),
                    {"shared_memory_ranks": [rank0, ring(socket_name="wsync-shm-ffffffffffffffff")]},
                    grpc.StatusCode.UNAVAILABLE,
                    "SHARED_MEMORY_CONNECT",
                    "wsync-shm-ffffffffffffffff",
                ),
            ]
            for buckets, header, code, reason, text in cases:
                err = prepare(buckets, **header)
                assert (err.code(), error_info(err)[0]) == (code, reason), (header, err)
                assert text in (err.details() or ""), (header, err.details())
            st = status(stub)
            assert (st.weight_version, st.HasField("update")) == ("", False)
            for n, t in engine.tensors.items():
                assert torch.equal(t, old[n]), n
            assert mappings() == {"rw-s": 1}  # the trainer's own segment alone: the worker unmapped rank 0's
    finally:
        handover.close()
        segment.close()
    assert mappings() == {} and not listening_sockets()


def test_a_member_behind_catches_up_through_shared_memory_with_no_group() -> None:
    """An engine added after v1 is behind; ``catch_up(..., transport="shared_memory")`` brings it to v1 alone,
    bit-exact, with no group formed (neither the client's nor the engine's status names one) and the other engine
    untouched; the next sync covers both."""
    aliases = synthetic.aliases("tiny")
    v1, v2 = synthetic.build("tiny", seed=7), synthetic.build("tiny", seed=8)
    with (
        tensor_server("tiny", seed=0) as (a, _ea, sa),
        tensor_server("tiny", seed=1) as (b, eb, sb),
        TrainerClient([a.address], **SMALL) as client,
    ):
        client.sync(v1.items(), "v1", transport="shared_memory")
        assert client.add_engine(b.address).state == "behind"
        before = status(sa).updates_completed
        caught = client.catch_up(v1.items(), transport="shared_memory")
        assert caught is not None and list(caught.engines) == [b.address] and caught.weight_version == "v1"
        assert caught.engines[b.address].buckets_verified == caught.bucket_count > 3
        assert caught.init_seconds == 0 and client.group is None  # no group was formed for it
        st = status(sb)
        assert (st.weight_version, st.HasField("group"), st.dirty) == ("v1", False, False)
        got = served(client)
        assert got[b.address] == sums(v1, got[b.address], aliases)
        for n, t in v1.items():
            assert torch.equal(eb.tensors[n], t), n
        assert status(sa).updates_completed == before  # the engine in sync was not touched
        assert {m.state for m in client.members().values()} == {"in_sync"}
        assert client.catch_up(transport="shared_memory") is None  # nobody is behind any more
        assert "r--s" not in mappings() and not listening_sockets()

        r = client.sync(v2.items(), "v2", transport="shared_memory")
        assert sorted(r.engines) == sorted((a.address, b.address)) and client.group is None
        got = served(client)
        assert got == {t: sums(v2, got[t], aliases) for t in (a.address, b.address)}


def test_a_bad_transport_is_refused_before_any_call() -> None:
    """``transport="bogus"`` for ``catch_up``, ``sync_adapter`` and ``sync``, and ``"shared_memory"`` for an adapter
    the engines read from a directory: ``ValueError`` naming the choices, before any call (the engine has no owner,
    no update)."""
    with tensor_server("tiny", seed=0) as (srv, _engine, stub), TrainerClient([srv.address], **SMALL) as client:
        new = synthetic.build("tiny", seed=7)
        with pytest.raises(ValueError, match="unknown transport 'bogus'; use one of 'broadcast', 'shared_memory'"):
            client.catch_up(new.items(), transport="bogus")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown transport 'bogus'"):
            client.sync_adapter("/nowhere", "a", "v1", transport="bogus")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown transport 'bogus'"):
            client.sync_adapter(object(), "a", "v1", transport="bogus")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown transport 'bogus'"):
            client.sync(new.items(), "v1", transport="bogus")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="read by the engines from disk"):
            client.sync_adapter("/nowhere", "a", "v1", transport="shared_memory")
        with pytest.raises(ValueError, match="unknown apply_mode"):
            client.catch_up(new.items(), apply_mode="eager", transport="shared_memory")  # type: ignore[arg-type]
        st = status(stub)
        assert (st.weight_version, st.HasField("owner"), st.HasField("update"), st.updates_completed) == (
            "",
            False,
            False,
            0,
        )
        assert client.group is None and not listening_sockets()


def test_a_cancel_mid_send_keeps_the_old_weights_and_the_next_sync_applies() -> None:
    """``cancel()`` once bucket 1 was copied out everywhere: the trainer packs no further bucket, the engine's reader
    (waiting for the next one) stops and unmaps, the update is abandoned with the old weights served; the next sync
    applies."""
    aliases = synthetic.aliases("tiny")
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, engine, stub), TrainerClient([srv.address], **SMALL) as client:
        old = {n: t.clone() for n, t in engine.tensors.items()}
        before = served(client)
        cancelled: list[bool] = []

        def cancel_after_bucket_1(p: SyncProgress) -> None:
            if p.buckets_sent == 2:
                t = threading.Thread(
                    target=lambda: cancelled.append(client.cancel("test cancel")[srv.address].cancelled)
                )
                t.start()
                t.join(30)

        with pytest.raises(SyncError) as e:
            client.sync(new.items(), "v1", transport="shared_memory", progress=cancel_after_bucket_1)
        assert cancelled == [True]
        assert e.value.stage == "broadcast", e.value
        st = status(stub)
        assert (st.weight_version, st.paused, st.HasField("update")) == ("", False, False)
        assert "test cancel" in st.last_error.message, st.last_error
        assert served(client) == before
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n
        wait_for(lambda: "r--s" not in mappings())  # the engine's reader unmapped as it stopped
        assert not listening_sockets()

        r = client.sync(new.items(), "v2", transport="shared_memory")
        got = served(client)[srv.address]
        assert got == sums(new, got, aliases) and r.engines[srv.address].buckets_verified == r.bucket_count


def test_a_connection_with_a_wrong_token_is_refused_and_the_sync_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """Another process connects to the trainer's socket while the engines are being prepared and sends a wrong
    token: it gets no descriptor (the trainer closes the connection and logs it); the sync applies."""
    aliases = synthetic.aliases("tiny")
    new = synthetic.build("tiny", seed=7)
    intruder = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.connect('\\0' + sys.argv[1])\n"
        "s.sendall(b'x' * 32)\n"
        "s.settimeout(20)\n"
        "msg, fds, _, _ = socket.recv_fds(s, 64, 4)\n"
        "print(len(msg), len(fds))\n"
    )
    answers: list[str] = []

    def intrude(phase: str) -> None:
        if phase != "prepared":  # the engines are armed; the trainer has not begun to send
            return
        (name,) = listening_sockets()
        p = subprocess.run([sys.executable, "-c", intruder, name], capture_output=True, text=True, timeout=30)
        answers.append(p.stdout.strip() or p.stderr[-500:])

    with tensor_server("tiny", seed=0) as (srv, _engine, stub), TrainerClient([srv.address], **SMALL) as client:
        r = client.sync(new.items(), "v1", transport="shared_memory", on_phase=intrude)
        assert answers == ["0 0"]  # the connection was closed: no bytes, no descriptor
        assert "a wrong token" in caplog.text
        got = served(client)[srv.address]
        assert got == sums(new, got, aliases) and r.engines[srv.address].buckets_verified == r.bucket_count
        assert status(stub).weight_version == "v1"


TRAINER = """
import os, signal, sys
from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import TrainerClient

def die(p):
    if p.buckets_sent == 2:  # buckets 0 and 1 copied out; bucket 2 is in its slot
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

client = TrainerClient([sys.argv[1]], bucket_bytes=32 << 10, ramp_bytes=0, solo_bytes=64 << 10)
tensors = synthetic.build("tiny", seed=7)
if sys.argv[2] == "shared":  # the zero-copy path: the engine reads the trainer's own storages
    tensors = {n: t.share_memory_() for n, t in tensors.items()}
client.sync(tensors.items(), "v1", transport="shared_memory", progress=die)
print("not killed", flush=True)
"""


@pytest.mark.parametrize("tensors", ["packed", "shared"])
def test_a_trainer_sigkilled_mid_update_leaves_the_engine_its_weights_and_nothing_behind(tensors: str) -> None:
    """A trainer process SIGKILLs itself once bucket 1 was copied out (or, ``shared``, read from its storages): the
    engine notices (the socket closed under its reader), abandons the update with its old weights served, holds no
    mapping or descriptor of the segment or of a storage, and ``/dev/shm`` is as it was."""
    shm_before = dev_shm()
    storage_fds = torch_shm_fds()
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        old = {n: t.clone() for n, t in engine.tensors.items()}
        p = subprocess.run(
            [sys.executable, "-c", TRAINER, srv.address, tensors], capture_output=True, text=True, timeout=60, env=ENV
        )
        assert p.returncode == -signal.SIGKILL and "dying" in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])

        def abandoned() -> bool:
            st = status(stub)
            return not st.HasField("update") and bool(st.last_error.reason)

        wait_for(abandoned)
        st = status(stub)
        # Whichever the engine noticed first: the trainer's Watch call ending, or its socket closing under the reader.
        assert st.last_error.reason in ("PEER_LOST", "SHARED_MEMORY_TRAINER_LOST"), st.last_error
        assert (st.weight_version, st.paused, st.dirty) == ("", False, False), st
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n
        wait_for(lambda: mappings() == {})
        assert segment_fds() == 0 and torch_shm_fds() == storage_fds
        assert not listening_sockets()
    assert dev_shm() == shm_before


def segments_held(pid: int) -> int:
    """The mappings and descriptors of shared-memory segments process ``pid`` holds."""
    held = sum(SEGMENT in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SEGMENT)
    return held


@pytest.mark.parametrize("policy", ["fail", "exclude"])
def test_an_engine_process_sigkilled_mid_sync_fails_it_or_is_left_out_per_the_fleet_policy(
    tmp_path: Path, policy: str
) -> None:
    """Two ``wsync serve`` engine processes (the tiny synthetic model in float32) take v1 through shared memory;
    during v2's, one of them is SIGKILLed once bucket 1 was copied out everywhere (as the broadcast fleet tests kill
    one mid-broadcast). The trainer's ring loses that reader at once: under ``fail`` the sync fails naming it,
    published nowhere, and the survivor serves v1 whole; under ``exclude`` (``min_fraction=0.5``) the update runs
    again on the survivor alone, which serves v2 bit-exact. Either way the trainer returns within seconds, the
    survivor holds no mapping or descriptor of a segment, no handover socket is left, and ``/dev/shm`` is as it
    was."""
    shm_before = dev_shm()
    args = ["--synthetic", "tiny", "--dtype", "float32", "--grace", "1"]
    engines = [
        spawn_engine(args, port_file=tmp_path / f"e{i}.port", log=tmp_path / f"e{i}.log", env=ENV, cwd=ROOT, wait=False)
        for i in range(2)
    ]
    try:
        wait_all(engines)
        survivor, victim = engines
        v1, v2 = (synthetic.build("tiny", seed=s, dtype=torch.float32) for s in (1, 2))
        killed: list[float] = []

        def kill_after_bucket_1(p: SyncProgress) -> None:
            if p.buckets_sent == 2 and not killed:
                victim.kill()
                killed.append(time.monotonic())

        fleet = FleetPolicy.exclude(min_fraction=0.5) if policy == "exclude" else FleetPolicy()
        targets = [e.target for e in engines]
        with TrainerClient(targets, rpc_timeout_s=30, group_timeout_s=60, policy=fleet, **SMALL) as client:
            client.sync(v1.items(), "v1", transport="shared_memory")
            assert_serve(targets, "v1", v1)
            if policy == "fail":
                with pytest.raises(SyncError) as e:
                    client.sync(v2.items(), "v2", transport="shared_memory", progress=kill_after_bucket_1)
                ended = time.monotonic()
                assert victim.target in e.value.failures and e.value.published == "none", e.value
                assert not e.value.results and e.value.stage in ("broadcast", "verify"), e.value
                assert_serve([survivor.target], "v1", v1)
            else:
                r = client.sync(v2.items(), "v2", transport="shared_memory", progress=kill_after_bucket_1)
                ended = time.monotonic()
                assert list(r.excluded) == [victim.target] and r.attempts == 2, r
                assert list(r.engines) == [survivor.target] and client.group is None
                assert r.engines[survivor.target].buckets_verified == r.bucket_count
                assert_serve([survivor.target], "v2", v2)
            assert killed and ended - killed[0] < 10, "the trainer took too long to notice the dead engine"
            with TrainerClient([survivor.target], rpc_timeout_s=30) as reader:
                (st,) = reader.status().values()
            assert (st.dirty, st.paused, st.update) == (False, False, None), st
            assert segments_held(survivor.pid) == 0 and not listening_sockets() and "r--s" not in mappings()
    finally:
        stop_all(engines, grace_s=2)
    assert dev_shm() == shm_before


HOLDER = """
import sys
from wsync_grpc.transports.shared_memory.protocol import boot_id
from wsync_grpc.transports.shared_memory.handover import Handover, Segment
h = Handover(Segment(4096, 2), "u1").handle(boot_id())
print(h.socket_name, h.token.hex(), h.slot_bytes, h.slots, flush=True)
sys.stdin.read()  # until it is killed
"""


def test_a_trainer_process_killed_while_a_worker_waits_ends_the_receive_and_unmaps() -> None:
    """The engine half alone, without a trainer client (whose Watch call would tell the engine first): a trainer
    process hands its segment over to a real receiver thread, which maps it and waits for bucket 0; SIGKILLed, the
    trainer's socket closes under it: the receive ends with UNAVAILABLE SHARED_MEMORY_TRAINER_LOST, nothing loaded,
    the segment unmapped and no descriptor of it left."""
    engine = TensorEngine(synthetic.build("tiny", seed=0), aliases=synthetic.aliases("tiny"))
    name, t = next(iter(engine.tensors.items()))
    slot = TensorSlot(name, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size(), name)
    bucket = Bucket(0, slot.nbytes, (slot,))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        assert holder.stdout is not None
        socket_name, token, slot_bytes, slots = holder.stdout.readline().split()
        handle = SharedMemoryHandle(socket_name, bytes.fromhex(token), boot_id(), int(slot_bytes), int(slots))
        receiver = one_bucket_receiver(engine, bucket, handle, timeout_s=30)
        assert isinstance(receiver, SharedMemoryReceiver)
        receiver.start()
        assert receiver.armed.wait(20) and receiver.error is None, receiver.error
        # Mapped read-only; the descriptor received closed (Python's mmap keeps a duplicate until it unmaps).
        assert receiver.mapped and mappings() == {"r--s": 1} and segment_fds() == 1
        holder.kill()
        assert receiver.done.wait(20)
        assert isinstance(receiver.error, Unavailable), receiver.error
        assert receiver.error.reason == "SHARED_MEMORY_TRAINER_LOST", receiver.error
        assert (receiver.buckets_done, receiver.tensors_applied, receiver.wrote_served) == (0, 0, False)
        assert not receiver.mapped and mappings() == {} and segment_fds() == 0
    finally:
        holder.kill()
        holder.wait(30)


# ----------------------------------------------------------------------------- zero copy: the trainer's own storages

TORCH_SHM = "/dev/shm/torch_"
"""How torch's shared-memory storages (``file_descriptor`` strategy) show as the target of a descriptor."""


def torch_shm_fds() -> int:
    """This process's descriptors of torch shared-memory storages (torch keeps one per storage it shared), counted
    after a garbage collection: a storage an earlier test left in a reference cycle (its error's traceback) would
    otherwise be freed, and its descriptor closed, between two counts of a later test."""
    gc.collect()
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(TORCH_SHM)
    return n


def storage_mappings() -> dict[str, int]:
    """This process's mappings of torch shared-memory storages by permissions (torch's own are ``rw-s``; an engine
    never maps one)."""
    found: dict[str, int] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        if TORCH_SHM in line:
            perms = line.split()[1]
            found[perms] = found.get(perms, 0) + 1
    return found


def in_one_shared_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``tensors`` again, as views of one flat ``uint8`` buffer moved to shared memory (each at an offset aligned
    for its dtype), and that buffer."""
    offsets, end = {}, 0
    for n, t in tensors.items():
        end = -(-end // 64) * 64
        offsets[n] = end
        end += t.numel() * t.element_size()
    flat = torch.zeros(end, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    out = {}
    for n, t in tensors.items():
        v = flat[offsets[n] : offsets[n] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        v.copy_(t)
        out[n] = v
    return out, flat


def sm_sender(client: TrainerClient) -> shared_memory.sender.SharedMemorySender:
    sender = client._senders.of(shared_memory.PART)
    assert isinstance(sender, shared_memory.sender.SharedMemorySender)
    return sender


@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_a_model_in_shared_memory_is_read_from_its_storages_not_packed(apply_mode: ApplyModeName) -> None:
    """Every parameter ``share_memory_()``d in the wire dtype (one storage each): no bucket is packed, every one is
    read by the engine from the trainer's storages; bit-exact by checksums and every bucket's digest; the engine
    neither maps a storage nor keeps a descriptor of one, and the trainer's handed-over read-only descriptors are
    closed."""
    aliases = synthetic.aliases("tiny")
    new = {n: t.share_memory_() for n, t in synthetic.build("tiny", seed=7).items()}  # type: ignore[no-untyped-call]
    fds_before = torch_shm_fds()
    assert fds_before >= len(new) and storage_mappings().get("r--s", 0) == 0
    with tensor_server("tiny", seed=0) as (srv, engine, stub), TrainerClient([srv.address], **SMALL) as client:
        r = client.sync(new.items(), "v1", apply_mode=apply_mode, transport="shared_memory")
        counts = sm_sender(client).last_send
        assert (counts.packed_buckets, counts.packed_bytes) == (0, 0)
        assert (counts.storage_buckets, counts.storage_bytes) == (r.bucket_count, r.wire_bytes)
        assert r.bucket_count > 3 and r.pack_seconds == 0
        assert r.engines[srv.address].buckets_verified == r.bucket_count
        got = served(client)[srv.address]
        assert got == sums(new, got, aliases)
        for n, t in new.items():
            assert torch.equal(engine.tensors[n], t), n
        assert status(stub).weight_version == "v1"
        assert torch_shm_fds() == fds_before  # no engine or handover descriptor left, torch's own kept
        assert storage_mappings().get("r--s", 0) == 0  # never mapped by the engine
        assert mappings() == {"rw-s": 1} and segment_fds() == TRAINER_FDS  # the ring, kept, as before


def test_shared_and_unshared_tensors_mixed_in_one_sync_bit_exact() -> None:
    """The embedding (a bucket alone) and one layer's tensors in shared memory, the rest not, one bucket holding
    both kinds: the buckets whose tensors are all shared are read from their storages (views of one flat storage,
    at offsets of its own), the others packed into the ring; bit-exact, digests verified. With the path turned off,
    the same tensors all go through the ring (the client's ``shared_memory_zero_copy``, assigned)."""
    aliases = synthetic.aliases("tiny")
    base = synthetic.build("tiny", seed=7)
    shared_part = {n: t for n, t in base.items() if "embed" in n or ".layers.1." in n}
    views, flat = in_one_shared_storage(shared_part)
    new = {n: views.get(n, t) for n, t in base.items()}
    with tensor_server("tiny", seed=0) as (srv, engine, _stub), TrainerClient([srv.address], **SMALL) as client:
        r = client.sync(new.items(), "v1", transport="shared_memory")
        counts = sm_sender(client).last_send
        assert counts.storage_buckets >= 2 and counts.packed_buckets >= 2
        assert counts.storage_buckets + counts.packed_buckets == r.bucket_count
        assert counts.storage_bytes + counts.packed_bytes == r.wire_bytes
        assert r.engines[srv.address].buckets_verified == r.bucket_count
        got = served(client)[srv.address]
        assert got == sums(new, got, aliases)
        for n, t in new.items():
            assert torch.equal(engine.tensors[n], t), n

        client.shared_memory_zero_copy = False
        newer = {n: t.clone() + 1 for n, t in base.items()}
        r2 = client.sync(newer.items(), "v2", transport="shared_memory")
        assert sm_sender(client).last_send.storage_buckets == 0
        got = served(client)[srv.address]
        assert got == sums(newer, got, aliases) and r2.engines[srv.address].buckets_verified == r2.bucket_count
    del flat


def test_with_zero_copy_off_a_model_in_shared_memory_is_packed_into_the_ring(
    make_tiny_llama: Any, smollm2_tokenizer: Any
) -> None:
    """``TrainerClient(shared_memory_zero_copy=False)``: a ``share_memory()``'d module (a tiny Llama, every parameter
    in shared memory, synced in its own dtype) has every bucket packed into the ring, none read from its storages,
    into a reference engine behind a real server, bit-exact, digests verified; the engine got no descriptor of a
    storage. Assigned back on, the next sync of the same module reads every bucket from its storages."""
    trained = make_tiny_llama(seed=3)
    trained.share_memory()
    fds_before = torch_shm_fds()
    assert fds_before >= len(list(trained.parameters()))
    with (
        ReferenceEngine(make_tiny_llama(seed=0), smollm2_tokenizer, name="tiny") as engine,
        in_process_server(engine) as (srv, stub),
        TrainerClient([srv.address], shared_memory_zero_copy=False, **SMALL) as client,
    ):
        assert client.shared_memory_zero_copy is False
        r = client.sync(trained.named_parameters(), "v1", transport="shared_memory")
        counts = sm_sender(client).last_send
        assert sm_sender(client).storages is False
        assert (counts.storage_buckets, counts.storage_bytes) == (0, 0)
        assert (counts.packed_buckets, counts.packed_bytes) == (r.bucket_count, r.wire_bytes)
        assert r.bucket_count > 3 and r.pack_seconds > 0
        assert r.engines[srv.address].buckets_verified == r.bucket_count
        want = {n: tensor_sha256(t) for n, t in trained.state_dict().items()}
        got = served(client)[srv.address]
        assert got == {n: want[n] for n in got} and status(stub).weight_version == "v1"
        assert torch_shm_fds() == fds_before and storage_mappings().get("r--s", 0) == 0

        client.shared_memory_zero_copy = True  # from the next sync on
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(1)  # in place: the storages stay shared
        r2 = client.sync(trained.named_parameters(), "v2", transport="shared_memory")
        counts = sm_sender(client).last_send
        assert (counts.packed_buckets, counts.storage_buckets) == (0, r2.bucket_count) and r2.pack_seconds == 0
        want = {n: tensor_sha256(t) for n, t in trained.state_dict().items()}
        got = served(client)[srv.address]
        assert got == {n: want[n] for n in got} and r2.engines[srv.address].buckets_verified == r2.bucket_count
        assert torch_shm_fds() == fds_before


@pytest.mark.parametrize("cancel_first", [False, True], ids=["engine-first", "cancel-first"])
def test_a_storage_truncated_under_the_engines_read_fails_cleanly_with_the_old_weights_kept(
    monkeypatch: pytest.MonkeyPatch, cancel_first: bool
) -> None:
    """The trainer's storage is truncated to nothing (by its owner's descriptor) after the engine checked its size
    and before it reads: the read comes short, the engine fails the update with DATA_LOSS SHARED_MEMORY_STORAGE (no
    crash: it never mapped the storage), keeps serving its old weights and holds no descriptor; the next sync
    applies. ``cancel_first``: the engine hears of its receiver's end a second late, so the trainer's Cancel (its
    send broke when the receiver quit) comes first; the engine and the trainer's error still name the finding."""
    from wsync_grpc.service.session import UpdateSession
    from wsync_grpc.transports.shared_memory import storages

    if cancel_first:
        heard = UpdateSession._on_receiver_event

        def late(self: Any, r: Any) -> None:
            if r.error is not None:
                time.sleep(1.0)
            heard(self, r)

        monkeypatch.setattr(UpdateSession, "_on_receiver_event", late)

    aliases = synthetic.aliases("tiny")
    base = synthetic.build("tiny", seed=7)
    new, flat = in_one_shared_storage(base)
    owner_fd, size = flat.untyped_storage()._share_fd_cpu_()
    fds_before = torch_shm_fds()
    original = storages.StorageReader._read
    truncated: list[int] = []

    def truncate_first(self: Any, bucket: Bucket, *args: Any) -> None:
        if not truncated:
            truncated.append(bucket.index)
            os.ftruncate(owner_fd, 0)  # the owner shrinks its storage under the engine's read
            try:
                original(self, bucket, *args)
            finally:
                os.ftruncate(owner_fd, size)  # the trainer's mapping is whole again (zeros) before it is touched
            return
        original(self, bucket, *args)

    monkeypatch.setattr(storages.StorageReader, "_read", truncate_first)
    with tensor_server("tiny", seed=0) as (srv, engine, stub), TrainerClient([srv.address], **SMALL) as client:
        client.digests = False  # the trainer would hash the storage it shrank meanwhile
        old = {n: t.clone() for n, t in engine.tensors.items()}
        before = served(client)
        with pytest.raises(SyncError) as e:
            client.sync(new.items(), "v1", transport="shared_memory")
        assert truncated == [0]
        st = status(stub)
        assert (st.weight_version, st.dirty, st.HasField("update")) == ("", False, False), st
        assert st.last_error.reason == "SHARED_MEMORY_STORAGE", st.last_error
        assert "could be read" in st.last_error.message, st.last_error
        assert "SHARED_MEMORY_STORAGE" in str(e.value)
        assert served(client) == before
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n
        wait_for(lambda: torch_shm_fds() == fds_before)  # the engine's descriptors closed
        assert storage_mappings().get("r--s", 0) == 0

        monkeypatch.setattr(storages.StorageReader, "_read", original)
        fresh, flat2 = in_one_shared_storage(synthetic.build("tiny", seed=9))
        client.digests = True
        r = client.sync(fresh.items(), "v2", transport="shared_memory")
        got = served(client)[srv.address]
        assert got == sums(fresh, got, aliases) and r.engines[srv.address].buckets_verified == r.bucket_count
    del flat, flat2


def test_the_engines_storage_checks_refuse_a_short_storage_and_a_non_file(tmp_path: Path) -> None:
    """The engine half's checks alone: a storage smaller than its reads need, a read that comes short (the file
    ended), a descriptor that is not a regular file: each a clean error naming the bucket; a descriptor open for
    writing is re-opened read-only."""
    from wsync_grpc.core.errors import DataLoss, InvalidArgument
    from wsync_grpc.transports.shared_memory.storages import StorageRead, StorageReader, fcntl_mode

    slot = TensorSlot("w", torch.uint8, (64,), 0, 64, "w")
    bucket = Bucket(3, 64, (slot,))
    fd = os.memfd_create("wsync-test-storage", os.MFD_CLOEXEC)
    r, w = os.pipe()
    try:
        os.ftruncate(fd, 32)
        with pytest.raises(DataLoss) as e:
            StorageReader._check(bucket, [fd], [StorageRead(0, 0, 0, 64)])
        assert e.value.reason == "SHARED_MEMORY_STORAGE" and "holds 32 bytes" in e.value.message
        dst = torch.zeros(64, dtype=torch.uint8)
        reader = StorageReader(None, threading.Event(), 1.0)  # type: ignore[arg-type]
        with pytest.raises(DataLoss) as e:
            reader._read(bucket, [fd], [StorageRead(0, 0, 0, 64)], memoryview(dst.numpy()))  # type: ignore[arg-type]
        assert e.value.reason == "SHARED_MEMORY_STORAGE" and "only 32 of 64 bytes" in e.value.message
        with pytest.raises(InvalidArgument) as e2:
            StorageReader._check(bucket, [r], [StorageRead(0, 0, 0, 64)])
        assert e2.value.reason == "SHARED_MEMORY_STORAGE"
        ro = reader._read_only(os.dup(fd))  # a read-write descriptor: re-opened read-only, the other closed
        try:
            assert fcntl_mode(ro) == os.O_RDONLY
        finally:
            os.close(ro)
    finally:
        for x in (fd, r, w):
            os.close(x)


def test_an_engine_not_told_of_storages_refuses_a_grant_that_offers_them() -> None:
    """A trainer offering storages uses another grant magic: an engine whose handle does not say ``storages`` (as
    an engine of a wsync without the path reads it) refuses the grant before any byte, DATA_LOSS
    SHARED_MEMORY_PROTOCOL, and holds nothing."""
    from wsync_grpc.core.errors import DataLoss
    from wsync_grpc.transports.shared_memory.handover import Handover, Segment

    engine = TensorEngine(synthetic.build("tiny", seed=0), aliases=synthetic.aliases("tiny"))
    name, t = next(iter(engine.tensors.items()))
    slot = TensorSlot(name, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size(), name)
    bucket = Bucket(0, slot.nbytes, (slot,))
    segment = Segment(4096 * 64, 2)
    handover = Handover(segment, "u1", storages=True)
    try:
        h = handover.handle(boot_id())
        assert h.storages
        old_style = SharedMemoryHandle(h.socket_name, h.token, h.boot_id, h.slot_bytes, h.slots)
        receiver = one_bucket_receiver(engine, bucket, old_style, timeout_s=10)
        receiver.start()
        assert receiver.done.wait(20)
        assert isinstance(receiver.error, DataLoss) and receiver.error.reason == "SHARED_MEMORY_PROTOCOL"
        assert "WSYNCSH2" in receiver.error.message
        assert receiver.buckets_done == 0 and mappings() == {"rw-s": 1}  # the trainer's own only
    finally:
        handover.close()
        segment.close()


def test_the_engines_threaded_read_of_large_storages_is_exact() -> None:
    """Reads large enough to be cut in pieces and shared between the read threads land byte for byte where the
    bucket puts them, from two storages at offsets of their own."""
    from wsync_grpc.transports.shared_memory.storages import CHUNK_BYTES, StorageRead, StorageReader

    a = torch.randint(0, 256, (3 * CHUNK_BYTES + 123,), dtype=torch.uint8)
    b = torch.randint(0, 256, (CHUNK_BYTES + 7,), dtype=torch.uint8)
    fds = []
    for t in (a, b):
        fd = os.memfd_create("wsync-test-storage", os.MFD_CLOEXEC)
        os.write(fd, t.numpy().tobytes())
        fds.append(fd)
    reads = [StorageRead(0, 100, 0, a.numel() - 100), StorageRead(1, 0, a.numel() - 100 + 16, b.numel())]
    dst = torch.zeros(reads[1].bucket_offset + b.numel(), dtype=torch.uint8)
    reader = StorageReader(None, threading.Event(), 5.0)  # type: ignore[arg-type]
    try:
        reader._read(Bucket(0, dst.numel(), ()), fds, reads, memoryview(dst.numpy()))  # type: ignore[arg-type]
        assert torch.equal(dst[: a.numel() - 100], a[100:])
        assert torch.equal(dst[reads[1].bucket_offset :], b)
    finally:
        reader.close()
        for fd in fds:
            os.close(fd)
