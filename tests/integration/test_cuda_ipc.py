"""The CUDA IPC transport (issue 46): the colocated ring backed by GPU memory, opened by each engine worker by its
CUDA IPC handle.

On CPU (CI): the contract's new fields round trip (gRPC and the vLLM workers' msgpack plan); a real engine on a
loopback port refuses, before anything is connected or changed, a CUDA IPC update whose handle is malformed
(CUDA_IPC_HANDLE), names GPU memory for a shared-memory update (SHARED_MEMORY_HANDLE), or whose GPU is not the
engine's (a CPU engine: CUDA_IPC_DEVICE naming the UUID); a trainer whose tensors are on the CPU is refused before
any call; the CUDA runtime is found among the loaded libraries; the GPU check script refuses cleanly without CUDA.

With a GPU (marked ``cuda``, skipped without one, saying why): the trainer's ring on cuda:0 holds what is packed
and is freed (the CUDA runtime's calls through ctypes, one by one); a reference engine in another process on cuda:0 and
a trainer on the same GPU sync staged and streaming bit-exact (the check script's own run); an engine in the
trainer's process reads the trainer's ring through its own view (CUDA refuses to open a handle in the process that
exported it), and nothing stays mapped or allocated once the client closes.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support import status, tensor_server
from test_shared_memory import ring_fields
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc import transports
from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import CudaIpcMemory, SharedMemoryHandle, UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.messages import plan_from_msg, plan_to_msg
from wsync_grpc.core.update import Payload, ReceivePlan
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import in_process_server
from wsync_grpc.tools import cuda_ipc_check
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.transports import cuda_ipc
from wsync_grpc.transports.cuda_ipc.cudart import loaded_library
from wsync_grpc.transports.cuda_ipc.memory import locate
from wsync_grpc.wire.convert import header_from_proto, header_to_proto
from wsync_grpc.wire.status import error_info

pytestmark = pytest.mark.timeout(120)

NO_GPU = not torch.cuda.is_available()
cuda = pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is false here)")

UUID = "5f2b2a0e-1111-2222-3333-444455556666"
"""A GPU no host of the tests has."""


def memory(**fields: Any) -> pb.CudaIpcMemory:
    base: dict[str, Any] = {"device_uuid": UUID, "memory_handle": b"\1" * 64, "size_bytes": 2 << 20}
    return pb.CudaIpcMemory(**{**base, **fields})


def raw_prepare(stub: Any, transport: int, cuda: pb.CudaIpcMemory | None, **ring: Any) -> grpc.RpcError:
    """A Prepare of one bucket naming a ring of this host (its socket need not exist); its error."""
    fields = ring_fields(**ring)
    if cuda is not None:
        fields["cuda_ipc"] = cuda
    header = pb.PrepareHeader(
        weight_version="v1",
        transport=transport,
        bucket_count=1,
        total_bytes=128,
        shared_memory=pb.SharedMemoryHandle(**fields),
    )
    spec = pb.BucketSpec(index=0, size_bytes=128)
    spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64])
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Prepare(iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=30)
    return rpc.value


def test_the_registry_serves_the_part_and_the_handle_round_trips() -> None:
    part = transports.transport_for(Transport.CUDA_IPC)
    assert part is cuda_ipc.PART and not part.needs_group and not part.engine_builds_buckets
    m = CudaIpcMemory(UUID, bytes(range(64)), 0, 4 << 20)
    ring = SharedMemoryHandle("wsync-shm-x", b"t" * 32, "boot", 1 << 20, 2, cuda_ipc=m)
    h = UpdateHeader("u", "v1", Layout.FLATTENED, ApplyMode.STAGED, 1, 128, False, Transport.CUDA_IPC)
    h = dataclasses.replace(h, shared_memory=ring)
    wire = header_to_proto(h)
    assert wire.shared_memory.cuda_ipc.memory_handle == bytes(range(64))
    assert header_from_proto(pb.PrepareHeader.FromString(wire.SerializeToString())).shared_memory == ring
    plain = header_from_proto(
        header_to_proto(dataclasses.replace(h, shared_memory=dataclasses.replace(ring, cuda_ipc=None)))
    )
    assert plain.shared_memory is not None and plain.shared_memory.cuda_ipc is None  # unset: a memfd ring
    plan = ReceivePlan(
        Transport.CUDA_IPC, Payload.WEIGHTS, Layout.FLATTENED, ApplyMode.STAGED, (), True, shared_memory=ring
    )
    assert plan_from_msg(plan_to_msg(plan)).shared_memory == ring  # a vLLM worker gets the same handle


def test_the_engine_refuses_bad_cuda_ipc_handles_and_a_gpu_not_its_own() -> None:
    """Raw Prepare calls on a CPU engine: a malformed CUDA IPC description (CUDA_IPC_HANDLE), GPU memory named for a
    shared-memory update (SHARED_MEMORY_HANDLE), another boot (SHARED_MEMORY_HOST), and a well-formed handle whose
    GPU is not the engine's (CUDA_IPC_DEVICE, naming the UUID): INVALID_ARGUMENT, nothing connected or changed."""
    cases: list[tuple[int, pb.CudaIpcMemory | None, dict[str, Any], str]] = [
        (pb.TRANSPORT_CUDA_IPC, None, {}, "CUDA_IPC_HANDLE"),
        (pb.TRANSPORT_CUDA_IPC, memory(memory_handle=b"\1" * 63), {}, "CUDA_IPC_HANDLE"),
        (pb.TRANSPORT_CUDA_IPC, memory(size_bytes=(2 << 20) - 1), {}, "CUDA_IPC_HANDLE"),
        (pb.TRANSPORT_CUDA_IPC, memory(), {"storages": True}, "CUDA_IPC_HANDLE"),
        (pb.TRANSPORT_CUDA_IPC, memory(device_uuid=""), {}, "CUDA_IPC_DEVICE"),
        (pb.TRANSPORT_CUDA_IPC, memory(), {"boot_id": "00000000-0000-0000-0000-000000000000"}, "SHARED_MEMORY_HOST"),
        (pb.TRANSPORT_SHARED_MEMORY, memory(), {}, "SHARED_MEMORY_HANDLE"),
        (pb.TRANSPORT_CUDA_IPC, memory(device_uuid="GPU-" + UUID.upper()), {}, "CUDA_IPC_DEVICE"),
    ]
    with tensor_server("tiny", seed=0) as (_srv, engine, stub):
        old = {n: t.clone() for n, t in engine.tensors.items()}
        for transport, m, ring, reason in cases:
            err = raw_prepare(stub, transport, m, **ring)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (m, ring, err)
            assert error_info(err)[0] == reason, (m, ring, err)
        assert UUID in err.details() and "cpu" in err.details()  # the last: the device named, by its UUID
        st = status(stub)
        assert (st.weight_version, st.paused, st.dirty, st.HasField("update")) == ("", False, False, False)
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n


def test_locate_refuses_a_cpu_worker_naming_the_uuid() -> None:
    with pytest.raises(InvalidArgument) as e:
        locate(CudaIpcMemory("GPU-" + UUID, b"\0" * 64, 0, 1), torch.device("cpu"))
    assert e.value.reason == "CUDA_IPC_DEVICE" and e.value.metadata == {"device_uuid": UUID}


def test_a_trainer_with_cpu_tensors_is_refused_before_any_call() -> None:
    """``transport="cuda_ipc"`` with CPU tensors: ValueError saying to use shared memory, before any call (the
    engine has no owner, no update); a mixed fleet cannot mix CUDA IPC with another transport, nor carry a delta."""
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (a, _ea, sa),
        tensor_server("tiny", seed=1) as (b, _eb, _sb),
        TrainerClient([a.address, b.address]) as client,
    ):
        with pytest.raises(ValueError, match=r"live on a GPU.*transport='shared_memory'"):
            client.sync(new.items(), "v1", transport="cuda_ipc")
        with pytest.raises(ValueError, match="live on a GPU"):
            client.sync(new.items(), "v1", transport={a.address: "cuda_ipc", b.address: "cuda_ipc"})
        with pytest.raises(ValueError, match="mixes 'shared_memory' and 'broadcast' only"):
            client.sync(new.items(), "v1", transport={a.address: "cuda_ipc"})
        with pytest.raises(ValueError, match="deltas travel by broadcast or shared memory, not by 'cuda_ipc'"):
            client.sync(new.items(), "v1", transport="cuda_ipc", delta=True)
        st = status(sa)
        assert (st.weight_version, st.HasField("owner"), st.HasField("update"), st.updates_completed) == (
            "",
            False,
            False,
            0,
        )


def test_the_cuda_runtime_is_found_among_the_loaded_libraries() -> None:
    maps = (
        "7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
    )
    assert loaded_library(maps) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert loaded_library("7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n") is None
    # torchvision's own copy, mapped below PyTorch's (as transformers' import of it left it on the GPU machine)
    vendored = "7e00-7e01 r-xp 00000000 08:01 3 /venv/torchvision.libs/libcudart.faf08d9a.so.13\n"
    torchs = "7f02-7f03 r-xp 00000000 08:01 2 /venv/nvidia/cu13/lib/libcudart.so.13\n"
    assert loaded_library(vendored + torchs) == "/venv/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_library(vendored) == "/venv/torchvision.libs/libcudart.faf08d9a.so.13"


@pytest.mark.skipif(not NO_GPU, reason="this host has a GPU: the check runs (see test_the_gpu_check_passes)")
def test_the_gpu_check_refuses_cleanly_without_cuda(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cuda_ipc_check.main(["--out", str(tmp_path / "r.json")]) == cuda_ipc_check.EXIT_NO_CUDA
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no CUDA device" in err
    assert not (tmp_path / "r.json").exists()
    assert cuda_ipc_check.main(["--out", str(tmp_path / "no" / "r.json")]) == cuda_ipc_check.EXIT_USAGE


# ---------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@cuda
def test_the_cuda_ring_holds_what_is_packed_and_is_freed() -> None:
    """The trainer's ring on cuda:0 (cudaMalloc through ctypes, viewed by PyTorch, exported): its handle is 64 bytes
    naming this GPU, a slot packed on the current stream reads back bit-exact through the ring's view and through
    this process's own reader (CUDA refuses to open a handle in the process that exported it, which the runtime is
    tried too, and what it says printed), and close frees it."""
    from wsync_grpc.transports.cuda_ipc.cudart import CudaError, runtime
    from wsync_grpc.transports.cuda_ipc.memory import CUDA_RING, CudaIpcView, device_uuid

    dev = torch.device("cuda", 0)
    ring = CUDA_RING.allocate(1 << 20, 2, "cuda:0")
    try:
        m = ring.cuda_ipc
        assert m is not None and len(m.memory_handle) == 64 and m.size_bytes == 2 << 20 and m.offset_bytes == 0
        assert m.device_uuid == device_uuid(0) and locate(m, dev) == 0
        data = torch.randint(0, 256, (1000,), dtype=torch.uint8, device=dev)
        buf = ring.slot(1, 1000)
        assert buf.device == dev and buf.dtype == torch.uint8 and buf.is_contiguous()
        buf.copy_(data)
        ring.packed(1)
        assert torch.equal(ring.slot(1, 1000), data)
        out = torch.empty(1000, dtype=torch.uint8, device=dev)
        view = CudaIpcView(m, 0)  # the trainer's own ring: read through its view, nothing opened
        view.copy(1 << 20, out)
        assert torch.equal(out, data)
        assert view.close() is False
        rt = runtime()
        try:  # what CUDA says to opening a handle in its own process (the reason for the own view): printed
            with rt.on_device(0):
                rt.ipc_close(rt.ipc_open(m.memory_handle))
            said = "opened it"
        except CudaError as e:
            said = str(e)
        print(f"CUDA runtime {rt.path}; opening this process's own handle: {said}")
        # a refused call leaves nothing behind for PyTorch's next check of the runtime's last error to raise
        assert torch.equal((data.to(torch.int32) + 1).cpu(), data.cpu().to(torch.int32) + 1)
        torch.cuda.synchronize(dev)
    finally:
        ring.close()
    ring.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        ring.slot(0, 1)


@pytest.mark.cuda
@cuda
@pytest.mark.timeout(300)
def test_the_gpu_check_passes(tmp_path: Path) -> None:
    """A reference engine in another process on cuda:0, a trainer on the same GPU: 3 syncs by CUDA IPC (staged,
    streaming, staged), each bit-exact by the engine's checksums."""
    report = cuda_ipc_check.run_check(tmp_path / "report.json", tmp_path)
    assert [r["mode"] for r in report["rows"][:3]] == list(cuda_ipc_check.MODES)
    assert (tmp_path / "report.json").is_file()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_an_engine_in_the_trainers_process_reads_its_ring_bit_exact(apply_mode: str) -> None:
    """A tensor engine on cuda:0 in this process and a trainer on cuda:0: bit-exact by checksums, no receiver left
    with the ring open, the trainer's ring freed when the client closes."""
    dev = torch.device("cuda", 0)
    aliases = synthetic.aliases("tiny")
    tensors = {n: t.to(dev) for n, t in synthetic.build("tiny", seed=0).items()}
    new = {n: t.to(dev) for n, t in synthetic.build("tiny", seed=5).items()}
    engine = TensorEngine(tensors, aliases=aliases)
    with in_process_server(engine) as (srv, _stub):
        client = TrainerClient([srv.address], device=dev, bucket_bytes=32 << 10, ramp_bytes=0, solo_bytes=64 << 10)
        with client:
            r = client.sync(new.items(), "v1", apply_mode=apply_mode, transport="cuda_ipc")  # type: ignore[arg-type]
            assert r.bucket_count > 1
            got = client.checksums()[srv.address].by_name
            assert got == {n: tensor_sha256(new[aliases.get(n, n)]) for n in got}
            sender = client._senders._senders[Transport.CUDA_IPC]  # type: ignore[attr-defined]
            assert sender.segment is not None and sender.segment.place == "cuda:0"
        assert sender.segment is None  # released with the client
    assert threading.active_count() < 50
