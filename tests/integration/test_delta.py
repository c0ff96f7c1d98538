"""Delta updates (``sync(delta=True)``): only the bfloat16 elements that changed travel, and every guarantee of a
whole update holds.

Real gRPC servers on loopback ports, real gloo groups, real shared-memory segments; a real SmolLM2-135M trained
with AdamW on a few KB of real text (``tests/data/train_text.txt``); synthetic tensor engines where the model does
not matter. Every check of what an engine serves is its own ``GetWeightChecksums`` (or its tensors) against the
trainer's tensors in the wire dtype; every byte count is what the engine says it received.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support import ENV, ROOT, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.checksums import tensor_sha256s
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.reference import ReferenceEngine
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.watch import REATTACH_S
from wsync_grpc.testing import in_process_server
from wsync_grpc.trainer import SyncError, TrainerClient
from wsync_grpc.trainer.delta import DeltaCosts, SyncPlan
from wsync_grpc.trainer.sender import BroadcastSender
from wsync_grpc.transports.broadcast.sender import Corruption, PackBuffers

pytestmark = pytest.mark.timeout(300)

SMALL = {"bucket_bytes": 32 << 10, "ramp_bytes": 0, "solo_bytes": 64 << 10, "delta_fallback": False}
"""Client settings that cut the tiny synthetic model in several buckets, and send a delta at every sync whatever
the syncs' times (no fallback to whole syncs)."""

TEXT = (ROOT / "tests" / "data" / "train_text.txt").read_text()
"""A few KB of real English text to train on."""


def perturb(tensors: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Change about ``density`` of every tensor's elements in place (seeded): a training step's footprint."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors.values():
            mask = torch.rand(t.shape, generator=g) < density
            t[mask] += 0.25


def expected(tensors: dict[str, torch.Tensor], served: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """The SHA-256 an engine serving ``served`` reports for each tensor the trainer sent in bfloat16."""
    return dict(zip(tensors, tensor_sha256s(t.to(torch.bfloat16).to(served) for t in tensors.values()), strict=True))


def served(client: TrainerClient) -> dict[str, dict[str, str]]:
    """Every engine's ``GetWeightChecksums``: target -> name -> SHA-256."""
    return {t: c.by_name for t, c in client.checksums().items()}


@pytest.mark.slow
def test_real_training_synced_as_deltas_is_served_bit_exact(smollm2_dir: Path, smollm2_tokenizer: Any) -> None:
    """SmolLM2 trained with AdamW (lr 1e-5) on real text, three steps, each synced as a delta in bfloat16 to a
    reference engine serving float32: the first sync is whole, every later one a delta against the one before,
    a few percent of the whole bytes on the wire, verified bucket by bucket, and the engine serves the trainer's
    weights bit for bit after each step."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32)
    ids = smollm2_tokenizer(TEXT, return_tensors="pt")["input_ids"][0]
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    with (
        ReferenceEngine.from_pretrained(None) as engine,
        in_process_server(engine) as (srv, stub),
        TrainerClient([srv.address], rpc_timeout_s=60, delta=True, delta_fallback=False) as client,
    ):
        names = list(engine.parameter_specs())
        r = client.sync(trainer.named_parameters(), "step-0", dtype=torch.bfloat16)
        assert r.delta is not None and r.delta.base_version == "" and r.delta.delta_tensors == 0
        whole = r.wire_bytes
        assert whole >= r.delta.whole_bytes == r.payload_bytes
        for step in range(1, 4):
            chunk = ids[128 * step :][:256].unsqueeze(0)
            trainer(input_ids=chunk, labels=chunk).loss.backward()
            opt.step()
            opt.zero_grad()
            r = client.sync(trainer.named_parameters(), f"step-{step}", dtype=torch.bfloat16, flush_cache=True)
            d = r.delta
            assert d is not None and d.base_version == f"step-{step - 1}", d
            assert d.delta_tensors > 200 and 0.001 < d.changed_share < 0.15, d
            assert r.wire_bytes < 0.2 * whole, (r.wire_bytes, whole)
            e = r.engines[srv.address]
            assert e.bytes_received == r.wire_bytes and e.buckets_verified == e.bucket_count == r.bucket_count
            params = dict(trainer.named_parameters())
            sent = (params[n].detach().to(torch.bfloat16).float() for n in names)
            want = dict(zip(names, tensor_sha256s(sent), strict=True))
            assert served(client)[srv.address] == want
            st = status(stub)
            assert (st.weight_version, st.weight_identity) == (f"step-{step}", e.weight_identity)
        assert engine.generate("The capital of France is", 4).weight_versions == ("step-3",)


@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_deltas_reach_every_engine_bit_exact_over_each_transport(transport: str, apply_mode: str) -> None:
    """Two engines, three steps of 1% changes: each delta carries a few percent of the whole bytes, each engine
    received exactly what the trainer sent, every bucket verified, and both serve the trainer's tensors."""
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (a, ea, _sa),
        tensor_server("tiny", seed=1) as (b, eb, _sb),
        TrainerClient([a.address, b.address], delta=True, **SMALL) as client,  # type: ignore[arg-type]
    ):
        first = client.sync(new.items(), "v0", apply_mode=apply_mode, transport=transport)  # type: ignore[arg-type]
        assert first.delta is not None and first.delta.base_version == ""
        for step in range(1, 4):
            perturb(new, 0.01, step)
            r = client.sync(new.items(), f"v{step}", apply_mode=apply_mode, transport=transport)  # type: ignore[arg-type]
            assert r.delta is not None and r.delta.base_version == f"v{step - 1}"
            assert r.wire_bytes < 0.06 * first.wire_bytes, (r.wire_bytes, first.wire_bytes)
            for e in r.engines.values():
                assert e.bytes_received == r.wire_bytes and e.buckets_verified == r.bucket_count
            for engine in (ea, eb):
                for n, t in new.items():
                    assert torch.equal(engine.tensors[n], t), n
        assert len({e.weight_identity for e in r.engines.values()}) == 2  # each engine issues its own
        # The base, and the copy before it that the next sync converts into.
        assert client.deltas.kept_bytes == 2 * client.deltas.base_bytes == 2 * first.delta.whole_bytes


def test_a_client_falls_back_to_whole_syncs_while_deltas_cost_more_and_tries_a_delta_again() -> None:
    """``delta_fallback`` (the default): once deltas were timed slower than whole syncs (here: three more deltas
    counted as taking 1000 s), syncs go whole as with deltas off (the whole bytes, nothing kept), the sync before a
    retry keeps its tensors, and the retry is a delta against it; the engine serves the trainer's tensors after
    each."""
    new = synthetic.build("tiny", seed=7)
    small = {k: v for k, v in SMALL.items() if k != "delta_fallback"}
    with (
        tensor_server("tiny", seed=0) as (a, ea, _sa),
        TrainerClient([a.address], delta=True, **small) as client,  # type: ignore[arg-type]
    ):
        client.deltas.costs = DeltaCosts(probe_every=3)
        first = client.sync(new.items(), "v0")
        perturb(new, 0.01, 1)
        r = client.sync(new.items(), "v1")
        assert r.delta is not None and r.delta.base_version == "v0" and not r.delta.fell_back
        for _ in range(3):
            client.deltas.costs.record(SyncPlan.DELTA, r.delta, 1000.0)
        ways = []
        for step in range(2, 6):
            perturb(new, 0.01, step)
            r = client.sync(new.items(), f"v{step}")
            assert r.delta is not None
            ways.append((r.delta.base_version, r.delta.fell_back, r.wire_bytes == first.wire_bytes))
            assert r.engines[a.address].bytes_received == r.wire_bytes
            assert all(torch.equal(ea.tensors[n], t) for n, t in new.items())
            if r.delta.fell_back and r.delta.diff_seconds == 0:
                assert client.deltas.base_bytes == 0  # a plain whole sync keeps nothing
        assert ways == [("", True, True), ("", True, True), ("v3", False, False), ("", True, True)]


def test_an_unchanged_model_is_a_delta_of_no_bytes() -> None:
    """Syncing the same weights again sends a delta of zero bytes that still publishes the new version."""
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (a, _engine, stub),
        TrainerClient([a.address], delta=True, **SMALL) as client,  # type: ignore[arg-type]
    ):
        client.sync(new.items(), "v0")
        r = client.sync(new.items(), "v1")
        assert r.delta is not None and r.delta.changed_elements == 0 and r.wire_bytes == 0
        assert status(stub).weight_version == "v1" and served(client)[a.address] == expected(new)


def test_another_trainer_writing_the_same_label_is_not_taken_for_the_base() -> None:
    """Trainer A syncs "v1" and goes; trainer B writes "v1" with other weights. A delta naming A's "v1" (its
    version and the identity the engine gave A) is refused before any byte moves: FAILED_PRECONDITION
    BASE_VERSION_MISMATCH, and the engine keeps serving B's weights."""
    mine = synthetic.build("tiny", seed=7)
    theirs = synthetic.build("tiny", seed=8)
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        with TrainerClient([srv.address], delta=True, **SMALL) as a:  # type: ignore[arg-type]
            ours = a.sync(mine.items(), "v1").engines[srv.address].weight_identity
        with TrainerClient([srv.address], delta=True, **SMALL) as b:  # type: ignore[arg-type]
            b.sync(theirs.items(), "v1")
        st = status(stub)
        assert st.weight_version == "v1" and st.weight_identity not in ("", ours)
        header = pb.PrepareHeader(
            weight_version="v2", bucket_count=1, base_weight_version="v1", base_weight_identity=ours
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "BASE_VERSION_MISMATCH" in str(e.value.trailing_metadata())  # type: ignore[attr-defined]
        assert status(stub).weight_identity == st.weight_identity
        for n, t in theirs.items():
            assert torch.equal(engine.tensors[n], t), n


def test_a_restarted_engine_refuses_the_delta_and_the_client_syncs_it_whole() -> None:
    """The engine behind a target restarts (a new process at the same address, other weights, no identity): the
    client's next delta is refused there (BASE_VERSION_MISMATCH) and the client syncs whole at once; the engine
    serves the trainer's tensors exactly, and the sync after that is a delta again."""
    new = synthetic.build("tiny", seed=7)
    first = TensorEngine(synthetic.build("tiny", seed=0), aliases=synthetic.aliases("tiny"))
    with in_process_server(first) as (srv, _stub):
        address, port = srv.address, srv.port
        client = TrainerClient([address], delta=True, **SMALL)  # type: ignore[arg-type]
        client.sync(new.items(), "v0")
    try:
        again = TensorEngine(synthetic.build("tiny", seed=3), aliases=synthetic.aliases("tiny"))
        with in_process_server(again, port=port) as (_srv, stub):
            perturb(new, 0.01, 1)
            r = client.sync(new.items(), "v1")
            assert r.delta is not None and r.delta.base_version == "", r.delta  # refused, then sent whole
            assert served(client)[address] == expected(new)
            perturb(new, 0.01, 2)
            r = client.sync(new.items(), "v2")
            assert r.delta is not None and r.delta.base_version == "v1"
            assert served(client)[address] == expected(new) and status(stub).weight_version == "v2"
    finally:
        client.close()


def test_a_delta_is_refused_for_a_bad_base_or_header_and_nothing_changes() -> None:
    """Raw Prepare headers: a delta to an engine that never applied an update, with no identity, or by disk;
    each refused with its code and reason; the engine keeps serving what it served."""
    with tensor_server("tiny", seed=0) as (_srv, _engine, stub):
        cases = [
            (dict(base_weight_version="v0", base_weight_identity="x"), "FAILED_PRECONDITION", "BASE_VERSION_MISMATCH"),
            (dict(base_weight_version="v0"), "INVALID_ARGUMENT", "MISSING_BASE_IDENTITY"),
            (dict(base_weight_identity="x"), "INVALID_ARGUMENT", "UNEXPECTED_BASE_IDENTITY"),
            (
                dict(base_weight_version="v0", base_weight_identity="x", transport=pb.TRANSPORT_DISK),
                "INVALID_ARGUMENT",
                "DELTA_UNSUPPORTED",
            ),
            (
                dict(base_weight_version="v0", base_weight_identity="x", layout=pb.BUCKET_LAYOUT_INDIVIDUAL),
                "INVALID_ARGUMENT",
                "DELTA_UNSUPPORTED",
            ),
        ]
        for fields, code, reason in cases:
            header = pb.PrepareHeader(weight_version="v1", bucket_count=1, **fields)  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as e:
                stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
            assert e.value.code().name == code, (fields, e.value)
            assert reason in str(e.value.trailing_metadata()), (fields, e.value)  # type: ignore[attr-defined]
            st = status(stub)
            assert (st.weight_version, st.weight_identity, st.dirty) == ("", "", False)


def test_a_corrupted_streaming_delta_leaves_the_engine_dirty_and_only_a_whole_update_repairs_it() -> None:
    """A streaming delta whose bucket 1 is corrupted on the wire (after the trainer hashed the tensors it results
    in): the engine refuses that bucket (BUCKET_DIGEST_MISMATCH), is dirty, paused and has no identity; the next
    delta is refused (ENGINE_DIRTY) and the client syncs whole at once, which repairs it bit for bit."""
    new = synthetic.build("tiny", seed=7)
    senders: list[BroadcastSender] = []

    def sender(buffers: PackBuffers) -> BroadcastSender:
        senders.append(BroadcastSender(buffers))
        return senders[-1]

    with (
        tensor_server("tiny", seed=0) as (srv, _engine, stub),
        TrainerClient([srv.address], delta=True, sender=sender, **SMALL) as client,  # type: ignore[arg-type]
    ):
        client.sync(new.items(), "v0", apply_mode="streaming")
        perturb(new, 0.3, 1)  # dense enough for several buckets
        senders[-1].corrupt = Corruption(1)
        with pytest.raises(SyncError) as e:
            client.sync(new.items(), "v1", apply_mode="streaming")
        assert e.value.failures[srv.address].reason == "BUCKET_DIGEST_MISMATCH", e.value
        deadline = time.monotonic() + 30
        while not status(stub).dirty and time.monotonic() < deadline:  # the engine ends the update on its own
            time.sleep(0.02)
        st = status(stub)
        assert st.dirty and st.paused and st.weight_identity == "" and st.weight_version == "v0", st
        senders[-1].corrupt = None
        r = client.sync(new.items(), "v1", apply_mode="streaming")
        assert r.delta is not None and r.delta.base_version == "", r.delta  # refused for the dirt: sent whole
        assert served(client)[srv.address] == expected(new)
        st = status(stub)
        assert not st.dirty and not st.paused and st.weight_version == "v1"
        perturb(new, 0.01, 3)
        r = client.sync(new.items(), "v2")
        assert r.delta is not None and r.delta.base_version == "v1"
        assert served(client)[srv.address] == expected(new)


TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from wsync_grpc.engines import synthetic
    from wsync_grpc.trainer import TrainerClient
    target, apply_mode = sys.argv[1], sys.argv[2]
    new = synthetic.build("tiny", seed=7)
    small = {"bucket_bytes": 32 << 10, "ramp_bytes": 0, "solo_bytes": 64 << 10}
    # No digests: a streaming engine then writes each bucket as it arrives. With digests it holds a delta bucket
    # until its digest (declared as the bucket is sent) comes, and whether the first one was written before the kill
    # would be a race.
    with TrainerClient([target], delta=True, delta_fallback=False, digests=False, **small) as c:
        r = c.sync(new.items(), "v0", apply_mode=apply_mode)
        print(json.dumps({"identity": r.engines[target].weight_identity}), flush=True)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for t in new.values():
                t[torch.rand(t.shape, generator=g) < 0.3] += 0.25
        def die(p):
            if p.buckets_sent == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        c.sync(new.items(), "v1", apply_mode=apply_mode, progress=die)
    """
)


@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_a_trainer_killed_mid_delta_leaves_staged_engines_at_their_base_and_streaming_ones_dirty(
    apply_mode: str,
) -> None:
    """A real trainer process SIGKILLs itself once the first bucket of a delta is on the wire. Staged: the engine
    abandons the update and keeps serving the base, identity and all (a delta to it is still good). Streaming:
    dirty, paused, no identity. Either way a new trainer process's first sync is whole and serves exactly."""
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        proc = subprocess.run(
            [sys.executable, "-c", TRAINER, srv.address, apply_mode],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        identity = json.loads(proc.stdout.splitlines()[0])["identity"]
        t_end = time.monotonic() + 60
        while status(stub).HasField("update") and time.monotonic() < t_end:  # the engine notices the death
            time.sleep(0.05)
        st = status(stub)
        assert not st.HasField("update"), st
        assert st.weight_version == "v0"
        if apply_mode == "staged":
            assert (st.dirty, st.weight_identity) == (False, identity)
            for n, t in new.items():
                assert torch.equal(engine.tensors[n], t.to(torch.bfloat16)), n
        else:
            assert st.dirty and st.weight_identity == ""
        perturb(new, 0.02, 9)
        with TrainerClient([srv.address], delta=True, **SMALL) as client:  # type: ignore[arg-type]
            r = client.sync(new.items(), "v2")
            assert r.delta is not None and r.delta.base_version == ""  # a new trainer process starts whole
            assert served(client)[srv.address] == expected(new)
            assert not status(stub).dirty


class Fleet:
    """Three tensor engines behind real servers, one of which (``c``) can be restarted at its address."""

    def __init__(self) -> None:
        self.servers: dict[str, Any] = {}
        self.engines: dict[str, TensorEngine] = {}
        self._stack = contextlib.ExitStack()

    def start(self, name: str, seed: int, port: int = 0) -> str:
        engine = TensorEngine(synthetic.build("tiny", seed=seed), aliases=synthetic.aliases("tiny"))
        srv, _stub = self._stack.enter_context(
            in_process_server(engine, port=port) if port else in_process_server(engine)
        )
        self.servers[name], self.engines[name] = srv, engine
        return str(srv.address)

    def close(self) -> None:
        self._stack.close()


def test_a_fleet_with_an_engine_behind_takes_one_mixed_commit() -> None:
    """Three engines at the client's base; one restarts (other weights, no identity). The next staged sync refuses
    nothing twice: that engine takes the whole weights over a group of its own while the other two take the delta
    over theirs, in one commit; each engine received what it was sent (counted by the engine), all three serve the
    trainer's tensors exactly, and the sync after that is a delta to all three. The delta part is slowed past the
    engines' reattach period: the engine behind, verified meanwhile, stays held and applies with the others."""
    new = synthetic.build("tiny", seed=7)
    fleet = Fleet()
    try:
        targets = [fleet.start("a", 0), fleet.start("b", 1)]
        restarted = TensorEngine(synthetic.build("tiny", seed=2), aliases=synthetic.aliases("tiny"))
        with in_process_server(restarted) as (old_c, _stub):
            port = old_c.port
            targets.append(old_c.address)
            with TrainerClient(targets, delta=True, **SMALL) as client:  # type: ignore[arg-type]
                first = client.sync(new.items(), "v0")
                whole = first.wire_bytes
                # c restarts at its address with other weights: it serves no identity the client knows
                old_c.stop(0)
                c = fleet.start("c", 3, port=port)
                perturb(new, 0.01, 1)
                phases: list[str] = []

                def slow_delta_part(phase: str) -> None:  # the engine behind waits, verified, longer than a reattach
                    phases.append(phase)
                    if phase == "prepared" and phases.count("prepared") == 2:
                        time.sleep(2 * REATTACH_S + 0.2)

                r = client.sync(new.items(), "v1", on_phase=slow_delta_part)
                assert r.delta is not None and r.delta.base_version == "v0" and r.delta.whole_targets == (c,), r.delta
                received = {t: e.bytes_received for t, e in r.engines.items()}
                assert received[c] == whole, received
                assert all(received[t] < 0.06 * whole for t in targets[:2]), received
                assert list(r.engines) == targets and r.wire_bytes == sum(received[t] for t in (targets[0], c))
                assert phases.count("verified") == 2 and phases[-1] == "applied"
                got = served(client)
                assert got == {t: expected(new) for t in targets}
                assert len({e.weight_identity for e in r.engines.values()}) == 3
                perturb(new, 0.01, 2)
                r = client.sync(new.items(), "v2")
                assert r.delta is not None and r.delta.base_version == "v1" and r.delta.whole_targets == ()
                assert all(e.bytes_received < 0.06 * whole for e in r.engines.values())
                assert served(client) == {t: expected(new) for t in targets}
    finally:
        fleet.close()


def test_a_mixed_commit_applies_nothing_when_the_delta_part_fails() -> None:
    """The engine behind (restarted) verified its whole update; then the engine at the base goes away before the
    delta's Prepare: the delta fails, the whole update is cancelled before it applied, and the engine behind serves
    what it served before (one commit: all or nothing)."""
    new = synthetic.build("tiny", seed=7)
    fleet = Fleet()
    try:
        a = fleet.start("a", 0)
        old_b = TensorEngine(synthetic.build("tiny", seed=1), aliases=synthetic.aliases("tiny"))
        with in_process_server(old_b) as (srv_b, _stub):
            b, port = srv_b.address, srv_b.port
            client = TrainerClient([a, b], delta=True, **SMALL)  # type: ignore[arg-type]
            client.sync(new.items(), "v0")
        with contextlib.closing(client):
            fleet.start("b", 5, port=port)  # restarted: behind
            before_b = {n: t.clone() for n, t in fleet.engines["b"].tensors.items()}
            perturb(new, 0.01, 1)

            def stop_a_once_b_verified(phase: str) -> None:
                if phase == "verified" and fleet.servers["a"] is not None:
                    fleet.servers["a"].stop(0)
                    fleet.servers["a"] = None

            with pytest.raises(SyncError) as e:
                client.sync(new.items(), "v1", on_phase=stop_a_once_b_verified)
            assert a in e.value.failures, e.value
            for n, t in fleet.engines["b"].tensors.items():
                assert torch.equal(t, before_b[n]), n  # b verified the whole update but never applied it
            assert fleet.engines["b"].weight_version == ""
    finally:
        fleet.close()


def test_an_anchor_every_two_deltas_sends_the_third_sync_after_a_whole_one_whole() -> None:
    """``delta_anchor_every=2``: whole, delta, delta, whole (the anchor), delta; every one served exactly."""
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (srv, _engine, _stub),
        TrainerClient([srv.address], delta=True, delta_anchor_every=2, **SMALL) as client,  # type: ignore[arg-type]
    ):
        kinds = []
        for step in range(5):
            perturb(new, 0.01, step)
            r = client.sync(new.items(), f"v{step}")
            assert r.delta is not None
            kinds.append("delta" if r.delta.base_version else "whole")
            assert served(client)[srv.address] == expected(new)
        assert kinds == ["whole", "delta", "delta", "whole", "delta"]
