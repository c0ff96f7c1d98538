"""Principals and roles: each token of ``wsync serve --token-file`` is a principal with a role.

A reader may look (status, checksums, an observer's Watch, adapters); a trainer may also run updates
(Init, Prepare, Complete, Cancel, Leave, KeepAlive, a held Watch); only an operator may Pause, or set
``force`` (Init, Cancel, Leave, Resume). Real servers on loopback ports, a real ``TrainerClient`` and
the real ``wsync`` CLI; the tokens come from a file, never from a command line.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from support import ENV, ROOT, code_of
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.auth import Role, read_token_file
from wsync_grpc.service.server import WsyncServer, build_server
from wsync_grpc.testing import cli_command, owner_channel
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.wire.status import error_reason

TOKENS = {"reader": "r" * 24, "trainer": "t" * 24, "operator": "o" * 24}


def token_file(d: Path, lines: str | None = None, mode: int = 0o600) -> Path:
    p = d / "tokens"
    body = lines if lines is not None else "".join(f"{role}-1:{role}:{t}\n" for role, t in TOKENS.items())
    p.write_text("# name:role:token\n\n" + body)
    os.chmod(p, mode)
    return p


@pytest.fixture
def served(tmp_path: Path) -> Iterator[WsyncServer]:
    engine = TensorEngine(synthetic.build("tiny", dtype=torch.bfloat16), aliases=synthetic.aliases("tiny"))
    srv = build_server(engine, principals=read_token_file(token_file(tmp_path)))
    yield srv
    srv.stop(0.5)


def as_(role: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[role]}")]


def denied(call: Callable[[], object], needs: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert code_of(e.value) == grpc.StatusCode.PERMISSION_DENIED, e.value
    assert error_reason(e.value) == "ROLE_NOT_ALLOWED", e.value
    assert f"needs the {needs} role" in e.value.details()  # type: ignore[attr-defined]
    assert not any(t in e.value.details() for t in TOKENS.values())  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_each_role_makes_only_its_calls(served: WsyncServer) -> None:
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(owner_channel(served.address))
    reader, operator = as_("reader"), as_("operator")
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=reader, timeout=10).engine.tensor_count > 0
    assert stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=["model.norm.weight"]), metadata=reader)
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), metadata=reader, timeout=10).supported
    header = pb.PrepareRequest(header=pb.PrepareHeader(weight_version="x", bucket_count=1, total_bytes=4))
    denied(lambda: stub.Prepare(iter([header]), metadata=reader, timeout=10), "trainer")
    denied(lambda: next(stub.KeepAlive(pb.KeepAliveRequest(), metadata=reader, timeout=10)), "trainer")
    denied(lambda: stub.Leave(pb.LeaveRequest(), metadata=reader, timeout=10), "trainer")
    denied(lambda: stub.Pause(pb.PauseRequest(), metadata=reader, timeout=10), "operator")
    with pytest.raises(grpc.RpcError) as e:  # no token at all: unauthenticated, as before
        stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED

    with TrainerClient([served.address], token=TOKENS["trainer"], rpc_timeout_s=30) as trainer:
        assert trainer.sync(synthetic.build("tiny", seed=1, dtype=torch.bfloat16).items(), "v1").weight_version == "v1"
        raw, mine = trainer.stubs[served.address], as_("trainer")
        denied(lambda: raw.Pause(pb.PauseRequest(), metadata=mine, timeout=10), "operator")
        denied(lambda: raw.Resume(pb.ResumeRequest(force=True), metadata=mine, timeout=10), "operator")
        denied(lambda: raw.Cancel(pb.CancelRequest(force=True), metadata=mine, timeout=10), "operator")
        denied(lambda: raw.Leave(pb.LeaveRequest(force=True), metadata=mine, timeout=10), "operator")
        raw.Resume(pb.ResumeRequest(), metadata=mine, timeout=10)  # a plain resume is the trainer's
        st = raw.GetStatus(pb.GetStatusRequest(), metadata=mine, timeout=10)
        assert st.owner.owner == trainer.owner  # nothing was forced

        # The operator may do all of it: pause, resume with force, take the engine away.
        assert not stub.Pause(pb.PauseRequest(), metadata=operator, timeout=10).already_paused
        stub.Resume(pb.ResumeRequest(force=True), metadata=operator, timeout=10)
        assert stub.Leave(pb.LeaveRequest(force=True), metadata=operator, timeout=10).was_member
        st = stub.GetStatus(pb.GetStatusRequest(), metadata=operator, timeout=10)
        assert not st.HasField("owner") and st.state == pb.LIFECYCLE_STATE_UNINITIALIZED


def test_a_token_file_is_checked_line_by_line_and_never_echoes_a_token(tmp_path: Path) -> None:
    principals = read_token_file(token_file(tmp_path))
    assert {p.name: p.role for p in principals.values()} == {
        "reader-1": Role.READER,
        "trainer-1": Role.TRAINER,
        "operator-1": Role.OPERATOR,
    }
    with pytest.raises(ValueError, match="chmod 600"):
        read_token_file(token_file(tmp_path, mode=0o644))
    secret = "s" * 30
    for lines, says in [
        (f"alice:admin:{secret}\n", "line 3: unknown role 'admin'"),
        ("alice:reader\n", "line 3: expected name:role:token"),
        ("alice:reader:short\n", "shorter than 16"),
        (f"alice:reader:{secret}\nbob:trainer:{secret}\n", "line 4: 'bob' or its token is given twice"),
    ]:
        with pytest.raises(ValueError, match=says) as e:
            read_token_file(token_file(tmp_path, lines))
        assert secret not in str(e.value)


@pytest.mark.timeout(120)
def test_cli_serve_reads_its_principals_from_a_file_and_refuses_an_open_one(tmp_path: Path) -> None:
    bad = subprocess.run(
        cli_command(
            "serve", "--synthetic", "tiny", "--port", "0", "--token-file", str(token_file(tmp_path, mode=0o640))
        ),
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 2 and "--token-file" in bad.stderr and "chmod 600" in bad.stderr, bad.stderr
    assert not any(t in bad.stderr for t in TOKENS.values())
