"""A mixed fleet in one sync and one fleet commit (issue 46, item 3): engines on the trainer's host through shared
memory, the others by broadcast (``sync(transport={target: "shared_memory"})``, :mod:`wsync_grpc.trainer.mixed`).

Real gRPC servers on loopback ports serving synthetic :class:`TensorEngine` s, a real :class:`TrainerClient`; checked
against the engines' own ``GetWeightChecksums`` and tensors, and what this process maps afterwards (the fixtures of
``test_shared_memory``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import status, tensor_server
from test_shared_memory import SMALL, listening_sockets, mappings, served, sums

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import in_process_server
from wsync_grpc.trainer import FleetPolicy, SyncError, SyncProgress, TrainerClient
from wsync_grpc.trainer.options import TransportName

pytestmark = pytest.mark.timeout(120)

OTHER = synthetic.LlamaShape(hidden=32, intermediate=86, layers=2, vocab=1000, heads=4, kv_heads=2, tied=True)
"""Another model's shapes: an engine serving it refuses the tiny model's Prepare (INVALID_ARGUMENT)."""


@contextlib.contextmanager
def three(remote: str = "tiny") -> Iterator[tuple[list[Any], TrainerClient]]:
    """Three tensor engines (``a``, ``b`` local, ``c`` remote, ``c`` serving ``OTHER`` unless ``remote`` is
    ``"tiny"``) and a client of all three; yields ``[(server, engine, stub)...]`` and the client."""
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(tensor_server("tiny", seed=s)) for s in (0, 1)]
        if remote == "tiny":
            engines.append(stack.enter_context(tensor_server("tiny", seed=2)))
        else:
            e = TensorEngine(synthetic.build(OTHER, seed=2), aliases=synthetic.aliases(OTHER))
            srv, stub = stack.enter_context(in_process_server(e))
            engines.append((srv, e, stub))
        client = stack.enter_context(TrainerClient([srv.address for srv, _e, _s in engines], **SMALL))
        yield engines, client


def local_of(engines: list[Any]) -> dict[str, TransportName]:
    """The mapping that sends ``a`` and ``b`` through shared memory (``c`` by broadcast, unnamed)."""
    return {engines[0][0].address: "shared_memory", engines[1][0].address: "shared_memory"}


def test_a_mixed_fleet_takes_one_sync_bit_exact_in_one_commit() -> None:
    """Two engines through shared memory and one by broadcast, in one sync: one result naming all three in rank
    order, every one bit-exact; a group formed for the remote engine alone (and kept for the next mixed sync); no
    engine mapping or socket left; a plain broadcast sync afterwards re-forms the group over everyone."""
    aliases = synthetic.aliases("tiny")
    v1, v2, v3 = (synthetic.build("tiny", seed=s) for s in (7, 8, 9))
    with three() as (engines, client):
        targets = [srv.address for srv, _e, _s in engines]
        progress: list[SyncProgress] = []
        phases: list[str] = []
        r = client.sync(v1.items(), "v1", transport=local_of(engines), progress=progress.append, on_phase=phases.append)
        assert list(r.engines) == targets and r.weight_version == "v1"
        assert all(e.buckets_verified == r.bucket_count > 3 for e in r.engines.values()), r.engines
        assert r.wire_bytes == 2 * progress[-1].bytes_sent  # each part sent the payload once
        assert len({p.update_id for p in progress}) == 2 and phases.count("verified") == 2
        assert phases[-1] == "applied" and r.init_seconds > 0
        got = served(client)
        assert got == {t: sums(v1, got[t], aliases) for t in targets}
        for _srv, engine, stub in engines:
            for n, t in v1.items():
                assert torch.equal(engine.tensors[n], t), n
            st = status(stub)
            assert (st.weight_version, st.paused, st.dirty, st.HasField("update")) == ("v1", False, False, False)
        assert client.group is not None and client.group.world_size == 2  # the trainer and the remote engine
        assert not status(engines[0][2]).HasField("group")  # the local engines joined none
        assert "r--s" not in mappings() and not listening_sockets()
        assert {m.state for m in client.members().values()} == {"in_sync"}

        group = client.group
        r2 = client.sync(v2.items(), "v2", transport=local_of(engines))
        assert list(r2.engines) == targets and client.group is group  # the remote engine's group served again
        got = served(client)
        assert got == {t: sums(v2, got[t], aliases) for t in targets}

        r3 = client.sync(v3.items(), "v3")  # everyone by broadcast: the group re-formed over all three
        assert list(r3.engines) == targets and client.group is not None and client.group.world_size == 4
        got = served(client)
        assert got == {t: sums(v3, got[t], aliases) for t in targets}


def test_a_mixed_fleet_takes_deltas() -> None:
    """With deltas on, the second mixed sync is a delta to all three engines (each part carries it), bit-exact."""
    aliases = synthetic.aliases("tiny")
    v1 = synthetic.build("tiny", seed=7)
    v2 = {n: t.clone() for n, t in v1.items()}
    for t in v2.values():
        t.view(-1)[::97] += 1
    with three() as (engines, client):
        targets = [srv.address for srv, _e, _s in engines]
        client.sync(v1.items(), "v1", transport=local_of(engines), delta=True)
        r = client.sync(v2.items(), "v2", transport=local_of(engines), delta=True)
        assert r.delta is not None and r.delta.base_version == "v1" and not r.delta.whole_targets, r.delta
        assert list(r.engines) == targets
        got = served(client)
        assert got == {t: sums(v2, got[t], aliases) for t in targets}


def test_the_broadcast_part_refused_applies_nothing_on_the_shared_memory_engines() -> None:
    """The remote engine refuses the broadcast part's Prepare (another model): the shared-memory engines, which had
    verified their part, apply nothing and keep their weights; one SyncError names the refusal and the other part.
    Under ``exclude`` the remote engine is left out and the sync runs again through shared memory alone."""
    aliases = synthetic.aliases("tiny")
    v1 = synthetic.build("tiny", seed=7)
    with three(remote="other") as (engines, client):
        (a, ea, sa), (b, _eb, sb), (c, _ec, _sc) = engines
        old = {n: t.clone() for n, t in ea.tensors.items()}
        before = served(client)
        with pytest.raises(SyncError) as e:
            client.sync(v1.items(), "v1", transport=local_of(engines))
        err = e.value
        assert err.stage == "prepare" and set(err.failures) == {c.address} and not err.results, err
        assert f"shared-memory part ({a.address}, {b.address}) had verified and was abandoned" in str(err)
        for stub in (sa, sb):
            st = status(stub)
            assert (st.weight_version, st.HasField("update"), st.dirty) == ("", False, False), st
        for n, t in ea.tensors.items():
            assert torch.equal(t, old[n]), n
        assert served(client) == before
        assert "r--s" not in mappings() and not listening_sockets()

        r = client.sync(v1.items(), "v1", transport=local_of(engines), policy=FleetPolicy.exclude())
        assert list(r.engines) == [a.address, b.address] and list(r.excluded) == [c.address] and r.attempts == 2
        got = served(client)
        assert all(got[t] == sums(v1, got[t], aliases) for t in (a.address, b.address))
        assert client.group is None  # the second attempt ran through shared memory alone


def test_a_bad_mapping_or_a_streaming_mixed_sync_is_refused_before_any_call() -> None:
    """A mapping naming no engine of the client, or an unknown transport; a streaming or individual mixed sync:
    ``ValueError`` before any call (no engine has an owner or an update). A mapping that sends everyone one way is
    a plain sync by it (streaming allowed)."""
    v1 = synthetic.build("tiny", seed=7)
    with three() as (engines, client):
        a, b, c = (srv.address for srv, _e, _s in engines)
        with pytest.raises(ValueError, match=r"'127\.0\.0\.1:1', which is no engine of this client"):
            client.sync(v1.items(), "v1", transport={"127.0.0.1:1": "shared_memory"})
        with pytest.raises(ValueError, match="unknown transport 'bogus'"):
            client.sync(v1.items(), "v1", transport={a: "bogus"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="must be staged: a streaming one would apply"):
            client.sync(v1.items(), "v1", transport={a: "shared_memory"}, apply_mode="streaming")
        with pytest.raises(ValueError, match="is flattened"):
            client.sync(v1.items(), "v1", transport={a: "shared_memory"}, layout="individual")
        for _srv, _e, stub in engines:
            st = status(stub)
            assert (st.weight_version, st.HasField("owner"), st.HasField("update")) == ("", False, False)
        everyone: dict[str, TransportName] = {a: "shared_memory", b: "shared_memory", c: "shared_memory"}
        r = client.sync(v1.items(), "v1", transport=everyone, apply_mode="streaming")
        assert list(r.engines) == [a, b, c] and client.group is None


def test_a_shared_memory_engine_lost_during_the_broadcast_part_applies_nothing_anywhere() -> None:
    """A shared-memory engine's server stops once the broadcast part is prepared (its part verified): the sync fails
    before any commit, naming it; the other two engines keep their weights."""
    v1 = synthetic.build("tiny", seed=7)
    with three() as (engines, client):
        (a, _ea, _sa), (_b, eb, sb), (_c, _ec, sc) = engines
        old = {n: t.clone() for n, t in eb.tensors.items()}
        phases: list[str] = []

        def stop_a(phase: str) -> None:
            phases.append(phase)
            if phases.count("prepared") == 2:  # the broadcast part's
                a.stop(0)

        with pytest.raises(SyncError) as e:
            client.sync(v1.items(), "v1", transport=local_of(engines), on_phase=stop_a)
        assert a.address in e.value.failures and not e.value.results, e.value
        for stub in (sb, sc):
            st = status(stub)
            assert (st.weight_version, st.HasField("update")) == ("", False), st
        for n, t in eb.tensors.items():
            assert torch.equal(t, old[n]), n
