"""The docs' Python blocks marked ``<!-- docs-test: run, version V -->`` run as written against real engines.

Two engine processes serve the ``tiny`` synthetic model; each marked block runs with the names it
leaves to the reader bound (``targets``: both engines; ``model``: weights of the engines' shape), the
engines' documented address (``127.0.0.1:50051``) replaced by the first engine's. Afterwards every
engine serves version ``V``, bit for bit the tensors the block sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from support import ENV, ROOT
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, spawn_engine, stop_all

pytestmark = pytest.mark.timeout(300)

MARK = re.compile(r"^<!-- docs-test: run, version (\S+) -->\n```python\n(.*?)\n```$", re.M | re.S)
DOCUMENTED_TARGET = "127.0.0.1:50051"


def marked_blocks() -> list[tuple[str, str, str]]:
    """(page:line, version, code) of every block marked to run."""
    out = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        for m in MARK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{page.relative_to(ROOT)}:{line}", m[1], m[2]))
    return out


BLOCKS = marked_blocks()


class _Model:
    """What the blocks call ``model``: ``named_parameters()`` of the engines' shape (other values)."""

    def __init__(self) -> None:
        self.weights = synthetic.build("tiny", seed=7)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights.items())


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    tmp = tmp_path_factory.mktemp("docs")
    procs = [
        spawn_engine(
            ["--synthetic", "tiny", "--dtype", "bfloat16", "--grace", "1"],
            port_file=tmp / f"e{i}.port",
            log=tmp / f"e{i}.log",
            env=ENV,
            timeout_s=120,
        )
        for i in range(2)
    ]
    try:
        yield procs
    finally:
        stop_all(procs, grace_s=5)


def test_the_pages_mark_blocks_to_run() -> None:
    pages = {where.split(":")[0] for where, _, _ in BLOCKS}
    assert {"docs/quickstart.md", "docs/guides/fleet.md"} <= pages


@pytest.mark.parametrize(("where", "version", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_a_marked_block_runs_and_the_engines_serve_what_it_sent(
    engines: list[EngineProcess], where: str, version: str, code: str
) -> None:
    targets = [e.target for e in engines]
    model = _Model()
    namespace: dict[str, Any] = {"targets": targets, "model": model, "__name__": "docs_block"}
    exec(compile(code.replace(DOCUMENTED_TARGET, targets[0]), where, "exec"), namespace)
    sent: dict[str, torch.Tensor] = namespace.get("weights", model.weights)
    synced = targets if DOCUMENTED_TARGET not in code else targets[:1]
    for target in synced:
        with grpc.insecure_channel(target) as channel:
            stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
            assert stub.GetStatus(pb.GetStatusRequest(), timeout=30).weight_version == version
            sums = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30).checksums
        served = {c.name: c.sha256 for c in sums}
        assert served and all(served[n] == tensor_sha256(t) for n, t in sent.items() if n in served), where
