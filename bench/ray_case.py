"""The ray case of the benchmarks: a fleet launched as Ray actors against the same fleet launched directly.

A local Ray cluster of :data:`NODES` nodes on this host (``ray.cluster_utils.Cluster``: a small object store per
node, no dashboard). :data:`ENGINES` engines (``wsync serve --synthetic tiny``: a model of about 0.3 MB, so that a
sync is mostly its control plane) are launched two ways, one after the other:

- **ray**: :func:`wsync_grpc.ray.launch_engines` over a SPREAD placement group (one bundle per engine, Ray's
  ``max_restarts=1``), the trainer built by :func:`wsync_grpc.ray.trainer_client` (its resolver follows an engine
  that Ray restarts on a new port);
- **direct**: the same engines as processes of this one (:func:`wsync_grpc.launch.spawn_engine`), the trainer a
  plain :class:`~wsync_grpc.trainer.client.TrainerClient`.

Per way, under ``FleetPolicy.exclude``, after one untimed sync: :data:`SYNCS` timed syncs (wall time; Prepare
and Complete, the control plane, in ms per engine; the trainer's OS threads at rest), then :data:`KILLS` rounds:
one engine killed (``ray.kill`` of its actor; SIGKILL of its process), the next sync timed (it leaves the engine
out, or takes it back at once where its restart was found by then), then the time from the kill until every
engine serves the fleet's version again (``catch_up`` called until then): Ray restarts the actor (a new port,
found by the resolver); directly, the engine is started again by hand on its old port, as a supervisor would
(its start counted in the time).

Times in seconds unless named ``_ms``.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, child_env, cli_command, spawn_engine, spawn_process, stop_all
from wsync_grpc.trainer import FleetPolicy, SyncResult, TrainerClient

NODES = 3
ENGINES = 3
SYNCS = 8
"""Timed syncs per way."""
KILLS = 3
"""Exclusion and catch-up rounds per way."""
PRESET = "tiny"
SERVE_ARGS = ("--synthetic", PRESET, "--dtype", "float32", "--grace", "1")
STORE_BYTES = 80 * 1024**2
"""Each node's object store (Ray's default takes 30% of the RAM per node)."""
CATCH_UP_TIMEOUT_S = 60.0


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return synthetic.build(PRESET, seed=seed, dtype=torch.float32)


def _sync(client: TrainerClient, version: str, seed: int) -> tuple[SyncResult, float]:
    start = time.monotonic()
    r = client.sync(_weights(seed).items(), version)
    return r, time.monotonic() - start


def _run(
    client: TrainerClient, engines: int, kill: Callable[[int], None], restart: Callable[[int], None]
) -> dict[str, Any]:
    """The timed syncs and the kill rounds of one way (see the module)."""
    _sync(client, "warm", 0)
    syncs = []
    for i in range(SYNCS):
        r, wall = _sync(client, f"s{i}", i + 1)
        syncs.append(
            {
                "wall_s": wall,
                "control_ms_per_engine": 1e3 * (r.prepare_seconds + r.complete_seconds) / engines,
                "prepare_s": r.prepare_seconds,
                "complete_s": r.complete_seconds,
                "broadcast_s": r.broadcast_seconds,
            }
        )
    threads = psutil.Process().num_threads()
    rounds = []
    for k in range(KILLS):
        victim = k % engines
        t_kill = time.monotonic()
        kill(victim)
        r, wall = _sync(client, f"k{k}", 100 + k)
        restart(victim)
        catch_ups = 0
        while not _all_in_sync(client, engines):
            if time.monotonic() - t_kill > CATCH_UP_TIMEOUT_S:
                raise TimeoutError(f"the fleet was not whole again within {CATCH_UP_TIMEOUT_S} s of the kill")
            if client.catch_up(_weights(100 + k).items()) is None:
                time.sleep(0.1)
            catch_ups += 1
        rounds.append(
            {
                "sync_after_kill_s": wall,
                "excluded": sorted(r.excluded),
                "rejoined": sorted(r.rejoined),
                "whole_again_s": time.monotonic() - t_kill,
                "catch_up_calls": catch_ups,
            }
        )
        _say(
            f"  kill {k}: the next sync {wall:.2f} s ({len(r.excluded)} left out, {len(r.rejoined)} back in it); "
            f"every engine at the fleet's version {rounds[-1]['whole_again_s']:.2f} s after the kill"
        )
    return {"syncs": syncs, "threads_idle": threads, "kills": rounds}


def _all_in_sync(client: TrainerClient, engines: int) -> bool:
    states = [m.state for m in client.members().values()]
    return len(states) == engines and all(st == "in_sync" for st in states)


def _ray_way(tmp: Path) -> dict[str, Any]:
    import ray
    from ray import cluster_utils

    from wsync_grpc.ray import EngineSpec, launch_engines, stop_engines, trainer_client

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    head = {"num_cpus": 2, "object_store_memory": STORE_BYTES, "include_dashboard": False}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=2, object_store_memory=STORE_BYTES)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        cluster.wait_for_nodes()
        t0 = time.monotonic()
        handles = launch_engines(
            ENGINES, EngineSpec(serve_args=SERVE_ARGS, insecure=True), strategy="SPREAD", max_restarts=KILLS
        )
        launch_s = time.monotonic() - t0
        _say(f"ray: {ENGINES} engine actors serving {launch_s:.1f} s after launch_engines")
        try:
            with trainer_client(handles, policy=FleetPolicy.exclude(min_engines=1), rpc_timeout_s=30) as client:
                out = _run(
                    client,
                    ENGINES,
                    lambda i: ray.kill(handles[i].actor, no_restart=False),
                    lambda i: None,  # Ray restarts the actor
                )
        finally:
            stop_engines(handles)
        return {"launch_s": launch_s, **out}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _direct_way(tmp: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    procs: list[EngineProcess] = [
        spawn_engine(list(SERVE_ARGS), port_file=tmp / f"direct-{i}.port", log=tmp / f"direct-{i}.log", env=child_env())
        for i in range(ENGINES)
    ]
    launch_s = time.monotonic() - t0
    _say(f"direct: {ENGINES} engine processes serving {launch_s:.1f} s after the first spawn")

    def kill(i: int) -> None:
        os.kill(procs[i].process.pid, signal.SIGKILL)
        procs[i].process.wait()

    def restart(i: int) -> None:  # by hand, on the old port, as a supervisor would
        port = procs[i].target.rsplit(":", 1)[1]
        ready = tmp / f"direct-{i}-again.port"
        command = cli_command("serve", *SERVE_ARGS, "--port", port, "--port-file", str(ready))
        procs[i] = spawn_process(command, ready_file=ready, log=tmp / f"direct-{i}-again.log", env=child_env())

    try:
        with TrainerClient([p.target for p in procs], policy=FleetPolicy.exclude(min_engines=1), rpc_timeout_s=30) as c:
            out = _run(c, ENGINES, kill, restart)
    finally:
        stop_all(procs)
    return {"launch_s": launch_s, **out}


def case_ray() -> dict[str, Any]:
    """Run the case (see the module docstring): ``{"ray": {...}, "direct": {...}}``, or an error per way."""
    out: dict[str, Any] = {"engines": ENGINES, "nodes": NODES, "syncs": SYNCS, "kills": KILLS}
    with tempfile.TemporaryDirectory(prefix="wsync-bench-ray-") as d:
        for way, run in (("direct", _direct_way), ("ray", _ray_way)):
            try:
                out[way] = run(Path(d))
            except Exception as e:  # recorded: the report says what stopped it
                out[way] = {"error": repr(e)[:400]}
                _say(f"{way}: {e!r}")
    return out
