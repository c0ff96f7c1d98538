"""wsync engines and trainer ranks as Ray actors over a real local Ray cluster of three nodes (issue 42).

One cluster for the module (``ray.cluster_utils.Cluster``: a head and two more nodes, two CPUs and an 80 MiB
object store each, no dashboard), three real ``wsync serve --synthetic tiny`` engines launched by
:func:`wsync_grpc.ray.launch_engines` over a SPREAD placement group (one bundle, so one engine, per node), the
trainer on the driver. Nothing is mocked: engines are killed through Ray (``ray.kill``) and by SIGKILL of
their process; Ray restarts them on new ports; the trainer finds them there (its resolver asks their actors)
and brings them to the fleet's version, checked bit-exact by SHA-256 of every tensor. A sharded trainer's two
FSDP2 ranks run as actors on two nodes (:mod:`ray_ranks`), forming their group and their client through Ray.
Detached engines outlive their driver, release its leases when it is SIGKILLed, and a new driver finds them by
name and syncs into them.
Every engine process started here carries a marker in its environment, so that the processes left behind are
counted exactly (other tests' engines, and other users' on the machine, are not).

Marked ``serial``: ``make test`` runs it in its serial pass, so one cluster starts, not one per xdist worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from support import ENV, ROOT, assert_serve, ray_cluster, served

from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import FleetPolicy, SyncProgress, TrainerClient

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytest.importorskip("ray.cluster_utils")

import ray_ranks  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from wsync_grpc.ray import (  # noqa: E402
    EngineHandle,
    EngineSpec,
    TrainerRendezvous,
    find_engines,
    launch_engines,
    stop_engines,
    trainer_client,
)

ray.cloudpickle.register_pickle_by_value(ray_ranks)  # Ray's workers cannot import tests/: the rank goes by value

pytestmark = [
    pytest.mark.serial,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="engines end with their actor on Linux"),
]

NODES = 3
CPUS = 2
"""Each node's CPUs, as Ray counts them: one for an engine of the module's fleet, one for a driver's own."""
STORE_BYTES = 80 * 1024**2
"""Each node's object store (Ray's default takes 30% of the RAM per node)."""
MARKER = "WSYNC_RAY_TEST_RUN"
RUN = uuid.uuid4().hex
"""The marker's value in the environment of every engine this module starts."""
NAME = f"ray-{RUN[:8]}"
"""The start of the names of the engines this module starts (and of their temporary directories)."""
PRESET = "tiny"
SMALL_BUCKETS = {"bucket_bytes": 16 << 10}
GONE_WITHIN_S = 10.0
"""How long an engine may outlive its actor (or driver) before it counts as left behind, in seconds."""
SPEC = EngineSpec(
    serve_args=("--synthetic", PRESET, "--dtype", "float32", "--grace", "1"),
    insecure=True,  # the cluster's node IP is not loopback: plaintext, no token (a test machine's private network)
    env={MARKER: RUN},
)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return synthetic.build(PRESET, seed=seed, dtype=torch.float32)


def our_engines() -> set[int]:
    """Pids of the live engine processes this module started (its marker in their environment)."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "wsync_grpc.tools.cli" not in " ".join(p.info["cmdline"] or ()) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(MARKER) == RUN:
                found.add(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = GONE_WITHIN_S) -> float:
    """Poll ``condition`` until it holds; return the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"timed out after {timeout_s} s waiting until {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def current(handles: list[EngineHandle]) -> list[str]:
    """Where each engine serves now (its actor says)."""
    return [h.current_target(timeout_s=60) for h in handles]


def engine_pids(handles: list[EngineHandle]) -> set[int]:
    return {h.info(timeout_s=60).engine_pid for h in handles}


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    head = {"num_cpus": CPUS, "object_store_memory": STORE_BYTES, "include_dashboard": False}
    try:
        with ray_cluster(head, nodes=NODES - 1, node_cpus=CPUS, store_bytes=STORE_BYTES) as c:
            yield c
    finally:
        for leftover in Path(tempfile.gettempdir()).glob(f"wsync-{NAME}*"):  # the files of killed engines
            shutil.rmtree(leftover, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(cluster: object) -> Iterator[list[EngineHandle]]:
    """Three engines, SPREAD over the three nodes, each restarted by Ray up to twice."""
    handles = launch_engines(NODES, SPEC, strategy="SPREAD", max_restarts=2, name=f"{NAME}-fleet")
    try:
        yield handles
    finally:
        stop_engines(handles, grace_s=5)
        wait_until(lambda: not our_engines(), "every engine ended")


def client(handles: list[EngineHandle]) -> TrainerClient:
    return trainer_client(
        handles, resolve_timeout_s=60, rpc_timeout_s=30, group_timeout_s=60, policy=FleetPolicy.exclude(min_engines=2)
    )


def test_three_engines_spread_over_three_nodes_pickle_and_sync_bit_exact(engines: list[EngineHandle]) -> None:
    assert len({h.node_id for h in engines}) == NODES, "SPREAD put two engines on one node"
    node_ip = ray.util.get_node_ip_address()
    assert all(h.target.rsplit(":", 1)[0] == node_ip for h in engines), [h.target for h in engines]
    assert {h.target for h in engines} == set(current(engines))
    assert our_engines() == engine_pids(engines)
    for h in engines:
        health = h.health()
        assert health.running and health.serving, health

    # The handles travel through Ray's object store and through pickle, and still reach their actors.
    through_ray = ray.get(ray.put(engines))
    through_pickle = pickle.loads(pickle.dumps(engines))
    for copies in (through_ray, through_pickle):
        assert [(h.name, h.target, h.node_id, h.bundle_index) for h in copies] == [
            (h.name, h.target, h.node_id, h.bundle_index) for h in engines
        ]
        assert [h.current_target() for h in copies] == [h.target for h in engines]

    v1 = weights(1)
    with client(through_ray) as c:
        result = c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        assert sorted(result.engines) == sorted(h.target for h in engines) and result.excluded == {}
    assert_serve([h.target for h in engines], "v1", v1)


def test_what_a_handle_pickles(engines: list[EngineHandle]) -> None:
    """The handle's fields, nothing of the spec (arguments, environment), and a token only if the user put it."""
    h = engines[0]
    data = pickle.dumps(h)
    assert RUN.encode() not in data and MARKER.encode() not in data  # the spec's environment stays with the actor
    assert b"--synthetic" not in data and b"PRIVATE KEY" not in data
    assert h.token is None
    secret = "tok-" + uuid.uuid4().hex
    with_token = EngineHandle(h.name, h.actor, h.target, h.node_id, h.placement_group, h.bundle_index, secret)
    assert secret.encode() in pickle.dumps(with_token)
    assert secret not in repr(with_token) and h.target in repr(with_token)
    assert pickle.loads(pickle.dumps(with_token)).token == secret


def test_an_engine_actor_killed_mid_sync_is_left_out_restarted_on_a_new_port_and_caught_up(
    engines: list[EngineHandle],
) -> None:
    v1, v2 = weights(11), weights(12)
    victim = engines[2]
    killed: list[float] = []

    def kill_at_second_bucket(p: SyncProgress) -> None:
        if p.buckets_sent == 2 and not killed:
            killed.append(time.monotonic())
            ray.kill(victim.actor, no_restart=False)

    with client(engines) as c:
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        before = c.targets
        old = before[2]
        result = c.sync(v2.items(), "v2", progress=kill_at_second_bucket, **SMALL_BUCKETS)
        assert killed, "the sync had fewer than two buckets"
        published = time.monotonic()
        assert list(result.excluded) == [old] and result.attempts == 2
        assert sorted(result.engines) == sorted(before[:2])
        assert_serve(before[:2], "v2", v2)

        caught = c.catch_up(v2.items())
        done = time.monotonic()
        new = victim.current_target()
        assert new != old, "the restarted engine serves on its old port"
        assert caught is not None and list(caught.engines) == [new]
        assert c.targets == [*before[:2], new]  # followed in its place, without being told
        assert {m.state for m in c.members().values()} == {"in_sync"}
    assert_serve([*before[:2], new], "v2", v2)
    assert our_engines() == engine_pids(engines), "an engine process was left behind"
    print(f"\nray.kill mid-sync: survivors published {published - killed[0]:.2f} s after the kill; "
          f"restarted at {new} (was {old}), re-resolved and caught up {done - killed[0]:.2f} s after it")  # fmt: skip


def test_an_engine_process_sigkilled_between_syncs_ends_its_actor_and_the_next_sync_brings_it_back(
    engines: list[EngineHandle],
) -> None:
    v1, v2 = weights(21), weights(22)
    victim = engines[0]
    with client(engines) as c:
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        old, others = c.targets[0], c.targets[1:]
        info = victim.info()
        assert info.target == old
        os.kill(info.engine_pid, signal.SIGKILL)
        start = time.monotonic()
        # Its actor ends (its watcher sees the engine gone): Ray restarts it, with a new engine.
        wait_until(lambda: not psutil.pid_exists(info.actor_pid), "the actor ended with its engine")

        result = c.sync(v2.items(), "v2", **SMALL_BUCKETS)
        done = time.monotonic()
        new = victim.current_target()
        assert new != old
        assert result.excluded == {} and result.rejoined == [new]
        assert sorted(result.engines) == sorted([new, *others])
        assert {m.state for m in c.members().values()} == {"in_sync"}
    assert_serve([new, *others], "v2", v2)
    assert our_engines() == engine_pids(engines), "an engine process was left behind"
    print(f"\nSIGKILL of an engine process: restarted at {new} (was {old}); the next sync brought it back "
          f"{done - start:.2f} s after the kill")  # fmt: skip


def test_fsdp2_ranks_as_actors_form_their_group_through_ray_sync_bit_exact_and_follow_a_restarted_engine(
    engines: list[EngineHandle],
) -> None:
    """Two FSDP2 ranks as actors on two nodes: rank 0's address reaches rank 1 through Ray, never by hand; the
    driver runs a train step on both, then a sync on both; an engine's actor killed between syncs is restarted
    by Ray and the next sync takes it in at its new port (rank 0's resolver asked its actor)."""
    rendezvous = ray.get(ray.put(TrainerRendezvous.create(2)))  # it pickles, as it travels to the ranks
    group = placement_group([{"CPU": 0.5}] * 2, strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    options = {"policy": FleetPolicy.exclude(min_engines=2), "resolve_timeout_s": 60, "rpc_timeout_s": 30}
    ranks = [
        ray.remote(ray_ranks.Rank)
        .options(
            num_cpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)
        )
        .remote(rendezvous, r, engines, PRESET, group_timeout_s=60, bucket_bytes=16 << 10, **options)
        for r in range(2)
    ]

    def on_both(method: str, *args: object) -> list[Any]:
        return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=120)

    try:
        where = on_both("where")
        assert [w["rank"] for w in where] == [0, 1] and where[0]["node"] != where[1]["node"], where
        assert where[0]["master"] == where[1]["master"] == ray.util.get_node_ip_address()
        for step in (1, 2):
            losses = on_both("train_step")
            assert losses[0] == losses[1]
            results = on_both("sync", f"step-{step}")
            assert results[0] == results[1] and results[0]["excluded"] == [], results
            targets = on_both("targets")[0]
            assert sorted(results[0]["engines"]) == sorted(targets) == sorted(current(engines))
            assert_sums(targets, f"step-{step}", on_both("sums")[0])

        victim = engines[1]
        info = victim.info()
        ray.kill(victim.actor, no_restart=False)
        killed = time.monotonic()
        wait_until(lambda: not psutil.pid_exists(info.engine_pid), "the engine ended with its actor")
        on_both("train_step")
        result = on_both("sync", "step-3")[0]
        took = time.monotonic() - killed
        new = victim.current_target()
        assert new != info.target and result["rejoined"] == [new] and result["excluded"] == [], result
        targets = on_both("targets")[0]
        assert targets[1] == new and sorted(result["engines"]) == sorted(targets)
        assert_sums(targets, "step-3", on_both("sums")[0])
        on_both("close")
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(group)
    assert our_engines() == engine_pids(engines), "an engine process was left behind"
    print(f"\nFSDP2 ranks as actors: an engine's actor killed; the next sync (every rank) took it in at {new} "
          f"(was {info.target}) {took:.2f} s after the kill")  # fmt: skip


def assert_sums(targets: list[str], version: str, expected: dict[str, str]) -> None:
    for target, (v, sums) in served(targets).items():
        assert v == version, (target, v)
        assert {n: sums[n] for n in expected} == expected, target


DRIVER = """
import json, sys, ray
from wsync_grpc.ray import EngineSpec, launch_engines
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)
spec = EngineSpec(serve_args=("--synthetic", "tiny", "--grace", "1"), insecure=True, env={sys.argv[2]: sys.argv[3]})
handles = launch_engines(2, spec, strategy="SPREAD", name=sys.argv[4])
infos = [h.info() for h in handles]
print(json.dumps({"engines": [i.engine_pid for i in infos], "actors": [i.actor_pid for i in infos]}), flush=True)
sys.stdin.read()
"""
"""A driver that launches two engines, prints their pids and waits (to be killed)."""


def test_engines_owned_by_a_driver_end_with_it(cluster: object, engines: list[EngineHandle]) -> None:
    address = cluster.address  # type: ignore[attr-defined]
    ours_before = our_engines()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, address, MARKER, RUN, f"{NAME}-driver"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"}, cwd=ROOT,
    )  # fmt: skip
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line, "the driver exited before its engines served"
        pids = json.loads(line)
        assert set(pids["engines"]) <= our_engines()
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        start = time.monotonic()
        took = wait_until(lambda: our_engines() == ours_before, "the driver's engines ended with it", 30.0)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
    assert time.monotonic() - start < 30.0

    def actors_gone() -> bool:  # Ray reaps a dead owner's actors a little later than their engines end
        return not any(_alive(p) for p in pids["actors"])

    reaped = wait_until(actors_gone, "Ray ended the dead driver's actors", 30.0)
    print(f"\ndriver SIGKILLed: its 2 engines ended {took:.2f} s later, their actors {reaped:.2f} s after that")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


DETACHED_DRIVER = """
import json, sys, ray, torch
from wsync_grpc.engines import synthetic
from wsync_grpc.ray import EngineSpec, launch_engines, trainer_client
address, marker, run, name, namespace = sys.argv[1:6]
ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False)
spec = EngineSpec(serve_args=("--synthetic", "tiny", "--dtype", "float32", "--grace", "1"), insecure=True,
                  env={marker: run})
handles = launch_engines(2, spec, strategy="SPREAD", name=name, detached=True)
client = trainer_client(handles, rpc_timeout_s=30, group_timeout_s=60)
client.sync(synthetic.build("tiny", seed=31, dtype=torch.float32).items(), "v1", bucket_bytes=16 << 10)
infos = [h.info() for h in handles]
print(json.dumps({"targets": [i.target for i in infos], "engines": [i.engine_pid for i in infos],
                  "owner": client.owner}), flush=True)
sys.stdin.read()
"""
"""A driver that launches two detached engines, syncs into them (so it holds their leases), prints them and
waits (to be killed)."""


def test_detached_engines_outlive_their_driver_release_its_lease_and_a_new_driver_takes_them_over(
    cluster: object, engines: list[EngineHandle]
) -> None:
    address = cluster.address  # type: ignore[attr-defined]
    ours_before = our_engines()
    name, namespace = f"{NAME}-detached", f"wsync-test-{RUN[:8]}"
    driver = subprocess.Popen(
        [sys.executable, "-c", DETACHED_DRIVER, address, MARKER, RUN, name, namespace],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"}, cwd=ROOT,
    )  # fmt: skip
    taken: list[EngineHandle] = []
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line, "the driver exited before its engines served"
        launched = json.loads(line)
        targets = launched["targets"]
        with TrainerClient(targets, rpc_timeout_s=30) as reader:
            owners = {t: s.owner for t, s in reader.status().items()}
            assert all(o is not None and o.owner == launched["owner"] for o in owners.values()), owners
            driver.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            driver.wait(10)
            wait_until(lambda: all(s.owner is None for s in reader.status().values()), "every lease was released", 10.0)
            released = time.monotonic() - killed
        assert released < 2.0, f"the leases were released {released:.2f} s after the driver's death"
        assert set(launched["engines"]) <= our_engines(), "a detached engine ended with its driver"

        taken = find_engines(name, namespace=namespace)  # the new driver: this process
        assert [h.target for h in taken] == targets and [h.name for h in taken] == [f"{name}-0", f"{name}-1"]
        assert all(h.placement_group is not None for h in taken)
        v2 = weights(32)
        with trainer_client(taken, rpc_timeout_s=30, group_timeout_s=60) as c:
            result = c.sync(v2.items(), "v2", **SMALL_BUCKETS)
            assert sorted(result.engines) == sorted(targets) and result.excluded == {}
        took_over = time.monotonic() - killed
        assert_serve(targets, "v2", v2)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
        if not taken:
            with contextlib.suppress(Exception):
                taken = find_engines(name, namespace=namespace, timeout_s=30)
        stop_engines(taken, grace_s=5)
    wait_until(lambda: our_engines() == ours_before, "the detached engines ended once stopped", 30.0)
    print(f"\ndriver SIGKILLed: its 2 detached engines lived on, their leases released {released:.2f} s later; "
          f"a new driver found them by name and synced into them {took_over:.2f} s after the kill")  # fmt: skip
