"""A fleet that keeps training when engines die, come back and join: the ``exclude`` fleet policy.

Real engine processes (the ``tiny`` synthetic model, so that a sync is many small buckets), one
gloo group, a real ``TrainerClient``. An engine is SIGKILLed between syncs or in the middle of a
broadcast; under ``exclude`` the survivors publish, bit-exact, and the result names the one left out;
under ``fail`` the sync fails as before; below the policy's minimum nothing is published anywhere.
A killed engine restarted on its port is recognised, caught up and covered by the next sync; an
engine added between syncs catches up to the fleet's version, by broadcast or from the trainer's
checkpoint on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import ENV, ROOT, assert_serve, served

from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, cli_command, spawn_engine, spawn_process, stop_all, wait_all
from wsync_grpc.trainer import FleetPolicy, SyncError, SyncProgress, TrainerClient

PRESET = "tiny"
SMALL_BUCKETS = {"bucket_bytes": 16 << 10}


def weights(seed: int) -> dict[str, torch.Tensor]:
    return synthetic.build(PRESET, seed=seed, dtype=torch.float32)


def serve_args(root: Path) -> list[str]:
    return ["--synthetic", PRESET, "--dtype", "float32", "--grace", "1", "--checkpoint-root", str(root)]


def start(tmp_path: Path, name: str, root: Path, port: int = 0) -> EngineProcess:
    """One engine; on ``port`` when given (a restart), else on a free one."""
    if port == 0:
        return spawn_engine(
            serve_args(root), port_file=tmp_path / f"{name}.port", log=tmp_path / f"{name}.log", env=ENV, cwd=ROOT,
            wait=False,
        )  # fmt: skip
    command = cli_command(
        "serve", *serve_args(root), "--port", str(port), "--port-file", str(tmp_path / f"{name}.port")
    )
    return spawn_process(
        command, ready_file=tmp_path / f"{name}.port", log=tmp_path / f"{name}-again.log", env=ENV, cwd=ROOT
    )


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    root = tmp_path / "checkpoints"
    root.mkdir()
    procs = [start(tmp_path, f"engine{i}", root) for i in range(3)]
    try:
        wait_all(procs)
        yield procs
    finally:
        stop_all(procs, grace_s=2)


def client(engines: list[EngineProcess], **kw: object) -> TrainerClient:
    return TrainerClient([e.target for e in engines], rpc_timeout_s=30, group_timeout_s=60, **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_an_engine_killed_between_syncs_is_left_out_then_caught_up_when_it_comes_back(
    fleet: list[EngineProcess], tmp_path: Path
) -> None:
    victim = fleet[1]
    survivors = [fleet[0], fleet[2]]
    v1, v2, v3 = weights(1), weights(2), weights(3)
    with client(fleet, policy=FleetPolicy.exclude(min_engines=2)) as c:
        first = c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        assert first.excluded == {} and first.attempts == 1
        victim.kill()

        # Under fail (this sync's own policy) the fleet stops, as before: nothing is published.
        with pytest.raises(SyncError) as failed:
            c.sync(v2.items(), "v2", policy=FleetPolicy(), **SMALL_BUCKETS)
        assert victim.target in failed.value.failures and failed.value.published == "none"
        assert_serve([s.target for s in survivors], "v1", v1)

        # Under exclude the survivors publish, bit-exact, and the result names the one left out.
        second = c.sync(v2.items(), "v2", **SMALL_BUCKETS)
        assert list(second.excluded) == [victim.target]
        assert second.excluded[victim.target].code is not None
        assert sorted(second.engines) == sorted(s.target for s in survivors)
        assert_serve([s.target for s in survivors], "v2", v2)
        members = c.members()
        assert members[victim.target].state == "excluded" and members[victim.target].reason is not None
        assert {members[s.target].state for s in survivors} == {"in_sync"}
        excluded_total = c.metrics_registry.get_sample_value(
            "wsync_trainer_engines_excluded_total", {"target": victim.target}
        )
        assert excluded_total is not None and excluded_total >= 1

        # Restarted on its port with its base weights: recognised, and the next sync covers all three.
        port = int(victim.target.rsplit(":", 1)[1])
        fleet[1] = start(tmp_path, "engine1", tmp_path / "checkpoints", port=port)
        third = c.sync(v3.items(), "v3", **SMALL_BUCKETS)
        assert third.excluded == {} and third.rejoined == [victim.target]
        assert sorted(third.engines) == sorted(e.target for e in fleet)
        assert {m.state for m in c.members().values()} == {"in_sync"}
    assert_serve([e.target for e in fleet], "v3", v3)


@pytest.mark.timeout(300)
def test_an_engine_killed_mid_broadcast_is_left_out_and_the_survivors_publish_all_or_nothing(
    fleet: list[EngineProcess],
) -> None:
    victim = fleet[2]
    v1, v2 = weights(1), weights(2)
    killed: list[int] = []

    def progress(p: SyncProgress) -> None:
        if p.buckets_sent == 2 and not killed:
            killed.append(p.buckets_sent)
            victim.kill()

    with client(fleet, policy=FleetPolicy.exclude(min_fraction=0.5)) as c:
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        result = c.sync(v2.items(), "v2", progress=progress, **SMALL_BUCKETS)
    assert killed, "the sync had fewer than two buckets"
    assert list(result.excluded) == [victim.target]
    assert result.attempts == 2  # abandoned everywhere mid-broadcast, then run again over the two
    assert sorted(result.engines) == sorted(e.target for e in fleet[:2])
    assert_serve([e.target for e in fleet[:2]], "v2", v2)


@pytest.mark.timeout(300)
def test_below_the_minimum_nothing_is_published_anywhere(fleet: list[EngineProcess]) -> None:
    v1, v2 = weights(1), weights(2)
    with client(fleet, policy=FleetPolicy.exclude(min_engines=3)) as c:
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        fleet[0].kill()
        with pytest.raises(SyncError) as e:
            c.sync(v2.items(), "v2", **SMALL_BUCKETS)
    assert e.value.published == "none" and fleet[0].target in e.value.failures
    assert "requires 3" in str(e.value)
    assert_serve([p.target for p in fleet[1:]], "v1", v1)


@pytest.mark.timeout(300)
def test_an_engine_added_between_syncs_catches_up_then_takes_part(fleet: list[EngineProcess], tmp_path: Path) -> None:
    first, newcomer = fleet[:2], fleet[2]
    v1, v2 = weights(1), weights(2)
    with client(first) as c:
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        before = {t: s.updates_completed for t, s in c.status().items()}
        member = c.add_engine(newcomer.target)
        assert member.state == "behind"
        with pytest.raises(ValueError, match="pass its tensors"):
            c.catch_up()  # v1 was broadcast: no checkpoint to read it from
        caught = c.catch_up(v1.items())
        assert caught is not None and list(caught.engines) == [newcomer.target]
        assert_serve([newcomer.target], "v1", v1)
        # The others were not touched by the catch-up.
        assert {t: s.updates_completed for t, s in c.status().items() if t in before} == before
        assert c.catch_up() is None  # nobody is behind any more
        result = c.sync(v2.items(), "v2", **SMALL_BUCKETS)
        assert sorted(result.engines) == sorted(e.target for e in fleet)
        assert c.targets == [e.target for e in fleet]
    assert_serve([e.target for e in fleet], "v2", v2)


@pytest.mark.timeout(300)
def test_a_restarted_engine_catches_up_from_the_trainers_checkpoint(fleet: list[EngineProcess], tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    v1 = weights(1)
    with client(fleet) as c:
        c.save_and_sync(v1.items(), root / "step-1", "v1")
        victim = fleet[0]
        port = int(victim.target.rsplit(":", 1)[1])
        victim.kill()
        fleet[0] = start(tmp_path, "engine0", root, port=port)
        assert served([fleet[0].target])[fleet[0].target][0] == ""  # its base weights
        caught = c.catch_up()
        assert caught is not None and list(caught.engines) == [victim.target]
        assert caught.wire_bytes == 0  # read from the checkpoint, not broadcast
        assert {m.state for m in c.members().values()} == {"in_sync"}
    assert_serve([e.target for e in fleet], "v1", v1)


@pytest.mark.timeout(300)
def test_a_removed_engine_is_released_and_no_longer_synced(fleet: list[EngineProcess]) -> None:
    v1, v2 = weights(1), weights(2)
    with client(fleet, policy=FleetPolicy.exclude()) as c:
        c.sync(v1.items(), "v1", **SMALL_BUCKETS)
        gone = fleet[1]
        left = c.remove_engine(gone.target)
        assert left is not None and left.was_member
        assert gone.target not in c.targets and gone.target not in c.members()
        result = c.sync(v2.items(), "v2", **SMALL_BUCKETS)
        assert sorted(result.engines) == sorted(e.target for e in (fleet[0], fleet[2]))
        # Released: another trainer may take it at once.
        with TrainerClient([gone.target], rpc_timeout_s=30) as other:
            other.sync(v2.items(), "other-v2", **SMALL_BUCKETS)
    assert_serve([gone.target], "other-v2", v2)
