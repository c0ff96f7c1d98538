"""The README's examples run as written against real engine processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from support import ENV, ROOT
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.testing import spawn_engine

pytestmark = pytest.mark.timeout(600)


@contextmanager
def serve(tmp_path: Path, *args: str) -> Iterator[str]:
    engine = spawn_engine(args, port_file=tmp_path / "port", env=ENV, timeout_s=120)
    try:
        yield engine.target
    finally:
        engine.stop(30)


def run_example(name: str, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True, timeout=500, env=ENV
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_bare_stub_example(tmp_path: Path) -> None:
    with serve(tmp_path, "--synthetic", "tiny", "--dtype", "bfloat16") as target:
        out = run_example("bare_stub.py", target)
        assert "engine serves all-halves: 20 tensors" in out
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(target))
        sums = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)
        for c in sums.checksums:
            assert c.sha256 == tensor_sha256(torch.full(tuple(c.shape), 0.5, dtype=torch.bfloat16)), c.name


@pytest.mark.slow
def test_minimal_trainer_example(tmp_path: Path) -> None:
    with serve(tmp_path) as target:
        out = run_example("minimal_trainer.py", target)
        assert [ln.split(":")[0] for ln in out.splitlines()] == ["step 1", "step 2", "step 3"]
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(target))
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=30).weight_version == "step-3"
