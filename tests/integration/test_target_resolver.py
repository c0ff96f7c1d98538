"""The trainer follows an engine restarted at another address: ``TrainerClient.resolver``, no Ray involved.

Real engine processes (the ``tiny`` synthetic model), a real ``TrainerClient``. An engine is SIGKILLed and a new
one started on another port, as a supervisor (a Ray actor: ``tests/integration/test_ray_fleet.py``) would; the
client's resolver (here a plain function over a dict) says where it went. At ``catch_up``, or at the status
probe of the next sync under ``exclude``, the member is replaced there, in its place, and brought to the fleet's
version, bit-exact. A resolver that fails or names nothing new changes nothing: the member is left out as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import ENV, ROOT

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, spawn_engine, stop_all, wait_all
from wsync_grpc.trainer import FleetPolicy, TrainerClient

PRESET = "tiny"
SMALL_BUCKETS = {"bucket_bytes": 16 << 10}


def weights(seed: int) -> dict[str, torch.Tensor]:
    return synthetic.build(PRESET, seed=seed, dtype=torch.float32)


def start(tmp_path: Path, name: str, wait: bool = True) -> EngineProcess:
    args = ["--synthetic", PRESET, "--dtype", "float32", "--grace", "1"]
    return spawn_engine(args, port_file=tmp_path / f"{name}.port", log=tmp_path / f"{name}.log", env=ENV, cwd=ROOT,
                        wait=wait)  # fmt: skip


def assert_serve(targets: list[str], version: str, tensors: dict[str, torch.Tensor]) -> None:
    expected = {n: tensor_sha256(t) for n, t in tensors.items()}
    with TrainerClient(targets, rpc_timeout_s=30) as reader:
        versions = {t: s.weight_version for t, s in reader.status().items()}
        sums = {t: {x.name: x.sha256 for x in c.checksums} for t, c in reader.checksums().items()}
    for t in targets:
        assert versions[t] == version, (t, versions[t])
        assert {n: sums[t][n] for n in expected} == expected, t


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    procs = [start(tmp_path, f"engine{i}", wait=False) for i in range(3)]
    try:
        wait_all(procs)
        yield procs
    finally:
        stop_all(procs, grace_s=2)


@pytest.mark.timeout(300)
def test_a_restarted_engine_is_followed_to_its_new_port_at_catch_up_and_at_the_next_sync(
    fleet: list[EngineProcess], tmp_path: Path
) -> None:
    moved: dict[str, str] = {}
    asked: list[list[str]] = []

    def resolver(targets: list[str]) -> dict[str, str]:
        asked.append(targets)
        return {t: moved[t] for t in targets if t in moved}

    v1, v2 = weights(1), weights(2)
    targets = [e.target for e in fleet]
    with TrainerClient(targets, rpc_timeout_s=30, group_timeout_s=60, policy=FleetPolicy.exclude()) as c:
        assert c.resolver is None
        c.resolver = resolver
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        assert asked == []  # every member answered: nobody is looked up

        # catch_up: engine 1 restarted on another port, with its base weights.
        fleet[1].kill()
        fleet.append(start(tmp_path, "engine1-again"))
        moved[targets[1]] = fleet[-1].target
        caught = c.catch_up(v1.items())
        assert asked == [[targets[1]]]
        assert caught is not None and list(caught.engines) == [fleet[-1].target]
        followed = [targets[0], fleet[-1].target, targets[2]]
        assert c.targets == followed  # in its place: the rank order holds
        assert {m.state for m in c.members().values()} == {"in_sync"}
        assert_serve(followed, "v1", v1)

        # The next sync under exclude: engine 0 restarted elsewhere is found at the probe and takes part.
        fleet[0].kill()
        fleet.append(start(tmp_path, "engine0-again"))
        moved[targets[0]] = fleet[-1].target
        result = c.sync(v2.items(), "v2", **SMALL_BUCKETS)
        followed[0] = fleet[-1].target
        assert result.excluded == {} and result.rejoined == [followed[0]]
        assert sorted(result.engines) == sorted(followed) and c.targets == followed
    assert_serve(followed, "v2", v2)


@pytest.mark.timeout(300)
def test_a_resolver_that_fails_or_finds_nothing_new_changes_nothing(fleet: list[EngineProcess]) -> None:
    targets = [e.target for e in fleet]
    answers: list[object] = [RuntimeError("the supervisor is unreachable"), {targets[2]: targets[0]}, {}]

    def resolver(asked: list[str]) -> dict[str, str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, dict)
        return answer

    v1, v2, v3, v4 = weights(1), weights(2), weights(3), weights(4)
    with TrainerClient(targets, rpc_timeout_s=30, group_timeout_s=60, policy=FleetPolicy.exclude()) as c:
        c.resolver = resolver
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        fleet[2].kill()
        for version, tensors in (("v2", v2), ("v3", v3), ("v4", v4)):  # raises; names a member; names nothing
            result = c.sync(tensors.items(), version, **SMALL_BUCKETS)
            assert list(result.excluded) == [targets[2]], version
            assert c.targets == targets
        assert answers == []
    assert_serve(targets[:2], "v4", v4)
