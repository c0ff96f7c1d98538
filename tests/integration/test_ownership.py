"""One owner per engine: a second trainer is refused while the first lives, and never cancels its updates.

The owner is whoever presents the lease credential the engine issued it (the ``wsync-lease`` header),
not whoever sends its name. Real gRPC servers on loopback ports, real ``TrainerClient`` s (one of them a
child process that is SIGKILLed), the real ``wsync`` CLI for the operator's force, and raw stub calls:
each channel made by :func:`~wsync_grpc.testing.owner_channel` is one caller (it keeps the credential a
reply issues it), a plain channel presents none.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from support import ENV, ROOT, code_of, free_port, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.timeouts import ServerBounds
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.group.process_group import join_group
from wsync_grpc.service.server import WsyncServer
from wsync_grpc.testing import cli_command, in_process_server, owner_channel
from wsync_grpc.trainer import InitError, SyncError, TrainerClient
from wsync_grpc.transports.disk.writer import save_checkpoint
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (a dead owner's lease gone within 2 s): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial


def model(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(synthetic.build("tiny", seed=seed, dtype=torch.bfloat16).items())


def caller(srv: WsyncServer) -> weight_sync_pb2_grpc.WeightSyncServiceStub:
    """A stub of a caller of its own (its own channel, keeping the credential a reply issues it)."""
    return weight_sync_pb2_grpc.WeightSyncServiceStub(owner_channel(srv.address))


@pytest.mark.timeout(180)
def test_a_second_trainer_is_refused_naming_the_owner_and_never_cancels_the_first() -> None:
    with tensor_server() as (_srv, _engine, stub), TrainerClient([_srv.address], rpc_timeout_s=30) as first:
        target = _srv.address
        first.sync(model(1), "v1")
        st = status(stub)
        assert st.owner.owner == first.owner and st.owner.keepalive_calls == 1 and not st.owner.HasField("expires_in")

        with TrainerClient([target], rpc_timeout_s=30) as second:
            with pytest.raises(InitError) as e:
                second.init()
            failure = e.value.failures[target]
            assert failure.code == grpc.StatusCode.FAILED_PRECONDITION and failure.reason == "NOT_OWNER"
            assert first.owner in failure.message and failure.metadata["owner"] == first.owner

            intrusions: dict[str, str] = {}

            def intrude(phase: str) -> None:
                """While the first trainer's update is in flight, everyone else tries to take it over."""
                if phase != "broadcast":
                    return
                try:
                    second.sync(model(9), "intruder")
                except SyncError as err:
                    intrusions["sync"] = err.failures[target].reason
                upd = status(stub).update.update_id
                for name, call in {
                    "Cancel": lambda: stub.Cancel(pb.CancelRequest(update_id=upd, owner="someone"), timeout=10),
                    "Complete": lambda: stub.Complete(pb.CompleteRequest(update_id=upd), timeout=10),
                    "Init": lambda: stub.Init(
                        pb.InitRequest(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2),
                        timeout=10,
                    ),
                    "Watch": lambda: next(iter(stub.Watch(pb.WatchRequest(update_id=upd, hold=True), timeout=10))),
                }.items():
                    try:
                        call()
                    except grpc.RpcError as err:
                        assert code_of(err) == grpc.StatusCode.FAILED_PRECONDITION, (name, err)
                        intrusions[name] = error_reason(err)

            result = first.sync(model(2), "v2", on_phase=intrude)
        assert intrusions == dict.fromkeys(["sync", "Cancel", "Complete", "Init", "Watch"], "NOT_OWNER")
        assert result.weight_version == "v2" and status(stub).weight_version == "v2"
        assert status(stub).updates_completed == 2
        first.sync(model(3), "v3")  # the first trainer's group was never touched
        assert status(stub).owner.owner == first.owner


OWNER = r"""
import sys, time, torch
from wsync_grpc.core.timeouts import ServerBounds
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.trainer import TrainerClient

c = TrainerClient([sys.argv[1]], rpc_timeout_s=30)
c.sync(synthetic.build("tiny", seed=1, dtype=torch.bfloat16).items(), "from-the-dead")
print("owned", c.owner, flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(180)
def test_the_owners_death_hands_the_engine_over_within_a_second() -> None:
    with tensor_server() as (srv, _engine, stub):
        proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, srv.address], stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("owned"), line
            dead_owner = line.split()[1]
            assert status(stub).owner.owner == dead_owner
            with TrainerClient([srv.address], rpc_timeout_s=30) as heir:
                with pytest.raises(InitError) as e:  # alive: refused
                    heir.init()
                assert e.value.failures[srv.address].reason == "NOT_OWNER"
                proc.kill()
                killed = time.monotonic()
                proc.wait(10)
                while status(stub).HasField("owner"):
                    assert time.monotonic() - killed < 2.0, "the dead owner's lease still holds the engine"
                    time.sleep(0.02)
                print(f"the lease was released {time.monotonic() - killed:.2f} s after the owner died")
                heir.sync(model(2), "heir")  # the old group is left for the new owner's
                st = status(stub)
                assert st.owner.owner == heir.owner and st.weight_version == "heir"
        finally:
            proc.kill()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command(*args), capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)


@pytest.mark.timeout(180)
def test_an_operator_forces_the_engine_away_with_the_cli() -> None:
    with tensor_server() as (srv, _engine, stub), TrainerClient([srv.address], rpc_timeout_s=30) as trainer:
        trainer.sync(model(1), "v1")
        refused = cli("leave", "--target", srv.address)
        assert refused.returncode == 1
        assert "FAILED_PRECONDITION NOT_OWNER" in refused.stderr and trainer.owner in refused.stderr
        assert status(stub).state == pb.LIFECYCLE_STATE_READY

        forced = cli("leave", "--target", srv.address, "--force")
        assert forced.returncode == 0, forced.stderr
        st = status(stub)
        assert st.state == pb.LIFECYCLE_STATE_UNINITIALIZED and not st.HasField("owner")
        time.sleep(1.5)  # the trainer's KeepAlive ended with NOT_OWNER and was not reopened
        assert not status(stub).HasField("owner")

        trainer.sync(model(2), "v2")  # released, not taken: the trainer's next sync claims it again
        st = status(stub)
        assert st.owner.owner == trainer.owner and st.weight_version == "v2"
        forced = cli("cancel", "--target", srv.address, "--force", "--reason", "maintenance")
        assert forced.returncode == 0, forced.stderr
        assert not status(stub).HasField("owner")


@pytest.mark.timeout(120)
def test_a_caller_without_keepalive_holds_the_engine_for_its_lease_ttl() -> None:
    with tensor_server() as (_srv, _engine, stub):
        port = free_port()
        req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, owner="alice")
        req.timeout.FromSeconds(30)
        req.lease_ttl.FromMilliseconds(1500)
        fut = stub.Init.future(req, timeout=40)
        group = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=30)
        try:
            assert fut.result().owner.owner == "alice"
            owner = status(stub).owner
            assert owner.owner == "alice" and owner.keepalive_calls == 0
            assert 0 < owner.expires_in.ToTimedelta().total_seconds() <= 1.5
            bob = caller(_srv)
            with pytest.raises(grpc.RpcError) as e:
                bob.Leave(pb.LeaveRequest(owner="bob"), timeout=10)
            assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION and error_reason(e.value) == "NOT_OWNER"
            bob.Pause(pb.PauseRequest(), timeout=10)  # open to everyone
            bob.Resume(pb.ResumeRequest(), timeout=10)
            time.sleep(1.7)
            assert not status(stub).HasField("owner")
            assert bob.Leave(pb.LeaveRequest(owner="bob"), timeout=10).was_member
        finally:
            group.destroy()


# ----------------------------------------------------------------- the lease credential


def states_while(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, seconds: float) -> set[int]:
    """Every lifecycle state GetStatus reports over ``seconds``."""
    seen: set[int] = set()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        seen.add(status(stub).state)
        time.sleep(0.01)
    return seen


def init_joined(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, owner: str, **fields: object) -> pb.InitResponse:
    """Init ``stub``'s engine (its group joined by this process as rank 0, then left at once)."""
    port = free_port()
    req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, owner=owner)
    req.timeout.FromSeconds(30)
    for name, value in fields.items():
        if name == "lease_ttl_ms":
            req.lease_ttl.FromMilliseconds(int(value))  # type: ignore[call-overload]
        else:
            setattr(req, name, value)
    fut = stub.Init.future(req, timeout=40)
    group = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=30)
    group.destroy()
    reply: pb.InitResponse = fut.result()
    return reply


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    """The NOT_OWNER refusal of ``call``."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert error_reason(e.value) == "NOT_OWNER", e.value
    return e.value


def header(owner: str = "", version: str = "v-x") -> pb.PrepareRequest:
    return pb.PrepareRequest(
        header=pb.PrepareHeader(weight_version=version, bucket_count=1, total_bytes=4, owner=owner)
    )


@pytest.mark.timeout(180)
def test_the_owners_name_proves_nothing_a_caller_sending_it_cannot_publish() -> None:
    """Another caller sending the owner's very name is refused; the weights and the owner's lease are untouched."""
    with (
        tensor_server() as (srv, _engine, stub),
        TrainerClient([srv.address], rpc_timeout_s=30, owner="trainer-1") as first,
    ):
        first.sync(model(1), "v1")
        with TrainerClient([srv.address], rpc_timeout_s=30, owner="trainer-1") as impostor:
            with pytest.raises(SyncError) as e:
                impostor.sync(model(9), "impostor")
            assert e.value.failures[srv.address].reason == "NOT_OWNER"
        plain = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(srv.address))
        refusal(lambda: plain.Prepare(iter([header("trainer-1")]), timeout=10))
        refusal(lambda: plain.Leave(pb.LeaveRequest(owner="trainer-1"), timeout=10))
        st = status(stub)
        assert st.weight_version == "v1" and st.state == pb.LIFECYCLE_STATE_READY
        assert st.owner.owner == "trainer-1" and st.owner.keepalive_calls == 1, "the owner's KeepAlive was never ended"
        assert first.sync(model(2), "v2").weight_version == "v2"


@pytest.mark.timeout(120)
def test_the_credential_goes_to_the_new_owner_alone_status_and_errors_show_only_its_name() -> None:
    with tensor_server() as (srv, _engine, stub):
        alice = caller(srv)
        reply = init_joined(alice, "alice")
        credential = reply.lease_credential
        assert len(credential) > 40 and credential.split(".")[0] == str(reply.owner.generation) != "0"
        st = status(stub)
        assert st.owner.owner == "alice" and st.owner.generation == reply.owner.generation
        assert credential.encode() not in st.SerializeToString()
        stranger = caller(srv)
        err = refusal(lambda: stranger.Leave(pb.LeaveRequest(owner="alice"), timeout=10))
        assert "'alice'" in err.details() and credential not in err.details()  # type: ignore[attr-defined]
        assert credential not in str(err.trailing_metadata())  # type: ignore[attr-defined]
        keepalive = alice.KeepAlive(pb.KeepAliveRequest(owner="alice"), timeout=30)
        first, second = next(keepalive), next(keepalive)
        assert first.lease_credential == credential and second.lease_credential == ""
        assert credential.encode() not in first.owner.SerializeToString()
        keepalive.cancel()
        # A raw stub (or grpcurl -H) presenting the header is the owner.
        plain = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(srv.address))
        assert plain.Leave(pb.LeaveRequest(), metadata=[("wsync-lease", credential)], timeout=10).was_member


@pytest.mark.timeout(180)
def test_a_credential_of_an_ended_lease_is_fenced_after_a_force_takeover_or_an_expiry() -> None:
    with tensor_server() as (srv, _engine, stub):
        a = caller(srv)
        lease_a = init_joined(a, "a")
        held = a.KeepAlive(pb.KeepAliveRequest(owner="a"), timeout=60)
        next(held)
        operator = caller(srv)
        lease_op = init_joined(operator, "operator", force=True, lease_ttl_ms=1000)
        assert lease_op.owner.generation == lease_a.owner.generation + 1
        refusal(lambda: list(held))  # the old owner's KeepAlive ends
        plain = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(srv.address))
        old = [("wsync-lease", lease_a.lease_credential)]
        err = refusal(lambda: plain.Prepare(iter([header("a")]), timeout=10, metadata=old))
        assert f"generation {lease_a.owner.generation}" in err.details()  # type: ignore[attr-defined]
        refusal(lambda: plain.Leave(pb.LeaveRequest(owner="a"), timeout=10, metadata=old))
        refusal(lambda: a.Leave(pb.LeaveRequest(owner="a"), timeout=10))  # a's channel dropped the fenced credential
        assert status(stub).owner.owner == "operator" and status(stub).state == pb.LIFECYCLE_STATE_READY

        time.sleep(1.3)  # the operator's lease (1 s, no KeepAlive) expires; b takes the engine
        b = caller(srv)
        b_keepalive = b.KeepAlive(pb.KeepAliveRequest(owner="b"), timeout=60)
        assert next(b_keepalive).owner.generation == lease_op.owner.generation + 1
        err = refusal(lambda: operator.Leave(pb.LeaveRequest(), timeout=10))
        assert f"generation {lease_op.owner.generation}" in err.details()  # type: ignore[attr-defined]
        b_keepalive.cancel()
        time.sleep(0.2)
        assert not status(stub).HasField("owner")
        # No live owner now, yet a KeepAlive presenting an ended lease's credential never revives it.
        stale_call = plain.KeepAlive(pb.KeepAliveRequest(owner="a"), metadata=old, timeout=10)
        refusal(lambda: next(stale_call))
        assert not status(stub).HasField("owner")


@pytest.mark.timeout(120)
def test_a_non_owners_prepare_never_leaves_ready_even_an_empty_one() -> None:
    with tensor_server() as (srv, _engine, stub), TrainerClient([srv.address], rpc_timeout_s=30) as owner:
        owner.sync(model(1), "v1")
        gate = threading.Event()

        def silent() -> Iterator[pb.PrepareRequest]:
            gate.wait(30)
            yield from ()

        stranger = caller(srv)
        try:
            t0 = time.monotonic()
            refusal(lambda: stranger.Prepare(silent(), timeout=30))  # before a single message is read
            assert time.monotonic() - t0 < 2.0
            assert states_while(stub, 0.3) == {pb.LIFECYCLE_STATE_READY}
            refusal(lambda: stranger.Prepare(iter([header(owner.owner)]), timeout=10))
            assert owner.sync(model(2), "v2").weight_version == "v2"  # never UPDATE_IN_PROGRESS
        finally:
            gate.set()


@pytest.mark.timeout(120)
def test_a_prepare_enters_preparing_only_once_its_header_arrived() -> None:
    """With no live owner, a silent Prepare stream holds nothing: a trainer claims and syncs meanwhile."""
    with tensor_server() as (srv, _engine, stub):
        gate = threading.Event()

        def silent() -> Iterator[pb.PrepareRequest]:
            gate.wait(60)
            yield from ()

        stranger = caller(srv)
        pending = stranger.Prepare.future(silent(), timeout=60)
        try:
            assert states_while(stub, 0.3) == {pb.LIFECYCLE_STATE_UNINITIALIZED}
            with TrainerClient([srv.address], rpc_timeout_s=30) as trainer:
                assert trainer.sync(model(1), "v1").weight_version == "v1"
                gate.set()
                assert code_of(pending.exception(timeout=30)) != grpc.StatusCode.OK  # type: ignore[arg-type]
                assert status(stub).owner.owner == trainer.owner
        finally:
            gate.set()


@pytest.mark.timeout(120)
def test_a_failed_init_or_prepare_claims_nothing(tmp_path: Path) -> None:
    with tensor_server(checkpoint_roots=[str(tmp_path)]) as (srv, _engine, stub):
        a = caller(srv)
        req = pb.InitRequest(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2)
        req.owner = "a"
        req.timeout.FromSeconds(1)  # nobody joins
        req.lease_ttl.FromSeconds(10 * 365 * 24 * 3600)
        with pytest.raises(grpc.RpcError) as e:
            a.Init(req, timeout=60)
        assert code_of(e.value) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), e.value
        assert not status(stub).HasField("owner"), status(stub).owner
        disk = pb.PrepareHeader(
            weight_version="v", transport=pb.TRANSPORT_DISK, checkpoint_path="/etc/passwd", owner="d"
        )
        with pytest.raises(grpc.RpcError) as e:
            a.Prepare(iter([pb.PrepareRequest(header=disk)]), timeout=30)
        assert code_of(e.value) == grpc.StatusCode.PERMISSION_DENIED
        assert not status(stub).HasField("owner"), status(stub).owner
        with TrainerClient([srv.address], rpc_timeout_s=30) as trainer:  # the engine is free at once
            assert trainer.sync(model(1), "v1").weight_version == "v1"


@pytest.mark.timeout(120)
def test_a_keepalive_or_a_disk_prepare_claims_a_free_engine_with_a_credential_and_a_capped_ttl(
    tmp_path: Path,
) -> None:
    engine = TensorEngine(synthetic.build("tiny", dtype=torch.bfloat16), aliases=synthetic.aliases("tiny"))
    bounds = ServerBounds(max_lease_ttl_s=5.0)
    with in_process_server(engine, checkpoint_roots=[str(tmp_path)], bounds=bounds) as (srv, stub):
        k = caller(srv)
        keepalive = k.KeepAlive(pb.KeepAliveRequest(owner="k"), timeout=30)
        first = next(keepalive)
        assert first.lease_credential and first.owner.owner == "k"
        assert first.owner.lease_ttl.ToTimedelta().total_seconds() == 5.0  # the default 60 s, capped
        keepalive.cancel()  # the lease is released at once

        save_checkpoint(model(3), tmp_path / "ckpt")
        d = caller(srv)
        disk = pb.PrepareHeader(
            weight_version="v-disk", transport=pb.TRANSPORT_DISK, checkpoint_path=str(tmp_path / "ckpt"), owner="d"
        )
        reply = d.Prepare(iter([pb.PrepareRequest(header=disk)]), timeout=30)
        assert reply.lease_credential and reply.lease_credential != first.lease_credential
        st = status(stub)
        assert st.owner.owner == "d" and st.owner.generation == first.owner.generation + 1
        plain = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(srv.address))
        refusal(lambda: plain.Complete(pb.CompleteRequest(update_id=reply.update_id), timeout=30))
        done = d.Complete(pb.CompleteRequest(update_id=reply.update_id), timeout=30)
        assert done.weight_version == "v-disk"
