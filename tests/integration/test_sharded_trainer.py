"""Sharded trainers: real FSDP2 ranks (2 processes over gloo, SmolLM2-135M) syncing into a real reference engine.

Every trainer rank is a ``python -m wsync_grpc.tools.fsdp_rank`` process; the engine is a ``wsync serve``
process shared by the module. Rank 0 checks checksums (bit-exact against the gathered weights) and
greedy answers itself (``--check``); the tests read every rank's JSON lines.
"""

from __future__ import annotations

import concurrent.futures
import functools
import random
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from fsdp_ranks import start_ranks
from test_shared_memory import dev_shm, segments_held
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.group.process_group import free_port, join_group
from wsync_grpc.testing import EngineProcess, owner_channel, spawn_engine

pytest.importorskip("transformers")

# Which error a surviving rank reports first (its peer gone, or gloo's broken broadcast) is a race a test running
# beside it can tip: `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    tmp = tmp_path_factory.mktemp("sharded")
    proc = spawn_engine(["--engine", "reference"], port_file=tmp / "port", log=tmp / "engine.log", name="ref")
    try:
        yield proc
    finally:
        proc.stop()


def _stub(target: str) -> weight_sync_pb2_grpc.WeightSyncServiceStub:
    """A stub of one caller: it keeps the lease credential its Init gets, and presents it."""
    return weight_sync_pb2_grpc.WeightSyncServiceStub(owner_channel(target))


def test_both_modes_are_bit_exact_and_answers_change_with_the_trainer(engine: EngineProcess) -> None:
    """One run of ranks syncs every step in the gather mode, then in the direct mode: both bit-exact, the same
    answers from the same step's weights, other answers after the next step."""
    modes = ("gather", "direct")
    ranks = start_ranks([engine.target], "--steps=2", f"--modes={','.join(modes)}", "--check=all")
    codes = [r.wait() for r in ranks]
    assert codes == [0, 0], [r.stderr for r in ranks]
    versions = [f"step-{step}-{mode}" for step in (1, 2) for mode in modes]
    for r in ranks:  # every rank returns rank 0's result
        synced = [e for e in r.events if e["event"] == "synced"]
        assert [e["version"] for e in synced] == versions
        # Every bucket's digest (hashed by the rank that sent it) matched on the engine.
        assert all(e["verified"] == e["buckets"] > 1 for e in synced), synced
    checks = [e for e in ranks[0].events if e["event"] == "checked"]
    assert [c["version"] for c in checks] == versions
    assert [c["failures"] for c in checks] == [[]] * 4  # every checksum bit-exact, the answers the trainer's
    answers = [c["answer"] for c in checks]
    assert answers[0] == answers[1] != answers[2] == answers[3], answers
    status = _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.weight_version == "step-2-direct"


def test_shards_that_do_not_tile_a_tensor_are_refused_before_anything_moves(engine: EngineProcess) -> None:
    """Two trainer ranks join (here, as threads); pieces with a gap or an overlap are refused at Prepare."""
    stub = _stub(engine.target)
    before = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=["model.norm.weight"]), timeout=30)
    port = free_port()
    req = pb.InitRequest(
        master_address="127.0.0.1", master_port=port, rank_offset=2, world_size=3, trainer_ranks=2, force=True
    )
    req.timeout.FromSeconds(60)
    init = stub.Init.future(req, timeout=70)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        joins = [
            ex.submit(join_group, master_address="127.0.0.1", master_port=port, rank=r, world_size=3,
                      timeout_s=60, trainer_ranks=2)
            for r in (0, 1)
        ]  # fmt: skip
        groups = [j.result(timeout=70) for j in joins]
    init.result()
    name, width = "model.norm.weight", 576

    def prepare(*pieces: tuple[int, int, int]) -> grpc.RpcError:
        buckets = [
            pb.BucketSpec(
                index=i, size_bytes=4 * rows, src_rank=src,
                tensors=[pb.TensorSpec(name=name, dtype="float32", shape=[rows],
                                       shard=pb.TensorShard(global_shape=[width], offsets=[start]))],
            )
            for i, (src, start, rows) in enumerate(pieces)
        ]  # fmt: skip
        header = pb.PrepareHeader(
            weight_version="untiled", bucket_count=len(buckets), total_bytes=sum(b.size_bytes for b in buckets)
        )
        msgs = [pb.PrepareRequest(header=header)] + [pb.PrepareRequest(bucket=b) for b in buckets]
        with pytest.raises(grpc.RpcError) as e:
            stub.Prepare(iter(msgs), timeout=30)
        return e.value

    try:
        gap = prepare((0, 0, 288), (1, 300, 276))
        assert gap.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "INCOMPLETE_TENSOR" in str(gap.trailing_metadata()) or "cover 564 of its 576" in (gap.details() or "")
        assert name in (gap.details() or "")
        overlap = prepare((0, 0, 300), (1, 288, 288))
        assert overlap.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlaps" in (overlap.details() or "")
        assert name in (overlap.details() or "")
        wrong_rank = prepare((0, 0, 288), (2, 288, 288))
        assert wrong_rank.code() == grpc.StatusCode.INVALID_ARGUMENT and "src_rank 2" in (wrong_rank.details() or "")
        # Nothing moved: the engine is ready, its weights and version as before.
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        assert status.state == pb.LIFECYCLE_STATE_READY and not status.HasField("update")
        after = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=[name]), timeout=30)
        assert after == before
    finally:
        stub.Leave(pb.LeaveRequest(), timeout=30)
        for g in groups:
            g.destroy()


def test_ranks_that_disagree_fail_on_every_rank_within_seconds(engine: EngineProcess) -> None:
    before = _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10).weight_version
    ranks = start_ranks([engine.target], "--steps=1", per_rank=((), ("--version-suffix=-other",)))
    codes = [r.wait() for r in ranks]
    assert codes == [1, 1]
    errors = [r.wait_for("error") for r in ranks]
    for e in errors:
        assert e["kind"] == "RanksDisagree"
        assert "rank 1 differs from rank 0 in: weight version" in e["message"]
        assert e["seconds"] < 10
    assert _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10).weight_version == before


@functools.cache
def expected_checksums(step: int) -> dict[str, str]:
    """The SHA-256 of every tensor the ranks send after ``step`` perturbations (computed here, unsharded; once per
    module run: the model loads in seconds)."""
    from wsync_grpc.core.checksums import tensor_sha256
    from wsync_grpc.engines.models import load_causal_lm
    from wsync_grpc.tools.fsdp_rank import perturb

    model = load_causal_lm(None)[0]
    for s in range(1, step + 1):
        perturb(model, seed=s)
    return {n: tensor_sha256(p.detach()) for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("mode", "victim", "transport", "again"),
    # The direct mode's follower killed mid-send runs through shared memory (every rank its own ring; the engine's
    # worker reads both): the same promises, and nothing left in /dev/shm or mapped in the engine. `again`: a new
    # trainer (a second start of ranks) then syncs; the gather mode's is checked after its leader's death only.
    [
        pytest.param("gather", 1, "broadcast", False, id="gather-1-broadcast"),
        pytest.param("gather", 0, "broadcast", True, id="gather-0-broadcast"),
        pytest.param("direct", 0, "broadcast", True, id="direct-0-broadcast"),
        pytest.param("direct", 1, "shared_memory", True, id="direct-1-shared_memory"),
    ],
)
def test_a_rank_killed_mid_transfer_fails_the_others_and_the_engine_keeps_its_weights(
    engine: EngineProcess, mode: str, victim: int, transport: str, again: bool
) -> None:
    stub = _stub(engine.target)
    shm_before = dev_shm()
    # Small buckets: a sync is ~130 buckets, and the kill lands after a random one of the first 40 of sync 2
    # (in the direct mode rank 0 sends every other bucket, and reports those).
    ranks = start_ranks(
        [engine.target],
        *("--steps=4", "--bucket-bytes=4000000", "--progress", f"--modes={mode}", f"--transport={transport}"),
    )
    ranks[0].wait_for("synced", version=f"step-1-{mode}")
    after = random.randint(1, 20) * 2 - 1 if mode == "direct" else random.randint(2, 40)
    ranks[0].wait_for("bucket", version=f"step-2-{mode}", sent=after)
    ranks[victim].proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = ranks[1 - victim]
    error = survivor.wait_for("error", timeout=30)
    assert survivor.wait() == 1
    ranks[victim].wait()
    assert error["at"] - killed_at < 5, error
    assert error["version"] == f"step-2-{mode}", error  # the sync in flight failed
    assert f"trainer rank {victim} is gone" in error["message"], error
    # The engine noticed within the bound and serves step 1's weights whole (staged apply).
    deadline = killed_at + 5
    while stub.GetStatus(pb.GetStatusRequest(), timeout=10).HasField("update") and time.monotonic() < deadline:
        time.sleep(0.05)
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert not status.HasField("update"), status
    assert status.weight_version == f"step-1-{mode}"
    served = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)
    assert served.weight_version == f"step-1-{mode}"
    got, want = {c.name: c.sha256 for c in served.checksums}, expected_checksums(step=1)
    assert {n: got.get(n) for n in want} == want
    if transport == "shared_memory":  # the engine's worker unmapped both rings; the dead rank's memfd went with it
        assert status.HasField("group") is False
        while segments_held(engine.process.pid) and time.monotonic() < killed_at + 5:  # within the liveness bound
            time.sleep(0.05)
        assert segments_held(engine.process.pid) == 0
        assert dev_shm() == shm_before
    if not again:
        return
    # The trainer re-forms (new processes) and the next sync succeeds.
    reformed = start_ranks(
        [engine.target], "--steps=1", "--version-suffix=-again", f"--modes={mode}", f"--transport={transport}"
    )
    assert [r.wait() for r in reformed] == [0, 0], [r.stderr for r in reformed]
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).weight_version == f"step-1-{mode}-again"


def test_a_bad_argument_fails_every_rank_not_one(engine: EngineProcess) -> None:
    ranks = start_ranks([engine.target], "--steps=1", "--modes=sideways")
    assert [r.wait() for r in ranks] == [1, 1]
    for r in ranks:
        e = r.wait_for("error")
        assert e["kind"] == "ValueError" and "unknown send mode 'sideways'" in e["message"], e
        assert e["seconds"] < 10


def test_status_and_checksums_are_read_through_the_ranks_trainer_client(engine: EngineProcess) -> None:
    """``client.status()`` and ``client.checksums()`` (the sharded-trainer page's table) answer what the engine
    serves, on a real one-rank ``ShardedTrainerClient`` in this process, and take nothing from the engine."""
    import torch.distributed as dist

    from wsync_grpc.trainer.sharded import ShardedTrainerClient

    stub = _stub(engine.target)
    name = "model.norm.weight"
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    served = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=[name]), timeout=30)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with ShardedTrainerClient([engine.target]) as client:
            status, sums = client.status(), client.checksums([name])
    finally:
        dist.destroy_process_group()
    assert list(status) == list(sums) == [engine.target]
    assert status[engine.target].weight_version == before.weight_version
    assert sums[engine.target].weight_version == served.weight_version
    assert sums[engine.target].by_name == {name: served.checksums[0].sha256}
    after = stub.GetStatus(pb.GetStatusRequest(), timeout=10)  # read-only: no lease taken, nothing changed
    assert after.weight_version == before.weight_version
    assert (after.HasField("owner"), after.owner.generation) == (before.HasField("owner"), before.owner.generation)


@pytest.mark.parametrize(
    ("mode", "steps", "transport"),
    # The gather mode's diff is the same whatever carries it: its delta runs through shared memory, whose gathered
    # sends the broadcast gather case (test_both_modes_are_bit_exact_...) does not cover; the direct mode runs both
    # by broadcast and through shared memory (every rank its own ring); one run of ranks each.
    [("direct", 2, "broadcast"), ("gather", 2, "shared_memory"), ("direct", 2, "shared_memory")],
)
def test_deltas_from_sharded_ranks_are_bit_exact_and_a_few_percent_of_the_bytes(
    engine: EngineProcess, mode: str, steps: int, transport: str
) -> None:
    """Deltas from two FSDP2 ranks trained with AdamW (lr 1e-5). Direct: every rank encodes its own shards
    against its own copy of what it last sent and sends them; the engine rebuilds every piece from what it
    serves and assembles the tensors. Gather: the ranks gather every bucket in lockstep before Prepare, rank 0
    diffs the whole tensors against its copy and sends the delta alone. Either way the engine serves the gathered
    weights in bfloat16 bit for bit (rank 0's checksums), and a delta is a few percent of the bytes. Through
    shared memory (gather: rank 0 packs each gathered bucket into its ring; direct: every rank packs its own
    buckets into a ring of its own, the engine's worker reads each from its sender's) no group is formed and the
    engine holds no segment afterwards."""
    ranks = start_ranks(
        [engine.target],
        f"--steps={steps}",
        f"--modes={mode}",
        f"--transport={transport}",
        "--train",
        "--lr=1e-5",
        "--dtype=bfloat16",
        "--delta",
        "--check=checksums",
    )
    codes = [r.wait() for r in ranks]
    assert codes == [0, 0], [r.stderr for r in ranks]
    for r in ranks:  # every rank returns rank 0's result
        synced = [e for e in r.events if e["event"] == "synced"]
        assert [e["delta_base"] for e in synced] == ["", *(f"step-{s}-{mode}" for s in range(1, steps))], synced
        assert all(e["verified"] == e["buckets"] for e in synced), synced
        assert all(e["wire_bytes"] < 0.2 * synced[0]["wire_bytes"] for e in synced[1:]), synced
        assert [e["received"][engine.target] for e in synced] == [e["wire_bytes"] for e in synced]
    checks = [e for e in ranks[0].events if e["event"] == "checked"]
    assert [c["failures"] for c in checks] == [[]] * steps  # every checksum bit-exact against the gathered weights
    if transport == "shared_memory":
        synced = [e for e in ranks[0].events if e["event"] == "synced"]
        assert all(e["init_seconds"] == 0 for e in synced), synced  # no group was formed for any sync
        status = _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert (status.weight_version, status.HasField("group")) == (f"step-{steps}-{mode}", False)
        assert segments_held(engine.process.pid) == 0  # nothing mapped, no descriptor kept, after the update


def test_shared_memory_refuses_the_individual_layout_before_any_call(engine: EngineProcess) -> None:
    """A one-rank ``ShardedTrainerClient`` in this process: ``transport="shared_memory"`` with the individual layout,
    and an unknown transport, are ``ValueError`` s on every rank (agreed on) before any engine is called; the
    trainer half refuses a direct topology from a trainer without rings of its ranks (one process)."""
    import threading

    import torch
    import torch.distributed as dist

    from wsync_grpc.core.layout import Bucket, Layout
    from wsync_grpc.core.topology import SendTopology
    from wsync_grpc.trainer.sharded import ShardedTrainerClient
    from wsync_grpc.transports.sending import ONE_PROCESS, SendJob, SendSite
    from wsync_grpc.transports.shared_memory.sender import SharedMemorySender

    stub = _stub(engine.target)
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    tensors = [("w", torch.ones(4, 4))]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with ShardedTrainerClient([engine.target]) as client:
            with pytest.raises(ValueError, match="flattened layout only"):
                client.sync(tensors, "v-individual", layout="individual", transport="shared_memory")
            with pytest.raises(ValueError, match="unknown transport 'bogus'"):
                client.sync(tensors, "v-bogus", transport="bogus")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="flattened layout only"):
                client.sync(tensors, "v-direct", mode="direct", layout="individual", transport="shared_memory")
    finally:
        dist.destroy_process_group()
    after = stub.GetStatus(pb.GetStatusRequest(), timeout=10)  # no call reached the engine
    assert (after.weight_version, after.updates_completed) == (before.weight_version, before.updates_completed)
    sender = SharedMemorySender(SendSite(ONE_PROCESS, torch.device("cpu")))
    job = SendJob(None, [], Layout.FLATTENED, lambda b: {}, SendTopology.direct(2), threading.Event())
    with pytest.raises(ValueError, match="a trainer of 1 rank"):
        sender.header_fields(job)
    bucket = Bucket(0, 64, (), 0)
    job = SendJob(None, [bucket], Layout.FLATTENED, lambda b: {}, SendTopology.direct(1), threading.Event())
    with pytest.raises(ValueError, match="without rings of its ranks"):
        sender.header_fields(job)
