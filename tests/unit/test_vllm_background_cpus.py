"""Where a vLLM worker's weight-sync threads run: the CPUs no worker's forward is bound to (front's rule)."""

from __future__ import annotations

import os
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


def test_engines_started_side_by_side_each_get_cores_of_their_own(monkeypatch: Any) -> None:
    """``vllm_cpu_binds``: vLLM's own auto binding would put every engine's forward on the same cores."""
    from wsync_grpc.launch import vllm_cpu_binds

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    bind = "VLLM_CPU_OMP_THREADS_BIND"
    assert vllm_cpu_binds(2, [0, 1]) == [{bind: "0"}, {bind: "1"}]
    assert vllm_cpu_binds(2, [4, 5, 6, 7, 8]) == [{bind: "4,5"}, {bind: "6,7,8"}]
    assert vllm_cpu_binds(3, [0, 1]) == [{bind: "0"}, {bind: "1"}, {bind: "0"}]  # fewer cores than engines
    assert vllm_cpu_binds(1, [0, 1]) == [{}]  # one engine: vLLM's own choice
    assert len({b[bind] for b in vllm_cpu_binds(2)}) == min(2, len(os.sched_getaffinity(0)))  # this host's cores
    monkeypatch.setenv(bind, "nobind")
    assert vllm_cpu_binds(2, [0, 1]) == [{}, {}]  # the caller's binding stands
