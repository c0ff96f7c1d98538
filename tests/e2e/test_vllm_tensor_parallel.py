"""wsync inside a vLLM engine with tensor parallel size 3 (SmolLM2-135M: 9 query heads, 3 key/value heads),
started plainly and with ``--enable-lora`` (vLLM then wraps every linear layer for LoRA).

Every worker joins the group (ranks 1..3 of 4) and is armed before Prepare replies; each receives
the full checkpoint tensors and loads its own slices; GetWeightChecksums gathers the slices of
every worker back into checkpoint coordinates and matches the trainer's tensors bit for bit.
A LoRA adapter broadcast reaches every worker; the front loads global rank 0's copy. Through shared memory
(no group) every worker maps the trainer's segment and copies each bucket out whole, its loaders taking its slices.
On a 2-core host the workers run unpinned with one thread each (``VLLM_CPU_TP_ENV``).
The engines are the shared ``tp3`` and ``tp3-lora`` of ``shared_engines``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fsdp_ranks import start_ranks
from shared_engines import CHECKPOINT_VERSION, Vllm
from support import smollm2_lora
from test_vllm_engine import SERVED, assert_serves, perturbed, segment_holders, vllm_workers
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer import TrainerClient

pytest.importorskip("vllm", reason="the vllm extra is not installed")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.vllm_engines("tp3", "tp3-lora")]


@pytest.fixture(scope="module")
def engine_tp3(engine: Vllm) -> Vllm:
    """The module's tensor-parallel-3 engine (plain, or with ``--enable-lora``: its layers wrapped)."""
    return engine


@pytest.mark.vllm_engines("tp3")
def test_every_rank_receives_and_serves_its_slices(engine_tp3: Vllm, smollm2_dir: Path) -> None:
    """Staged new weights, then the originals streaming, into 3 workers. On the plain engine only: the LoRA-wrapped
    layers' base sync is the single worker's (``test_vllm_lora``), their slices are these."""
    originals: dict[str, torch.Tensor] = dict(safetensors_torch.load_file(str(smollm2_dir / "model.safetensors")))
    before = engine_tp3.complete()
    new = perturbed(originals, seed=5)
    with TrainerClient([engine_tp3.target], group_timeout_s=120) as c:
        (init,) = c.init().values()
        assert list(init.group.ranks) == [1, 2, 3] and init.group.world_size == 4
        # New weights staged, then the originals back streaming: each apply mode once (a sync of TP3 on a 2-core
        # host costs seconds), the answers changing and coming back.
        result = c.sync(new.items(), "tp3-staged", apply_mode="staged", flush_cache=True)
        assert result.engines[engine_tp3.target].tensor_count == len(new)
        assert_serves(c, engine_tp3.target, new, "tp3-staged", whole=True)
        assert engine_tp3.complete()[1] != before[1]
        c.sync(originals.items(), CHECKPOINT_VERSION, apply_mode="streaming", flush_cache=True)
        assert_serves(c, engine_tp3.target, originals, CHECKPOINT_VERSION)
        assert engine_tp3.complete() == before
        st = engine_tp3.status()
        assert st.state == pb.LIFECYCLE_STATE_READY and st.engine.workers == 3


@pytest.mark.vllm_engines("tp3")
def test_every_rank_applies_a_delta_to_its_copy_and_loads_its_slices(engine_tp3: Vllm, smollm2_dir: Path) -> None:
    """Deltas into 3 tensor-parallel workers: each keeps a copy of the whole checkpoint tensors of the last update
    (``PrepareHeader.delta_base``), rebuilds every changed tensor from it and loads its own slices through vLLM's
    loaders; staged and streaming, bit-exact by the gathered checksums, a few percent of the bytes."""
    originals: dict[str, torch.Tensor] = dict(safetensors_torch.load_file(str(smollm2_dir / "model.safetensors")))
    new = perturbed(originals, seed=7)
    with TrainerClient([engine_tp3.target], group_timeout_s=120, delta=True, delta_fallback=False) as c:
        first = c.sync(new.items(), "tp3-delta-0", dtype=SERVED)
        for i, apply_mode in enumerate(("staged", "streaming"), start=1):
            g = torch.Generator().manual_seed(i)
            for t in new.values():
                if t.dim() == 2:
                    t[torch.rand(t.shape, generator=g) < 0.01] += 0.05 * t.std()
            r = c.sync(new.items(), f"tp3-delta-{i}", dtype=SERVED, apply_mode=apply_mode)  # type: ignore[arg-type]
            assert r.delta is not None and r.delta.base_version == f"tp3-delta-{i - 1}", r.delta
            assert r.wire_bytes < 0.1 * first.wire_bytes
            assert_serves(c, engine_tp3.target, new, f"tp3-delta-{i}", whole=i == 2)
        c.sync(originals.items(), CHECKPOINT_VERSION, delta=False)
        assert_serves(c, engine_tp3.target, originals, CHECKPOINT_VERSION)


@pytest.mark.vllm_engines("tp3")
def test_every_rank_maps_the_shared_memory_segment_and_loads_its_slices(engine_tp3: Vllm, smollm2_dir: Path) -> None:
    """``transport="shared_memory"``: no group; each of the 3 workers maps the trainer's segment while the update
    runs, copies every bucket out whole, and vLLM's weight loaders take its slices (nothing travels between the
    workers); staged new weights, then the originals back streaming, bit-exact, nothing of the segment held after."""
    originals: dict[str, torch.Tensor] = dict(safetensors_torch.load_file(str(smollm2_dir / "model.safetensors")))
    before = engine_tp3.complete()
    new = perturbed(originals, seed=9)
    workers = set(vllm_workers(engine_tp3))
    assert len(workers) == 3
    armed: list[set[int]] = []  # at each "prepared": the processes holding the segment

    def on_phase(phase: str) -> None:
        if phase == "prepared":  # every worker armed; the trainer has not begun to send
            armed.append(set(segment_holders(engine_tp3.proc.pid)))

    with TrainerClient([engine_tp3.target], group_timeout_s=120) as c:
        for state, version, apply_mode in [(new, "tp3-shm", "staged"), (originals, CHECKPOINT_VERSION, "streaming")]:
            armed.clear()
            result = c.sync(
                state.items(),
                version,
                apply_mode=apply_mode,  # type: ignore[arg-type]
                transport="shared_memory",
                flush_cache=True,
                on_phase=on_phase,
            )
            assert result.engines[engine_tp3.target].tensor_count == len(state)
            assert result.engines[engine_tp3.target].buckets_verified == result.bucket_count  # on every worker
            assert armed == [workers], armed  # every worker maps the segment, nothing else of the engine does
            assert segment_holders(engine_tp3.proc.pid) == {}  # no mapping outlives the update
            assert_serves(c, engine_tp3.target, state, version, whole=state is new)
            assert (engine_tp3.complete() == before) == (state is originals)
        st = engine_tp3.status()
        assert st.state == pb.LIFECYCLE_STATE_UNINITIALIZED and st.engine.workers == 3  # no group was formed


@pytest.mark.vllm_engines("tp3")
def test_no_communicator_segment_of_the_workers_keeps_a_name_in_dev_shm(engine_tp3: Vllm) -> None:
    """vLLM's CPU workers exchange activations through a shared-memory segment per rank, whose ``/dev/shm`` names
    vLLM unlinks only in a destructor an ended worker never runs (every TP3 engine stopped left three behind). The
    wsync worker unlinks them once every rank has them open: each worker still maps all three (``(deleted)`` in its
    maps), none has a name left, so no end of the engine, SIGKILL included, leaves one; and the workers still
    compute together (a completion reads the same as before the check)."""
    before = engine_tp3.complete()
    workers = vllm_workers(engine_tp3)
    assert len(workers) == 3
    for pid in workers:
        mapped = {
            line.split(None, 5)[5]
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "-cpushm_" in line and "/dev/shm/" in line
        }
        assert len(mapped) == 3 and all(m.endswith(" (deleted)") for m in mapped), (pid, mapped)
        names = {Path(m.removesuffix(" (deleted)")).name for m in mapped}
        assert not names & set(os.listdir("/dev/shm")), names
    assert engine_tp3.complete() == before


def _peak_rss(pid: int) -> int:
    """``VmHWM`` of process ``pid``: its peak resident set size, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.mark.vllm_engines("tp3")
def test_checksums_are_hashed_where_the_slices_live(engine_tp3: Vllm, smollm2_dir: Path) -> None:
    """GetWeightChecksums of every tensor after a sync: the slices of each sharded tensor are joined and hashed
    in the workers (on the tensor-parallel group's first rank), so the front's peak resident memory grows by
    far less than the model's bytes, and every digest still equals the trainer's tensor."""
    originals: dict[str, torch.Tensor] = dict(safetensors_torch.load_file(str(smollm2_dir / "model.safetensors")))
    new = perturbed(originals, seed=11)
    model_bytes = sum(t.numel() * SERVED.itemsize for t in new.values())
    front = engine_tp3.proc.pid
    with TrainerClient([engine_tp3.target], group_timeout_s=120) as c:
        c.sync(new.items(), "tp3-digests")  # a new version: nothing cached
        Path(f"/proc/{front}/clear_refs").write_text("5")  # the peak starts again from the current size
        start = _peak_rss(front)
        assert_serves(c, engine_tp3.target, new, "tp3-digests", whole=True)
        grown = _peak_rss(front) - start
    assert grown < model_bytes / 8, (
        f"the front's peak grew by {grown / 2**20:.0f} MiB ({model_bytes / 2**20:.0f} MiB model)"
    )


@pytest.mark.vllm_engines("tp3-lora")
def test_an_adapter_broadcast_to_every_rank_answers_as_the_same_adapter_read_from_disk(
    engine_tp3: Vllm, smollm2_dir: Path
) -> None:
    """Each of the 3 workers receives the adapter's buckets; the front loads global rank 0's copy."""
    pytest.importorskip("peft")
    adapter = smollm2_lora(smollm2_dir, ["q_proj", "v_proj"], random_b=True)
    adapter.save_pretrained(engine_tp3.checkpoints / "a1")
    with TrainerClient([engine_tp3.target], group_timeout_s=120, rpc_timeout_s=120) as c:
        live = c.sync_adapter(adapter, "live", "a1")
        assert live.engines[engine_tp3.target].tensor_count == 2 * 2 * 30
        c.sync_adapter(engine_tp3.checkpoints / "a1", "disk", "a1")
        base = engine_tp3.complete()
        engine_tp3.model, name = "live", engine_tp3.model
        try:
            from_broadcast = engine_tp3.complete()
            engine_tp3.model = "disk"
            assert engine_tp3.complete() == from_broadcast != base
        finally:
            engine_tp3.model = name
        st = engine_tp3.status()
        assert st.state == pb.LIFECYCLE_STATE_READY and st.engine.workers == 3


@pytest.mark.vllm_engines("tp3")
def test_fsdp2_ranks_sync_into_every_tensor_parallel_worker(engine_tp3: Vllm) -> None:
    """Two real FSDP2 trainer ranks sync in both modes; every worker's slices match the gathered weights
    (in the direct mode each of the 3 workers receives both ranks' pieces and assembles the tensors).
    First, a direct sync through shared memory: each rank packs its own pieces into a ring of its own, and every
    worker opens both rings and reads each bucket from its rank's (no group: the gather sync after it forms the
    first); nothing of either ring is held once the ranks are done.
    The engine is left on the ranks' last step (the next module's hand-over restores the checkpoint)."""
    before = engine_tp3.complete()
    ranks = start_ranks(
        [engine_tp3.target],
        *("--steps=1", "--modes=direct:shared_memory,gather,direct", "--dtype=bfloat16", "--check=checksums"),
    )
    assert [r.wait() for r in ranks] == [0, 0], [r.stderr for r in ranks]
    assert [c["failures"] for c in ranks[0].events if c["event"] == "checked"] == [[], [], []]
    synced = {e["version"]: e for e in ranks[0].events if e["event"] == "synced"}
    assert list(synced) == ["step-1-direct-shared_memory", "step-1-gather", "step-1-direct"], synced
    shm = synced["step-1-direct-shared_memory"]
    assert shm["init_seconds"] == 0 and shm["verified"] == shm["buckets"] > 1, shm  # no group; every digest checked
    assert synced["step-1-gather"]["init_seconds"] > 0  # the first group formed after it
    assert segment_holders(engine_tp3.proc.pid) == {}
    assert engine_tp3.complete()[1] != before[1]
    st = engine_tp3.status()
    assert st.weight_version == "step-1-direct" and st.state == pb.LIFECYCLE_STATE_UNINITIALIZED and not st.dirty
