"""Shared helpers for the tests: free ports, in-process engines, the stub trainer process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import torch
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.group.process_group import WeightSyncGroup, join_group
from wsync_grpc.service.server import WsyncServer, build_server

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'generated'}"}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def tensor_server(
    preset: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[WsyncServer, TensorEngine, weight_sync_pb2_grpc.WeightSyncServiceStub]]:
    """A real gRPC server on a loopback port serving a synthetic :class:`TensorEngine`."""
    engine = TensorEngine(synthetic.build(preset, seed=seed, dtype=dtype), aliases=synthetic.aliases(preset))
    srv = build_server(engine)
    channel = grpc.insecure_channel(srv.address)
    try:
        yield srv, engine, weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
    finally:
        channel.close()
        srv.stop(0.5)


def _stub_trainer_cmd(target: str, port: int, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "stub_trainer.py"), "--target", target, "--port", str(port), *args]


def run_stub_trainer(target: str, port: int, *args: str, timeout: float = 120) -> dict[str, object]:
    """Run ``tests/stub_trainer.py`` to the end; return its last JSON line."""
    r = subprocess.run(_stub_trainer_cmd(target, port, args), capture_output=True, text=True, timeout=timeout, env=ENV)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"stub trainer printed nothing (rc {r.returncode}): {r.stderr[-3000:]}"
    result: dict[str, object] = json.loads(lines[-1])
    return result


def start_stub_trainer(target: str, port: int, *args: str) -> subprocess.Popen[str]:
    """Start ``tests/stub_trainer.py`` in the background."""
    return subprocess.Popen(
        _stub_trainer_cmd(target, port, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def status(stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> pb.GetStatusResponse:
    """GetStatus with a short deadline."""
    return stub.GetStatus(pb.GetStatusRequest(), timeout=10)


def code_of(e: grpc.RpcError) -> grpc.StatusCode:
    """The status code of a failed call."""
    code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
    return code


def join_as_trainer(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, timeout_s: float = 30) -> WeightSyncGroup:
    """Init the engine and join its group as rank 0 from this process; returns the trainer's group."""
    port = free_port()
    req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
    req.timeout.FromSeconds(int(timeout_s))
    fut = stub.Init.future(req, timeout=timeout_s + 10)
    group = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=timeout_s)
    fut.result()
    return group
