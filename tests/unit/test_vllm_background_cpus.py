"""Where a vLLM worker's weight-sync threads run: the CPUs no worker's forward is bound to (front's rule)."""

from __future__ import annotations

from typing import Any

from wsync_grpc.engines.vllm.front import background_cpus


def _worker(rank: int, cpus: list[int], host_cpus: list[int], host: str = "a") -> dict[str, Any]:
    return {"global_rank": rank, "host": host, "cpus": cpus, "host_cpus": host_cpus}


def test_one_bound_worker_gets_the_cores_vllm_left_unbound() -> None:
    assert background_cpus([_worker(0, [0], [0, 1])]) == {"0": [1]}


def test_bound_workers_on_one_host_never_get_each_others_forward_cores() -> None:
    # vLLM's auto binding: each worker on a NUMA node of its own, the last core of each left unbound.
    workers = [_worker(0, [0, 1, 2], list(range(8))), _worker(1, [4, 5, 6], list(range(8)))]
    assert background_cpus(workers) == {"0": [3, 7], "1": [3, 7]}


def test_workers_on_other_hosts_are_counted_on_their_own_host() -> None:
    workers = [_worker(0, [0], [0, 1], host="a"), _worker(1, [1], [0, 1], host="b")]
    assert background_cpus(workers) == {"0": [1], "1": [0]}


def test_unbound_workers_and_workers_with_no_core_left_stay_where_they_run() -> None:
    assert background_cpus([_worker(0, [0, 1], [0, 1]), _worker(1, [0, 1], [0, 1])]) == {}  # nobind, GPU
    assert background_cpus([_worker(0, [0], [0, 1]), _worker(1, [1], [0, 1])]) == {}  # every core bound
    assert background_cpus([_worker(0, [], [])]) == {}  # no affinity on this platform
