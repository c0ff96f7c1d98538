"""One owner per engine: a second trainer is refused while the first lives, and never cancels its updates.

Real gRPC servers on loopback ports, real ``TrainerClient`` s (one of them a child process that is
SIGKILLed), the real ``wsync`` CLI for the operator's force, and raw stub calls for callers that
name another owner.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
import torch
from support import ENV, ROOT, code_of, free_port, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.engines import synthetic
from wsync_grpc.group.process_group import join_group
from wsync_grpc.testing import cli_command
from wsync_grpc.trainer import InitError, SyncError, TrainerClient
from wsync_grpc.wire.status import error_reason


def model(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(synthetic.build("tiny", seed=seed, dtype=torch.bfloat16).items())


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
from wsync_grpc.engines import synthetic
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
            with pytest.raises(grpc.RpcError) as e:
                stub.Leave(pb.LeaveRequest(owner="bob"), timeout=10)
            assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION and error_reason(e.value) == "NOT_OWNER"
            stub.Pause(pb.PauseRequest(), timeout=10)  # open to everyone
            stub.Resume(pb.ResumeRequest(), timeout=10)
            time.sleep(1.7)
            assert not status(stub).HasField("owner")
            assert stub.Leave(pb.LeaveRequest(owner="bob"), timeout=10).was_member
        finally:
            group.destroy()
