"""A transport is an addition (issue 41, item 9): a transport written under ``tests/`` and registered by a fixture
with one line carries real updates end to end, and nothing of ``wsync_grpc`` was changed or mocked for it.

The transport is :mod:`spool_transport` (``tests/spool_transport.py``): the trainer writes each bucket to a file,
each engine worker reads it. The fixture :func:`spool` is the whole registration: the spool directory, and
``TRANSPORTS[Transport.CUDA_IPC] = "spool_transport"`` (the contract's enum is fixed: the transport borrows the
reserved value every engine answers UNIMPLEMENTED otherwise). Real gRPC servers on loopback ports serving
synthetic :class:`TensorEngine` s and a reference engine (a tiny Llama); a real :class:`TrainerClient` running a
:class:`~spool_transport.SpoolRequest` (``TrainerClient.run_update``); checked against the engines' own
``GetWeightChecksums``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import spool_transport
import torch
from spool_transport import SpoolRequest, SpoolTransport
from support import ROOT, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc import transports
from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.errors import Unimplemented
from wsync_grpc.core.layout import Transport
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.reference import ReferenceEngine
from wsync_grpc.testing import in_process_server
from wsync_grpc.trainer import SyncError, SyncProgress, TrainerClient
from wsync_grpc.trainer.source import NamedTensors
from wsync_grpc.transports.cuda_ipc import CudaIpcTransport

pytestmark = pytest.mark.timeout(120)

SMALL = {"bucket_bytes": 32 << 10, "ramp_bytes": 0, "solo_bytes": 64 << 10}
"""Client settings that cut the tiny synthetic model in several buckets: the embedding alone, the rest packed."""


@pytest.fixture
def spool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The spool transport registered for one test; yields its directory (empty again once every client closed)."""
    directory = tmp_path / "spool"
    directory.mkdir()
    monkeypatch.setattr(spool_transport, "SPOOL_DIR", directory)
    monkeypatch.setitem(transports.TRANSPORTS, Transport.CUDA_IPC, "spool_transport")
    yield directory


def request(version: str, apply_mode: str = "staged", **kw: Any) -> SpoolRequest:
    r = SpoolRequest.create(version, kw.pop("layout", "flattened"), apply_mode, SMALL["bucket_bytes"], **kw)
    assert isinstance(r, SpoolRequest) and r.transport is Transport.CUDA_IPC
    return r


def sums(tensors: dict[str, torch.Tensor], names: Any, aliases: dict[str, str]) -> dict[str, str]:
    """The SHA-256 the engine should report for each of ``names``, from the trainer's ``tensors``."""
    return {n: tensor_sha256(tensors[aliases.get(n, n)]) for n in names}


def served(client: TrainerClient) -> dict[str, dict[str, str]]:
    """Every engine's ``GetWeightChecksums``: target -> name -> SHA-256."""
    return {t: c.by_name for t, c in client.checksums().items()}


def test_the_registry_line_is_all_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the line the reserved slot is the shipped placeholder; with it, the test's part; wsync_grpc never
    names the test module."""
    assert isinstance(transports.transport_for(Transport.CUDA_IPC), CudaIpcTransport)
    with monkeypatch.context() as m:
        m.setitem(transports.TRANSPORTS, Transport.CUDA_IPC, "spool_transport")
        assert transports.transport_for(Transport.CUDA_IPC) is spool_transport.PART
    assert isinstance(transports.transport_for(Transport.CUDA_IPC), CudaIpcTransport)
    shipped = [p for p in (ROOT / "wsync_grpc").rglob("*.py") if "spool_transport" in p.read_text()]
    assert not shipped, shipped


def test_unregistered_the_request_is_refused_and_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same request without a registry line for its transport (the slot it borrows emptied: CUDA IPC's own part
    serves it otherwise): UNIMPLEMENTED, no byte written, the engine untouched."""
    monkeypatch.delitem(transports.TRANSPORTS, Transport.CUDA_IPC)
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, _engine, stub), TrainerClient([srv.address], **SMALL) as client:  # type: ignore[arg-type]
        before = served(client)
        with pytest.raises(Unimplemented) as e:  # the trainer half: no part serves the transport
            client.run_update(NamedTensors(new.items()), request("v1"))
        assert e.value.reason == "TRANSPORT_UNIMPLEMENTED", e.value
        header = pb.PrepareHeader(weight_version="v1", transport=pb.TRANSPORT_CUDA_IPC, bucket_count=1)
        with pytest.raises(grpc.RpcError) as rpc:  # the engine half: no part serves the header's transport
            stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
        assert rpc.value.code() == grpc.StatusCode.UNIMPLEMENTED, rpc.value
        assert served(client) == before and status(stub).weight_version == ""


@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_a_spool_update_is_served_bit_exact_by_every_engine(spool: Path, apply_mode: str) -> None:
    """Two engines (one receiver thread each) read the same files; every bucket verified against the digest the
    trainer declared; no group is formed; the files are the trainer's to remove."""
    assert transports.transport_for(Transport.CUDA_IPC) is spool_transport.PART
    aliases = synthetic.aliases("tiny")
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (a, ea, sa),
        tensor_server("tiny", seed=1) as (b, eb, sb),
        TrainerClient([a.address, b.address], **SMALL) as client,  # type: ignore[arg-type]
    ):
        progress: list[SyncProgress] = []
        phases: list[str] = []
        req = request("v1", apply_mode, progress=progress.append, on_phase=phases.append)
        r = client.run_update(NamedTensors(new.items()), req)
        assert r.bucket_count > 3 and r.apply_mode == apply_mode and r.weight_version == "v1"
        assert [p.buckets_sent for p in progress] == list(range(1, r.bucket_count + 1))
        assert phases[0] == "planned" and phases[-1] == "applied"
        assert {t: e.buckets_verified for t, e in r.engines.items()} == {
            a.address: r.bucket_count,
            b.address: r.bucket_count,
        }
        assert {t: e.weight_version for t, e in r.engines.items()} == {a.address: "v1", b.address: "v1"}
        got = served(client)
        assert got == {t: sums(new, got[t], aliases) for t in (a.address, b.address)}
        assert {t: c.weight_version for t, c in client.checksums().items()} == {a.address: "v1", b.address: "v1"}
        for engine, stub in ((ea, sa), (eb, sb)):
            for n, t in new.items():
                assert torch.equal(engine.tensors[n], t), n
            st = status(stub)
            assert (st.weight_version, st.state, st.paused) == ("v1", pb.LIFECYCLE_STATE_UNINITIALIZED, False)
        assert client.group is None  # the transport needs none: nothing was formed
        written = sorted(p.name for p in (spool / req.update_id).iterdir())
        assert written == sorted(f"{i}.bin" for i in range(r.bucket_count))  # no temporary left behind

        newer = synthetic.build("tiny", seed=8)
        req2 = request("v2", apply_mode)
        client.run_update(NamedTensors(newer.items()), req2)
        got = served(client)
        assert got == {t: sums(newer, got[t], aliases) for t in (a.address, b.address)}
        assert [p.name for p in spool.iterdir()] == [req2.update_id]  # v1's files went when v2 began
    assert not list(spool.iterdir())  # the client's close removed the rest


def test_a_byte_flipped_in_a_spool_file_is_refused_and_the_old_weights_stay(
    spool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's test hook flips a byte of bucket 1's file after hashing it: the engine refuses the bucket
    (DATA_LOSS, BUCKET_DIGEST_MISMATCH) and serves its old weights and version; a clean update then applies."""
    aliases = synthetic.aliases("tiny")
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        old = {n: t.clone() for n, t in engine.tensors.items()}
        with monkeypatch.context() as m:
            m.setattr(spool_transport, "PART", SpoolTransport(corrupt=1))
            with TrainerClient([srv.address], **SMALL) as client:  # type: ignore[arg-type]
                before = served(client)
                with pytest.raises(SyncError) as e:
                    client.run_update(NamedTensors(new.items()), request("v1"))
                assert served(client) == before
        failure = e.value.failures[srv.address]
        assert failure.reason == "BUCKET_DIGEST_MISMATCH", e.value
        assert "bucket 1 arrived corrupted" in failure.message, failure
        if failure.rpc == "Complete":
            assert failure.code == grpc.StatusCode.DATA_LOSS and failure.metadata["bucket"] == "1"
        st = status(stub)
        assert (st.weight_version, engine.weight_version, st.last_error.reason) == ("", "", "BUCKET_DIGEST_MISMATCH")
        assert not st.dirty and not st.paused
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n
        assert not list(spool.iterdir())  # the abandoned update's files went with it

        with TrainerClient([srv.address], **SMALL) as client:  # type: ignore[arg-type]
            client.run_update(NamedTensors(new.items()), request("v2"))
            got = served(client)[srv.address]
            assert got == sums(new, got, aliases) and status(stub).weight_version == "v2"


def test_a_cancel_mid_update_stops_writer_and_readers_and_the_old_weights_stay(spool: Path) -> None:
    """``cancel()`` once bucket 1 is in the spool: the trainer writes no further bucket, the engine's reader (waiting
    for bucket 2's file) stops, the update is abandoned with the old weights served; the next one applies."""
    aliases = synthetic.aliases("tiny")
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, engine, stub), TrainerClient([srv.address], **SMALL) as client:  # type: ignore[arg-type]
        old = {n: t.clone() for n, t in engine.tensors.items()}
        before = served(client)
        cancelled: list[bool] = []

        def cancel_after_bucket_1(p: SyncProgress) -> None:
            if p.buckets_sent == 2:  # buckets 0 and 1 are written
                t = threading.Thread(
                    target=lambda: cancelled.append(client.cancel("test cancel")[srv.address].cancelled)
                )
                t.start()
                t.join(30)

        req = request("v1", progress=cancel_after_bucket_1)
        with pytest.raises(SyncError) as e:
            client.run_update(NamedTensors(new.items()), req)
        assert cancelled == [True]
        assert e.value.stage == "broadcast", e.value
        assert not list(spool.iterdir())  # abandoned: the sender removed what it wrote
        st = status(stub)
        assert (st.weight_version, st.paused, st.HasField("update")) == ("", False, False)
        assert "test cancel" in st.last_error.message, st.last_error
        assert served(client) == before
        for n, t in engine.tensors.items():
            assert torch.equal(t, old[n]), n

        r = client.run_update(NamedTensors(new.items()), request("v2"))
        got = served(client)[srv.address]
        assert got == sums(new, got, aliases) and r.engines[srv.address].buckets_verified == r.bucket_count


def test_the_engine_half_checks_the_header(spool: Path) -> None:
    """The part's header check runs on the engine: an individual layout is refused at Prepare, nothing changes."""
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, _engine, stub), TrainerClient([srv.address], **SMALL) as client:  # type: ignore[arg-type]
        before = served(client)
        with pytest.raises(SyncError) as e:
            client.run_update(NamedTensors(new.items()), request("v1", layout="individual"))
        assert e.value.stage == "prepare" and e.value.failures[srv.address].reason == "SPOOL_LAYOUT", e.value
        assert served(client) == before and status(stub).weight_version == ""
        assert not list(spool.iterdir())


def test_a_reference_engine_serves_a_spool_update(spool: Path, make_tiny_llama: Any, smollm2_tokenizer: Any) -> None:
    """The reference engine (a tiny Llama behind a real server) takes a streaming spool update bit-exact and
    generates with it."""
    new = make_tiny_llama(seed=1)
    with (
        ReferenceEngine(make_tiny_llama(seed=0), smollm2_tokenizer, name="tiny") as engine,
        in_process_server(engine) as (srv, stub),
        TrainerClient([srv.address]) as client,
    ):
        r = client.run_update(NamedTensors(new.named_parameters()), request("v1", "streaming"))
        assert r.engines[srv.address].buckets_verified == r.bucket_count
        trained = new.state_dict()
        got = served(client)[srv.address]
        assert got == {n: tensor_sha256(trained[n]) for n in got}
        assert status(stub).weight_version == "v1"
        assert engine.generate("What is the capital of France?", 4).weight_versions == ("v1",)
