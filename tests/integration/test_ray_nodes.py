"""A Ray node removed under a wsync fleet (issue 42): its engine is left out, the others publish, and the engine is
placed again, on another node, once capacity returns.

A real local Ray cluster (``ray.cluster_utils.Cluster``) of a head without CPUs for engines and three nodes of one
CPU each, with a short node health check so that a node's death is noticed within seconds. Three
``wsync serve --synthetic tiny`` engines launched by :func:`wsync_grpc.ray.launch_engines` over a STRICT_SPREAD
placement group, one per node, with Ray's ``max_restarts``. One node's raylet is killed (``remove_node``, not
graceful): its engine dies with its actor; the next sync under ``FleetPolicy.exclude`` leaves it out and the two
others publish. A new node joins: Ray places the lost bundle there and restarts the actor, its engine on a new
address; ``catch_up`` finds it through the trainer's resolver and brings it to the fleet's version, checked
bit-exact by SHA-256 of every tensor.

Marked ``serial``: ``make test`` runs it in its serial pass (a cluster of its own, whose node deaths must not be
slowed down by tests beside it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from support import assert_serve, ray_cluster

from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import FleetPolicy

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytest.importorskip("ray.cluster_utils")

from wsync_grpc.ray import EngineSpec, launch_engines, stop_engines, trainer_client  # noqa: E402

pytestmark = [
    pytest.mark.serial,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="engines end with their actor on Linux"),
]

STORE_BYTES = 80 * 1024**2
"""Each node's object store (Ray's default takes 30% of the RAM per node)."""
FAST_HEALTH_CHECK = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
"""The GCS declares a silent node dead after about 1.5 s (Ray's defaults take much longer)."""
BACK_WITHIN_S = 90.0
"""How long the lost engine may take to serve again once a node joins, in seconds."""
SPEC = EngineSpec(serve_args=("--synthetic", "tiny", "--dtype", "float32", "--grace", "1"), insecure=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def weights(seed: int) -> dict[str, torch.Tensor]:
    return synthetic.build("tiny", seed=seed, dtype=torch.float32)


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    head = {
        "num_cpus": 0,
        "object_store_memory": STORE_BYTES,
        "include_dashboard": False,
        "_system_config": FAST_HEALTH_CHECK,
    }
    with ray_cluster(head, nodes=3, node_cpus=1, store_bytes=STORE_BYTES) as c:
        yield c


def test_an_engine_on_a_removed_node_is_left_out_and_placed_again_when_capacity_returns(cluster: object) -> None:
    handles = launch_engines(3, SPEC, strategy="STRICT_SPREAD", max_restarts=2, name=f"nodes-{os.getpid()}")
    try:
        assert len({h.node_id for h in handles}) == 3
        with trainer_client(handles, policy=FleetPolicy.exclude(min_engines=2), rpc_timeout_s=30) as client:
            v1 = weights(1)
            client.sync(v1.items(), "v1")
            assert_serve([h.target for h in handles], "v1", v1)

            victim = handles[1]
            engine_pid = victim.info().engine_pid
            node = next(n for n in cluster.worker_nodes if n.node_id == victim.node_id)  # type: ignore[attr-defined]
            removed_at = time.monotonic()
            cluster.remove_node(node, allow_graceful=False)  # type: ignore[attr-defined]
            while _alive(engine_pid):
                assert time.monotonic() - removed_at < 30, "the engine outlived its node"
                time.sleep(0.05)
            gone_s = time.monotonic() - removed_at

            v2 = weights(2)
            result = client.sync(v2.items(), "v2")
            left_out_s = time.monotonic() - removed_at
            assert list(result.excluded) == [victim.target], result.excluded
            survivors = [h.target for h in handles if h is not victim]
            assert sorted(result.engines) == sorted(survivors)
            assert_serve(survivors, "v2", v2)

            joined_at = time.monotonic()
            cluster.add_node(num_cpus=1, object_store_memory=STORE_BYTES)  # type: ignore[attr-defined]
            caught = None
            while caught is None:
                assert time.monotonic() - joined_at < BACK_WITHIN_S, "the lost engine was not placed again"
                caught = client.catch_up(v2.items())
                if caught is None:
                    time.sleep(0.5)
            back_s = time.monotonic() - joined_at
            moved = victim.current_target()
            assert moved != victim.target and list(caught.engines) == [moved]
            assert victim.info().node_id not in {h.node_id for h in handles}  # a node of its own, the new one
            assert_serve([*survivors, moved], "v2", v2)
        print(
            f"\nnode removed: its engine ended {gone_s:.2f} s later; the next sync left it out and published "
            f"{left_out_s:.2f} s after the removal; "
            f"the engine served the fleet's version {back_s:.2f} s after a node joined"
        )
    finally:
        stop_engines(handles, grace_s=5)
