"""Disk updates (``TRANSPORT_DISK``): engines read a real safetensors checkpoint, committed like a broadcast.

Real parts only: the reference engine serving SmolLM2-135M (and tiny Llamas) behind a real gRPC
server, a trainer that trains a real model a few steps and writes its checkpoint with safetensors,
real engine processes for the fleet and kill cases, and the real ``wsync reload`` CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import save_file
from support import ENV, ROOT, code_of, status, train
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.reference import ReferenceEngine
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import EngineProcess, cli_command, in_process_server, spawn_engine, stop_all, wait_all
from wsync_grpc.trainer import SyncError, TrainerClient
from wsync_grpc.transports.disk.writer import save_checkpoint
from wsync_grpc.wire.status import error_reason

PROMPT = "What is the capital of France?"
PRESET = "0.25gb"


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from ``transformers``' own ``generate``."""
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
        do_sample=False, pad_token_id=2,
    )  # fmt: skip
    return [int(t) for t in out[0, len(ids) :]]


def served_sums(engine: Any) -> dict[str, str]:
    return {n: tensor_sha256(engine.get_weight(n)) for n in engine.parameter_specs()}


def disk_header(path: str, version: str = "v-disk", **kw: Any) -> pb.PrepareHeader:
    return pb.PrepareHeader(weight_version=version, transport=pb.TRANSPORT_DISK, checkpoint_path=path, **kw)


def refused(stub: Any, header: pb.PrepareHeader) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
    return e.value


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trained_smollm2_checkpoint_is_served_without_a_group(smollm2_dir: Path, tmp_path: Path) -> None:
    """The trainer trains SmolLM2 three steps and saves it; the engine, never initialized, answers as the trainer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    trainer = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32)
    root = tmp_path / "checkpoints"
    with (
        ReferenceEngine.from_pretrained(None) as engine,
        in_process_server(engine, checkpoint_roots=[str(root.parent)]) as (srv, stub),
    ):
        ids = engine.encode_prompt(PROMPT)
        before = engine.generate(PROMPT, 16)
        assert list(before.token_ids) == hf_greedy(trainer, ids, 16)[: len(before.token_ids)]
        train(trainer, tokenizer, steps=3, lr=1e-4)
        phases: list[str] = []
        with TrainerClient([srv.address], rpc_timeout_s=60) as c:
            r = c.save_and_sync(trainer.state_dict().items(), root / "step-3", "step-3", on_phase=phases.append)
        assert phases == ["prepared", "verified", "applied"]
        assert (r.weight_version, r.tensor_count, r.wire_bytes, r.apply_mode) == ("step-3", 272, 0, "staged")
        assert r.payload_bytes == sum(s.nbytes for s in engine.parameter_specs().values())
        assert abs(sum(r.phases.values()) - r.total_seconds) < 1e-6
        st = status(stub)
        assert (st.weight_version, st.state) == ("step-3", pb.LIFECYCLE_STATE_UNINITIALIZED)  # type: ignore[attr-defined]
        trained = trainer.state_dict()
        assert served_sums(engine) == {n: tensor_sha256(trained[n]) for n in engine.parameter_specs()}
        after = engine.generate(PROMPT, 16)
        assert after.weight_versions == ("step-3",)
        assert list(after.token_ids) == hf_greedy(trainer, ids, 16)[: len(after.token_ids)]
        assert after.token_ids != before.token_ids, "three training steps changed nothing the engine serves"
        assert "Lyon" in after.text and "Paris" in before.text


class Tiny:
    """A reference engine serving a tiny Llama (seed 0) that reads checkpoints under ``root``, behind a real server."""

    def __init__(self, engine: ReferenceEngine, stub: Any, target: str, root: Path) -> None:
        self.engine, self.stub, self.target, self.root = engine, stub, target, root

    def unchanged(self, sums: dict[str, str], state: int = pb.LIFECYCLE_STATE_UNINITIALIZED) -> None:
        """The engine serves exactly ``sums`` and is in ``state``, with no update in flight."""
        assert served_sums(self.engine) == sums
        st = status(self.stub)
        assert st.state == state and not st.HasField("update")  # type: ignore[attr-defined]


@pytest.fixture
def tiny(make_tiny_llama: Any, smollm2_tokenizer: Any, tmp_path: Path) -> Iterator[Tiny]:
    root = tmp_path / "root"
    root.mkdir()
    with (
        ReferenceEngine(make_tiny_llama(seed=0), smollm2_tokenizer, name="tiny") as engine,
        in_process_server(engine, checkpoint_roots=[str(root)]) as (srv, stub),
    ):
        yield Tiny(engine, stub, srv.address, root)


@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_staged_and_streaming_disk_updates_apply_exactly_and_keep_the_group(
    tiny: Tiny, make_tiny_llama: Any, apply_mode: str
) -> None:
    """An initialized engine (READY, in the trainer's group) takes a disk update and stays in its group."""
    new = make_tiny_llama(seed=1)
    with TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        c.init()
        c.save_and_sync(new.state_dict().items(), tiny.root / "v1", "v1", apply_mode=apply_mode, flush_cache=True)
        st = status(tiny.stub)
        assert (st.state, st.weight_version, st.paused) == (pb.LIFECYCLE_STATE_READY, "v1", False)  # type: ignore[attr-defined]
        sd = new.state_dict()
        assert served_sums(tiny.engine) == {n: tensor_sha256(sd[n]) for n in tiny.engine.parameter_specs()}
        ids = tiny.engine.encode_prompt(PROMPT)
        assert list(tiny.engine.generate(PROMPT, 8).token_ids) == hf_greedy(new, ids, 8)[:8]
        newer = make_tiny_llama(seed=2)
        assert not c.needs_init  # the group is still there: a broadcast follows without a re-init
        c.sync(newer.named_parameters(), "v2")
        assert served_sums(tiny.engine)["model.norm.weight"] == tensor_sha256(newer.model.norm.weight)
        assert status(tiny.stub).state == pb.LIFECYCLE_STATE_READY  # type: ignore[attr-defined]


def test_a_sharded_checkpoint_is_read_through_its_index_and_relative_paths_are_under_the_root(
    tiny: Tiny, make_tiny_llama: Any
) -> None:
    new = make_tiny_llama(seed=3)
    new.save_pretrained(tiny.root / "sharded", max_shard_size="2MB", safe_serialization=True)
    shards = sorted(p.name for p in (tiny.root / "sharded").glob("*.safetensors"))
    assert len(shards) >= 2 and (tiny.root / "sharded" / "model.safetensors.index.json").is_file()
    with TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        r = c.sync_from_disk("sharded", "v3")  # relative: under the engine's first root
    assert r.bucket_count >= len(shards)  # a bucket never spans two files
    sd = new.state_dict()
    assert served_sums(tiny.engine) == {n: tensor_sha256(sd[n]) for n in tiny.engine.parameter_specs()}


def test_paths_outside_the_roots_are_permission_denied_and_change_nothing(tiny: Tiny, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    save_checkpoint(synthetic_like(tiny.engine, seed=4).items(), outside)  # a valid checkpoint, but not allowed
    (tiny.root / "link").symlink_to(outside)  # a symlink out of the root
    (tiny.root / "indexed").mkdir()
    (tiny.root / "indexed" / "shard.safetensors").symlink_to(outside / "model.safetensors")
    (tiny.root / "indexed" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "shard.safetensors"}})
    )
    before = served_sums(tiny.engine)
    cases = {
        str(outside): ("PATH_OUTSIDE_ROOTS", "lies outside"),
        str(tiny.root / "link"): ("SYMLINK_IN_PATH", "symbolic link"),
        str(tiny.root / ".." / "outside"): ("PATH_OUTSIDE_ROOTS", "'..'"),
        "../outside": ("PATH_OUTSIDE_ROOTS", "'..'"),
        str(tiny.root / "indexed"): ("SYMLINK_IN_PATH", "symbolic link"),
        "/etc": ("PATH_OUTSIDE_ROOTS", "lies outside"),
    }
    for path, (reason, text) in cases.items():
        err = refused(tiny.stub, disk_header(path))
        assert code_of(err) == grpc.StatusCode.PERMISSION_DENIED, (path, err)
        assert error_reason(err) == reason and text in err.details(), (path, err.details())  # type: ignore[attr-defined]
        tiny.unchanged(before)
    with in_process_server(TensorEngine(synthetic.build("tiny"))) as (_, no_roots):
        err = refused(no_roots, disk_header(str(outside)))
        assert code_of(err) == grpc.StatusCode.PERMISSION_DENIED and error_reason(err) == "NO_CHECKPOINT_ROOT"
        assert "--checkpoint-root" in err.details()  # type: ignore[attr-defined]


class Exploit:
    """Unpickling this creates a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_bad_checkpoints_are_refused_before_a_byte_is_loaded(tiny: Tiny, tmp_path: Path) -> None:
    marker = tmp_path / "pickle-was-loaded"
    pickled = tiny.root / "pickled"
    pickled.mkdir()
    torch.save({"model.norm.weight": Exploit(marker)}, pickled / "pytorch_model.bin")
    (tiny.root / "garbage.safetensors").write_bytes(b"\xff" * 64)
    specs = tiny.engine.parameter_specs()
    norm = specs["model.norm.weight"]
    save_file({"model.nope.weight": torch.zeros(4)}, str(tiny.root / "unknown.safetensors"))
    save_file({"model.norm.weight": torch.zeros(norm.shape[0] + 1)}, str(tiny.root / "shape.safetensors"))
    save_file({"model.norm.weight": torch.zeros(norm.shape, dtype=torch.int32)}, str(tiny.root / "dtype.safetensors"))
    before = served_sums(tiny.engine)
    cases = {
        "pickled": (grpc.StatusCode.INVALID_ARGUMENT, "PICKLE_CHECKPOINT"),
        "pickled/pytorch_model.bin": (grpc.StatusCode.INVALID_ARGUMENT, "PICKLE_CHECKPOINT"),
        "garbage.safetensors": (grpc.StatusCode.INVALID_ARGUMENT, "BAD_CHECKPOINT_FILE"),
        "unknown.safetensors": (grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_TENSOR"),
        "shape.safetensors": (grpc.StatusCode.INVALID_ARGUMENT, "SHAPE_MISMATCH"),
        "dtype.safetensors": (grpc.StatusCode.INVALID_ARGUMENT, "DTYPE_MISMATCH"),
        "missing": (grpc.StatusCode.NOT_FOUND, "CHECKPOINT_NOT_FOUND"),
    }
    for path, (code, reason) in cases.items():
        err = refused(tiny.stub, disk_header(path))
        assert (code_of(err), error_reason(err)) == (code, reason), (path, err)
        tiny.unchanged(before)
    assert not marker.exists(), "a pickle checkpoint was unpickled"
    # The refused raw calls above were the anonymous owner's (alive for its lease ttl): so is this client.
    with TrainerClient([tiny.target], rpc_timeout_s=30, owner="") as c, pytest.raises(SyncError) as e:
        c.sync_from_disk("shape.safetensors", "v-bad")
    assert e.value.stage == "prepare" and e.value.published == "none"
    assert e.value.failures[tiny.target].reason == "SHAPE_MISMATCH"
    tiny.unchanged(before)


def synthetic_like(engine: Any, seed: int) -> dict[str, torch.Tensor]:
    """Seeded values for every canonical tensor of ``engine`` (its dtypes and shapes)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in engine.parameter_specs().items()}


@pytest.mark.timeout(300)
def test_cancel_abandons_a_disk_update_and_the_served_weights_stay(tmp_path: Path) -> None:
    """Cancel right after Prepare replied (the readers mid-file): FAILED, old weights; the next disk update runs."""
    old = synthetic.build(PRESET, seed=0)
    engine = TensorEngine({n: t.clone() for n, t in old.items()}, aliases=synthetic.aliases(PRESET))
    save_checkpoint(synthetic.build(PRESET, seed=1).items(), tmp_path / "v1")
    with in_process_server(engine, checkpoint_roots=[str(tmp_path)]) as (_, stub):
        r = stub.Prepare(iter([pb.PrepareRequest(header=disk_header(str(tmp_path / "v1"), "v1"))]), timeout=30)
        assert stub.Cancel(pb.CancelRequest(update_id=r.update_id, reason="operator"), timeout=30).cancelled
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(pb.CompleteRequest(update_id=r.update_id), timeout=30)
        assert code_of(e.value) == grpc.StatusCode.ABORTED and error_reason(e.value) == "UPDATE_CANCELLED"
        st = status(stub)
        assert st.state == pb.LIFECYCLE_STATE_FAILED and st.last_error.reason == "UPDATE_CANCELLED"  # type: ignore[attr-defined]
        assert all(torch.equal(engine.tensors[n], old[n]) for n in old)
        # From FAILED, a disk update needs no Init either, and ends without a group.
        r = stub.Prepare(iter([pb.PrepareRequest(header=disk_header(str(tmp_path / "v1"), "v1"))]), timeout=30)
        assert stub.Complete(pb.CompleteRequest(update_id=r.update_id), timeout=60).weight_version == "v1"
        assert status(stub).state == pb.LIFECYCLE_STATE_UNINITIALIZED  # type: ignore[attr-defined]
        new = synthetic.build(PRESET, seed=1)
        assert all(torch.equal(engine.tensors[n], new[n]) for n in new)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    """Three engine processes serving ``PRESET`` (seed 0) that read checkpoints under ``tmp_path/root``."""
    (tmp_path / "root").mkdir()
    args = ["--synthetic", PRESET, "--dtype", "bfloat16", "--grace", "1", "--checkpoint-root", str(tmp_path / "root")]
    procs = [
        spawn_engine(args, port_file=tmp_path / f"e{i}.port", log=tmp_path / f"e{i}.log", env=ENV, cwd=ROOT, wait=False)
        for i in range(3)
    ]
    try:
        wait_all(procs)
        yield procs
    finally:
        stop_all(procs, grace_s=2)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kill_at", ["prepared", "verified"])
def test_a_killed_engine_fails_a_fleet_disk_update_everywhere_or_nowhere(
    fleet: list[EngineProcess], tmp_path: Path, kill_at: str
) -> None:
    """An engine SIGKILLed while the fleet reads the checkpoint, or once every engine verified it."""
    old, new = synthetic.build(PRESET, seed=0), synthetic.build(PRESET, seed=1)
    save_checkpoint(new.items(), tmp_path / "root" / "v1")
    victim, survivors = fleet[1], [fleet[0], fleet[2]]

    def on_phase(phase: str) -> None:
        if phase == kill_at:
            victim.kill()

    with TrainerClient([e.target for e in fleet], rpc_timeout_s=30) as c, pytest.raises(SyncError) as e:
        c.sync_from_disk(tmp_path / "root" / "v1", "v1", on_phase=on_phase)
    err = e.value
    assert victim.target in err.failures, err
    expected, version = (new, "v1") if kill_at == "verified" else (old, "")
    assert err.published == ("partial" if kill_at == "verified" else "none")
    with TrainerClient([s.target for s in survivors], rpc_timeout_s=30) as reader:
        for t, st in reader.status().items():
            assert st.weight_version == version, (t, st)
        for t, sums in reader.checksums().items():
            assert {x.name: x.sha256 for x in sums.checksums} == {n: tensor_sha256(v) for n, v in expected.items()}, t


def test_wsync_reload_loads_a_checkpoint_on_every_target_with_progress_bars(tmp_path: Path) -> None:
    root = tmp_path / "root"
    new = synthetic.build("tiny", seed=5)
    save_checkpoint(new.items(), root / "v5")
    args = ["--synthetic", "tiny", "--dtype", "bfloat16", "--grace", "1", "--checkpoint-root", str(root)]
    procs = [spawn_engine(args, port_file=tmp_path / f"e{i}.port", env=ENV, cwd=ROOT) for i in range(2)]
    try:
        targets = [a for p in procs for a in ("--target", p.target)]
        ok = subprocess.run(
            cli_command("reload", "--checkpoint", str(root / "v5"), "--version", "v5", *targets),
            capture_output=True, text=True, timeout=120, env=ENV,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        out = json.loads(ok.stdout)
        assert out["weight_version"] == "v5" and sorted(out["engines"]) == sorted(p.target for p in procs)
        assert procs[0].target in ok.stderr and procs[1].target in ok.stderr  # one bar per engine
        with TrainerClient([p.target for p in procs], rpc_timeout_s=30) as reader:
            for sums in reader.checksums().values():
                assert {x.name: x.sha256 for x in sums.checksums} == {n: tensor_sha256(v) for n, v in new.items()}
        bad = subprocess.run(
            cli_command("reload", "--checkpoint", "/etc", "--version", "v6", "--no-bars", *targets),
            capture_output=True, text=True, timeout=120, env=ENV,
        )  # fmt: skip
        assert bad.returncode == 1 and "PERMISSION_DENIED" in bad.stderr and "PATH_OUTSIDE_ROOTS" in bad.stderr
    finally:
        stop_all(procs, grace_s=2)


def test_save_checkpoint_renames_into_place_and_an_open_reader_keeps_the_old_file(tmp_path: Path) -> None:
    """A reader that opened the previous file keeps reading it whole; no temporary file is left behind."""
    from safetensors import safe_open

    old, new = synthetic.build("tiny", seed=1), synthetic.build("tiny", seed=2)
    path = save_checkpoint(old.items(), tmp_path / "ckpt")
    with safe_open(str(path), framework="pt") as reader:
        assert save_checkpoint(new.items(), tmp_path / "ckpt") == path
        assert all(torch.equal(reader.get_tensor(n), old[n]) for n in old)
    with safe_open(str(path), framework="pt") as reader:
        assert all(torch.equal(reader.get_tensor(n), new[n]) for n in new)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["model.safetensors"]
