"""vLLM in a Ray engine actor (issue 42): it serves where other nodes reach it, takes a sync, and ends with its actor.

A real one-node Ray cluster (an 80 MiB object store, no dashboard) and a real ``wsync serve --engine vllm`` on
SmolLM2-135M started by :class:`wsync_grpc.ray.EngineActor` (``launch_engines``). Its own engine, not a shared
one: the test kills it. A trainer built from the handle syncs perturbed weights into it, and every checksum
equals the trainer's tensor in the served dtype; ``ray.kill`` of the actor then leaves none of its processes
(the server, vLLM's ``EngineCore`` and worker) running.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from wsync_grpc.ray import EngineInfo, EngineSpec, launch_engines, stop_engines, trainer_client  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="engines end with their actor on Linux"),
]

ENDS_WITHIN_S = 5.0
SERVED = torch.bfloat16
"""vLLM's CPU dtype for SmolLM2's float32 checkpoint: the trainer sends in it, the checksums are of it."""


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.to(SERVED).contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    head = {"num_cpus": 2, "object_store_memory": 80 * 1024**2, "include_dashboard": False}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        c = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
        try:
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def test_a_vllm_engine_actor_serves_on_its_node_takes_a_sync_and_ends_whole_with_its_actor(
    cluster: object, smollm2_dir: Path
) -> None:
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(7)
    state = {
        n: t + 0.02 * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2 else t
        for n, t in safetensors_torch.load_file(str(smollm2_dir / "model.safetensors")).items()
    }
    spec = EngineSpec(vllm_model=str(smollm2_dir), insecure=True)
    (handle,) = launch_engines(1, spec, num_cpus=1, name="ray-vllm")
    info: EngineInfo | None = None
    try:
        info = handle.info()
        node_ip = ray.util.get_node_ip_address()
        assert info.target.rsplit(":", 1)[0] == node_ip and info.http_target is not None
        assert info.http_target.rsplit(":", 1)[0] == node_ip
        health = handle.health()
        assert health.running and health.serving, health
        with urllib.request.urlopen(f"http://{info.http_target}/v1/models", timeout=30) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == str(smollm2_dir)
        with trainer_client([handle], rpc_timeout_s=60, group_timeout_s=60) as client:
            status = client.status()[info.target]
            assert status.engine.workers == 1 and status.weight_version == ""
            result = client.sync(state.items(), "ray-1", dtype=SERVED)
            assert list(result.engines) == [info.target]
            sums = client.checksums()[info.target]
            assert sums.weight_version == "ray-1" and len(sums.checksums) == len(state)
            wrong = [c.name for c in sums.checksums if c.sha256 != _sha(state[c.name])]
            assert not wrong, f"{len(wrong)} tensors differ from the trainer's, e.g. {wrong[:3]}"

        below = psutil.Process(info.engine_pid).children(recursive=True)
        titles = [(p.name(), " ".join(p.cmdline()).strip()) for p in below]  # vLLM renames its processes
        assert any(n.startswith("VLLM::") or "EngineCore" in t for n, t in titles), titles
        every = [info.engine_pid, *(p.pid for p in below)]
        ray.kill(handle.actor, no_restart=True)
        killed = time.monotonic()
        while any(_running(p) for p in every):
            left = [p for p in every if _running(p)]
            assert time.monotonic() - killed < ENDS_WITHIN_S, f"still running after ray.kill: {left}"
            time.sleep(0.05)
        print(f"\n{len(every)} engine processes (server, EngineCore, workers) ended "
              f"{time.monotonic() - killed:.2f} s after ray.kill")  # fmt: skip
    finally:
        stop_engines([handle], grace_s=None)
        if info is not None:  # a killed engine's files stay for a post-mortem: this test's go
            shutil.rmtree(Path(info.log).parent, ignore_errors=True)
