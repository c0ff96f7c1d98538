"""vLLM in Ray engine actors (issue 42): they serve where other nodes reach them, take a sync, and end with their actor.

A real one-node Ray cluster (2 CPUs, an 80 MiB object store, no dashboard) and two real ``wsync serve --engine
vllm`` on SmolLM2-135M started by :class:`wsync_grpc.ray.EngineActor` (``launch_engines``, a bundle of one CPU
each). Their own engines, not shared ones: the test kills one. Each binds its forward to a core of its own; a
trainer built from the handles syncs perturbed weights into both, and every checksum equals the trainer's tensor in
the served dtype; ``ray.kill`` of one actor then leaves none of its processes (the server, vLLM's ``EngineCore``
and worker) running.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
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


def _bound_cores(pid: int) -> set[int]:
    """The cores the threads of ``pid`` and the processes below it are bound to: every thread whose affinity is
    narrower than this host's (vLLM binds its forward's threads; the others run anywhere)."""
    every = os.sched_getaffinity(0)
    bound: set[int] = set()
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for t in p.threads():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    cores = os.sched_getaffinity(t.id)
                    if cores < every:
                        bound |= cores
    return bound


def test_vllm_engine_actors_serve_on_their_node_bound_apart_take_a_sync_and_end_whole_with_their_actor(
    cluster: object, smollm2_dir: Path
) -> None:
    """Two vLLM engine actors of one placement group on the one node (a bundle of one CPU each): each binds its
    forward to cores of its own (vLLM alone binds every engine of a node to the same ones), both take one sync
    bit-exact, and ``ray.kill`` of one actor ends its processes and leaves the other serving."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(7)
    state = {
        n: t + 0.02 * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2 else t
        for n, t in safetensors_torch.load_file(str(smollm2_dir / "model.safetensors")).items()
    }
    spec = EngineSpec(vllm_model=str(smollm2_dir), insecure=True)
    handles = launch_engines(2, spec, num_cpus=1, name="ray-vllm")
    infos: list[EngineInfo] = []
    try:
        infos = [h.info() for h in handles]
        node_ip = ray.util.get_node_ip_address()
        for info, handle in zip(infos, handles, strict=True):
            assert info.target.rsplit(":", 1)[0] == node_ip and info.http_target is not None
            assert info.http_target.rsplit(":", 1)[0] == node_ip
            health = handle.health()
            assert health.running and health.serving, health
            with urllib.request.urlopen(f"http://{info.http_target}/v1/models", timeout=30) as reply:
                assert json.loads(reply.read())["data"][0]["id"] == str(smollm2_dir)
        bound = [_bound_cores(info.engine_pid) for info in infos]
        if len(os.sched_getaffinity(0)) >= 2:  # a core each
            assert bound[0] and bound[1] and not bound[0] & bound[1], bound
        with trainer_client(handles, rpc_timeout_s=60, group_timeout_s=60) as client:
            for info in infos:
                status = client.status()[info.target]
                assert status.engine.workers == 1 and status.weight_version == ""
            result = client.sync(state.items(), "ray-1", dtype=SERVED)
            assert sorted(result.engines) == sorted(i.target for i in infos)
            for info in infos:
                sums = client.checksums()[info.target]
                assert sums.weight_version == "ray-1" and len(sums.checksums) == len(state)
                wrong = [c.name for c in sums.checksums if c.sha256 != _sha(state[c.name])]
                assert not wrong, f"{len(wrong)} tensors differ from the trainer's, e.g. {wrong[:3]}"

        info = infos[0]
        below = psutil.Process(info.engine_pid).children(recursive=True)
        titles = [(p.name(), " ".join(p.cmdline()).strip()) for p in below]  # vLLM renames its processes
        assert any(n.startswith("VLLM::") or "EngineCore" in t for n, t in titles), titles
        every = [info.engine_pid, *(p.pid for p in below)]
        ray.kill(handles[0].actor, no_restart=True)
        killed = time.monotonic()
        while any(_running(p) for p in every):
            left = [p for p in every if _running(p)]
            assert time.monotonic() - killed < ENDS_WITHIN_S, f"still running after ray.kill: {left}"
            time.sleep(0.05)
        print(f"\n{len(every)} engine processes (server, EngineCore, workers) ended "
              f"{time.monotonic() - killed:.2f} s after ray.kill")  # fmt: skip
        other = handles[1].health()
        assert other.running and other.serving, other
    finally:
        stop_engines(handles, grace_s=None)
        for info in infos:  # a killed engine's files stay for a post-mortem: this test's go
            shutil.rmtree(Path(info.log).parent, ignore_errors=True)
