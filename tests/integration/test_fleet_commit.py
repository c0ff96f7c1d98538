"""All or nothing across a fleet: a staged update is published on every engine or on none.

Three real engine processes, one of them SIGKILLed at each phase of a real ``TrainerClient.sync``:
in the middle of the broadcast, after the broadcast but before every engine verified, and once every
engine verified (before the applying Complete). The survivors serve the old version in the first two
cases and the new one in the last, and the trainer's ``SyncError`` says which (``published``).
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
from wsync_grpc.trainer import SyncError, SyncProgress, TrainerClient

PRESET = "0.25gb"


def weights(seed: int) -> dict[str, torch.Tensor]:
    return synthetic.build(PRESET, seed=seed, dtype=torch.bfloat16)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    procs = [
        spawn_engine(
            ["--synthetic", PRESET, "--dtype", "bfloat16", "--grace", "1"],
            port_file=tmp_path / f"engine{i}.port",
            log=tmp_path / f"engine{i}.log",
            env=ENV,
            cwd=ROOT,
            wait=False,
        )
        for i in range(3)
    ]
    try:
        wait_all(procs)
        yield procs
    finally:
        stop_all(procs, grace_s=2)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kill_at", ["mid-broadcast", "broadcast", "verified"])
def test_a_fleet_publishes_on_every_engine_or_on_none(engines: list[EngineProcess], kill_at: str) -> None:
    old, new = weights(1), weights(2)
    victim, survivors = engines[1], [engines[0], engines[2]]
    phases: list[str] = []

    def on_phase(phase: str) -> None:
        phases.append(phase)
        if phase == kill_at:
            victim.kill()

    def progress(p: SyncProgress) -> None:
        if kill_at == "mid-broadcast" and p.buckets_sent == 2:
            victim.kill()

    with TrainerClient([e.target for e in engines], group_timeout_s=60, rpc_timeout_s=30) as c:
        c.sync(old.items(), "v1", bucket_bytes=16 << 20)
        with pytest.raises(SyncError) as e:
            c.sync(new.items(), "v2", bucket_bytes=16 << 20, on_phase=on_phase, progress=progress)
    err = e.value
    assert victim.target in err.failures, err
    with TrainerClient([s.target for s in survivors], rpc_timeout_s=30) as reader:
        statuses = reader.status()
        sums = {t: {x.name: x.sha256 for x in r.checksums} for t, r in reader.checksums().items()}
    if kill_at == "verified":
        # Every engine had verified v2: the decision was to publish, and every survivor serves it.
        assert phases[-1] == "verified" and err.stage == "apply" and err.published == "partial"
        assert sorted(err.results) == sorted(s.target for s in survivors)
        expected, version = new, "v2"
    else:
        assert "verified" not in phases and err.published == "none" and not err.results
        assert err.stage in ("broadcast", "verify"), err.stage
        expected, version = old, "v1"
    want = {n: tensor_sha256(t) for n, t in expected.items()}
    for s in survivors:
        assert statuses[s.target].weight_version == version, (kill_at, s.target)
        assert sums[s.target] == want, f"{s.target} serves weights other than {version}'s"
        assert not statuses[s.target].dirty
