"""LoRA adapters: loaded, replaced and unloaded by name on a live engine, from a live PEFT model or a PEFT directory.

Real parts only: PEFT LoRA adapters trained for a few steps on SmolLM2-135M (and on tiny Llamas),
written with PEFT's own ``save_pretrained``; the reference engine behind a real gRPC server; the
trainer's real ``TrainerClient`` (its broadcast over a real gloo group, or the engine's disk read).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support import StatusProbe, code_of, status, train
from wsync.v1 import generation_pb2, generation_pb2_grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.engine import PauseMode
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.generation_service import add_generation_service
from wsync_grpc.engines.reference import FinishReason, ReferenceEngine
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import in_process_server
from wsync_grpc.trainer import SyncError, TrainerClient
from wsync_grpc.transports.disk.checkpoint import MAX_ADAPTER_CONFIG_BYTES
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (calls answered within 1 s during a load): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

PROMPT = "What is the capital of France?"

peft = pytest.importorskip("peft")


def lora(model: Any, r: int = 4, alpha: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"), **kw: Any) -> Any:
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **kw)
    return peft.get_peft_model(model, config).eval()


def randomize(model: Any, seed: int, std: float = 0.3) -> Any:
    """Seeded lora_B values (PEFT starts them at zero: an untrained adapter changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=2,
        )  # fmt: skip
    return [int(t) for t in out[0, len(ids) :]]


def answer(engine: ReferenceEngine, adapter: str | None = None, n: int = 12) -> Any:
    return engine.generate(PROMPT, n, adapter=adapter)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trained_smollm2_adapter_is_served_by_name_and_replaced_from_disk(smollm2_dir: Path, tmp_path: Path) -> None:
    """A LoRA adapter trained on SmolLM2 is broadcast, then retrained and reloaded from its PEFT directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32)
    trainer = lora(base, r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    with (
        ReferenceEngine.from_pretrained(None) as engine,
        in_process_server(engine, checkpoint_roots=[str(tmp_path)]) as (srv, stub),
        TrainerClient([srv.address], rpc_timeout_s=60) as client,
    ):
        ids = engine.encode_prompt(PROMPT)
        before = answer(engine)
        train(trainer, tokenizer, steps=3, lr=1e-2)
        r = client.sync_adapter(trainer, "lyon", "step-3")
        assert (r.weight_version, r.tensor_count) == ("step-3", 4 * 2 * 30)
        tuned = answer(engine, "lyon")
        assert (tuned.adapter, tuned.adapter_versions) == ("lyon", ("step-3",))
        assert list(tuned.token_ids) == greedy(trainer, ids, 12)[: len(tuned.token_ids)]
        assert list(tuned.token_ids) != list(before.token_ids), "three training steps changed nothing"
        base_now = answer(engine)  # the base model is untouched and still answers without the adapter
        assert base_now.token_ids == before.token_ids and base_now.adapter == "" and not base_now.adapter_versions
        assert status(stub).weight_version == ""  # type: ignore[attr-defined]
        train(trainer, tokenizer, steps=3, lr=1e-2)
        trainer.save_pretrained(tmp_path / "lyon-6")
        client.sync_adapter(tmp_path / "lyon-6", "lyon", "step-6")
        retuned = answer(engine, "lyon")
        assert retuned.adapter_versions == ("step-6",)
        assert list(retuned.token_ids) == greedy(trainer, ids, 12)[: len(retuned.token_ids)]
        assert retuned.token_ids != tuned.token_ids, "the replaced adapter still answers"
        listed = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10)
        assert [(a.name, a.version, a.rank, a.tensor_count) for a in listed.adapters] == [("lyon", "step-6", 8, 240)]


class Tiny:
    """A reference engine serving a tiny Llama (seed 0) with its GenerationService, behind a real server."""

    def __init__(self, engine: ReferenceEngine, stub: Any, gen: Any, target: str, root: Path) -> None:
        self.engine, self.stub, self.gen, self.target, self.root = engine, stub, gen, target, root

    def listed(self) -> list[tuple[str, str]]:
        return [(a.name, a.version) for a in self.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters]


def with_generation(server: grpc.Server, engine: ReferenceEngine) -> list[str]:
    add_generation_service(server, engine)
    return [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name]


@pytest.fixture
def tiny(make_tiny_llama: Any, smollm2_tokenizer: Any, tmp_path: Path) -> Iterator[Tiny]:
    engine = ReferenceEngine(make_tiny_llama(seed=0), smollm2_tokenizer, name="tiny")
    with (
        engine,
        in_process_server(
            engine,
            checkpoint_roots=[str(tmp_path)],
            extra=lambda server: with_generation(server, engine),
        ) as (srv, stub),
        grpc.insecure_channel(srv.address) as channel,
    ):
        yield Tiny(engine, stub, generation_pb2_grpc.GenerationServiceStub(channel), srv.address, tmp_path)


def test_a_replaced_adapter_never_computes_another_token(tiny: Tiny, make_tiny_llama: Any) -> None:
    """A request running with v1 when v2 replaces it continues on v2 alone, its context recomputed."""
    v1 = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    v2 = randomize(lora(make_tiny_llama(seed=0)), seed=2)
    ids = tiny.engine.encode_prompt(PROMPT)
    with TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        c.sync_adapter(v1, "a", "v1")
        first = answer(tiny.engine, "a", 40)
        assert list(first.token_ids) == greedy(v1, ids, 40)[: len(first.token_ids)]
        handle = tiny.engine.submit(PROMPT, 40, adapter="a")
        assert handle.wait_for_tokens(5, 60)
        tiny.engine.pause(PauseMode.KEEP, 30)  # hold it between two steps while v2 replaces v1
        n = handle.tokens_generated
        c.sync_adapter(v2, "a", "v2")
        tiny.engine.resume()
        mixed = handle.result()
        fresh = answer(tiny.engine, "a", 40)
    assert mixed.adapter_versions == ("v1", "v2") and 5 <= n < 40
    before, after = list(mixed.token_ids[:n]), list(mixed.token_ids[n:])
    assert before == greedy(v1, ids, n)  # up to the replacement: v1
    assert after == greedy(v2, ids + before, len(after))  # from it on: v2 alone, on a context it recomputed
    assert fresh.adapter_versions == ("v2",)
    assert list(fresh.token_ids) == greedy(v2, ids, 40)[: len(fresh.token_ids)]
    assert list(fresh.token_ids) != list(first.token_ids)
    assert tiny.listed() == [("a", "v2")]


def test_a_live_adapter_travels_through_shared_memory_bit_exact(tiny: Tiny, make_tiny_llama: Any) -> None:
    """``sync_adapter(..., transport="shared_memory")``: the live adapter's tensors go through the trainer's
    segment (no group formed), the engine serves them bit-exact and generates with them as PEFT does; replaced the
    same way, the new version answers; the base model is untouched."""
    v1 = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    v2 = randomize(lora(make_tiny_llama(seed=0)), seed=2)
    ids = tiny.engine.encode_prompt(PROMPT)
    base = answer(tiny.engine, None, 8)
    with TrainerClient([tiny.target], rpc_timeout_s=30, bucket_bytes=4 << 10) as c:
        for version, model in (("v1", v1), ("v2", v2)):
            r = c.sync_adapter(model, "a", version, transport="shared_memory")
            assert (r.weight_version, r.tensor_count, r.apply_mode) == (version, 2 * 2 * 2, "staged")
            assert r.bucket_count > 1 and r.engines[tiny.target].buckets_verified == r.bucket_count
            assert r.init_seconds == 0 and c.group is None  # no group formed
            peft_sums = {n: tensor_sha256(t) for n, t in peft.get_peft_model_state_dict(model).items()}
            assert {n: tensor_sha256(t) for n, t in tiny.engine.adapter_tensors("a").items()} == peft_sums
            out = answer(tiny.engine, "a", 12)
            assert out.adapter_versions == (version,)
            assert list(out.token_ids) == greedy(model, ids, 12)[: len(out.token_ids)]
        assert not status(tiny.stub).HasField("group")
    assert tiny.listed() == [("a", "v2")]
    assert answer(tiny.engine, None, 8).token_ids == base.token_ids and status(tiny.stub).weight_version == ""


def test_bad_adapters_are_refused_and_the_old_one_keeps_serving(tiny: Tiny, make_tiny_llama: Any) -> None:
    good = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    with TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        c.sync_adapter(good, "a", "v1")
        served = {n: tensor_sha256(t) for n, t in tiny.engine.adapter_tensors("a").items()}
        before = answer(tiny.engine, "a")
        bad_dirs = _bad_adapter_dirs(tiny.root, good, make_tiny_llama)
        for name, (reason, code) in bad_dirs.items():
            with pytest.raises(SyncError) as e:
                c.sync_adapter(tiny.root / name, "a", f"bad-{name}")
            failure = e.value.failures[tiny.target]
            assert (failure.code, failure.reason) == (code, reason), (name, failure)
            assert e.value.published == "none" and tiny.listed() == [("a", "v1")]
            assert {n: tensor_sha256(t) for n, t in tiny.engine.adapter_tensors("a").items()} == served
            assert answer(tiny.engine, "a").token_ids == before.token_ids
        # Sent as buckets: a rank the tensors do not have, a module that is not a linear one.
        wrong_rank = randomize(lora(make_tiny_llama(seed=0), r=8), seed=3)
        wrong_rank.peft_config["default"].r = 4  # claims rank 4, carries rank-8 tensors
        with pytest.raises(SyncError) as e:
            c.sync_adapter(wrong_rank, "a", "bad-rank")
        assert e.value.failures[tiny.target].reason == "SHAPE_MISMATCH"
        embedding = lora(make_tiny_llama(seed=0), targets=("embed_tokens",))
        with pytest.raises(SyncError) as e:
            c.sync_adapter(embedding, "a", "bad-target")
        assert e.value.failures[tiny.target].reason == "NO_TARGET_MODULES"
    assert tiny.listed() == [("a", "v1")] and answer(tiny.engine, "a").token_ids == before.token_ids


def _bad_adapter_dirs(root: Path, good: Any, make_tiny_llama: Any) -> dict[str, tuple[str, grpc.StatusCode]]:
    """PEFT directories that must be refused: name -> (reason, code)."""
    good.save_pretrained(root / "good")
    cases: dict[str, tuple[str, grpc.StatusCode]] = {}
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    def variant(name: str, config: dict[str, Any] | None = None, drop_safetensors: bool = False) -> Path:
        d = root / name
        d.mkdir()
        cfg = json.loads((root / "good" / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
        if not drop_safetensors:
            (d / "adapter_model.safetensors").write_bytes((root / "good" / "adapter_model.safetensors").read_bytes())
        return d

    variant("rank", {"r": 8})
    cases["rank"] = ("SHAPE_MISMATCH", invalid)
    variant("targets", {"target_modules": ["q_proj"]})  # the file also holds v_proj's tensors
    cases["targets"] = ("UNKNOWN_TENSOR", invalid)
    variant("dora", {"use_dora": True})
    cases["dora"] = ("UNSUPPORTED_ADAPTER", invalid)
    variant("prefix", {"peft_type": "PREFIX_TUNING"})
    cases["prefix"] = ("NOT_A_LORA_ADAPTER", invalid)
    d = variant("pickled", drop_safetensors=True)
    torch.save({"x": torch.zeros(1)}, d / "adapter_model.bin")
    cases["pickled"] = ("PICKLE_CHECKPOINT", invalid)
    (root / "nothing").mkdir()
    cases["nothing"] = ("NOT_A_PEFT_DIRECTORY", invalid)
    return cases


def test_unload_aborts_requests_naming_it_and_generation_says_not_found(tiny: Tiny, make_tiny_llama: Any) -> None:
    a = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    with TrainerClient([tiny.target], rpc_timeout_s=30, owner="trainer") as c:
        c.sync_adapter(a, "a", "v1")
        reply = tiny.gen.Generate(generation_pb2.GenerateRequest(prompt=PROMPT, adapter="a"), timeout=60)
        assert (reply.adapter, list(reply.adapter_versions)) == ("a", ["v1"])
        handle = tiny.engine.submit(PROMPT, 200, adapter="a")
        assert handle.wait_for_tokens(2, 60)
        with pytest.raises(grpc.RpcError) as e:  # another caller may not unload it, even sending the owner's name
            tiny.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a", owner="trainer"), timeout=10)
        assert error_reason(e.value) == "NOT_OWNER"
        owners = c.stubs[tiny.target]  # the owner's own stub: it presents the client's lease credential
        r = owners.UnloadAdapter(pb.UnloadAdapterRequest(name="a", owner="trainer"), timeout=10)
        assert (r.was_loaded, r.version, r.aborted_requests) == (True, "v1", 1)
        assert handle.result().finish_reason is FinishReason.ABORTED
        assert not owners.UnloadAdapter(pb.UnloadAdapterRequest(name="a", owner="trainer"), timeout=10).was_loaded
        with pytest.raises(grpc.RpcError) as e:
            tiny.gen.Generate(generation_pb2.GenerateRequest(prompt=PROMPT, adapter="a"), timeout=60)
        assert code_of(e.value) == grpc.StatusCode.NOT_FOUND
        assert tiny.listed() == []
        base = tiny.gen.Generate(generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=8), timeout=60)
        assert list(base.token_ids) == greedy(make_tiny_llama(seed=0), tiny.engine.encode_prompt(PROMPT), 8)[:8]


def test_an_adapter_of_a_rank_beyond_every_module_is_refused_before_anything_is_allocated(tiny: Tiny) -> None:
    """The reference engine serves ranks up to the largest ``min(in, out)`` of its linear modules: a rank of a
    billion (a claim of terabytes) is refused with its reason, and the engine serves on, ready."""
    bound = max(min(s.in_features, s.out_features) for s in tiny.engine.lora_linears().values())
    assert tiny.engine.lora_max_rank() == bound
    for rank in (bound + 1, 10**9):
        spec = pb.AdapterSpec(name="huge", rank=rank, alpha=8, target_modules=["q_proj"])
        header = pb.PrepareHeader(weight_version="v", adapter=spec, bucket_count=1, total_bytes=4)
        with pytest.raises(grpc.RpcError) as e:
            tiny.stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=10)
        assert code_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert error_reason(e.value) == "ADAPTER_RANK_TOO_LARGE" and str(bound) in (e.value.details() or "")
    assert status(tiny.stub).state == pb.LIFECYCLE_STATE_UNINITIALIZED and tiny.listed() == []


def test_an_engine_without_adapters_says_so() -> None:
    with in_process_server(TensorEngine(synthetic.build("tiny"))) as (_, stub):
        assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).supported
        spec = pb.AdapterSpec(name="a", rank=4, alpha=8, target_modules=["q"])
        header = pb.PrepareHeader(weight_version="v", adapter=spec, bucket_count=1, total_bytes=4)
        with pytest.raises(grpc.RpcError) as e:
            stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=10)
        assert code_of(e.value) == grpc.StatusCode.UNIMPLEMENTED and error_reason(e.value) == "ADAPTERS_UNIMPLEMENTED"


def test_the_cli_loads_lists_uses_and_unloads_an_adapter(
    tiny: Tiny, make_tiny_llama: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``wsync reload --adapter``, ``wsync adapters``, ``wsync generate --adapter``, ``wsync unload-adapter``."""
    from wsync_grpc.tools import cli

    a = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    a.save_pretrained(tiny.root / "a-v1")
    target = ["--target", tiny.target]
    assert (
        cli.main(["reload", "--checkpoint", str(tiny.root / "a-v1"), "--version", "v1", "--adapter", "a", *target]) == 0
    )
    out = capsys.readouterr()
    assert json.loads(out.out)["weight_version"] == "v1" and tiny.target in out.err  # the JSON result, the bar
    assert cli.main(["adapters", *target]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(x["name"], x["version"], x["rank"]) for x in listed["adapters"]] == [("a", "v1", 4)]
    assert cli.main(["generate", PROMPT, "--adapter", "a", "--max-new-tokens", "8", "--json", *target]) == 0
    reply = json.loads(capsys.readouterr().out)
    ids = tiny.engine.encode_prompt(PROMPT)
    assert reply["adapter_versions"] == ["v1"] and reply["token_ids"] == greedy(a, ids, 8)[: len(reply["token_ids"])]
    assert cli.main(["unload-adapter", "a", *target]) == 0
    assert json.loads(capsys.readouterr().out)["was_loaded"] is True
    assert cli.main(["reload", "--checkpoint", "/etc", "--version", "v2", "--adapter", "a", "--no-bars", *target]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


def test_base_weight_updates_keep_adapters_serving_on_the_new_base(tiny: Tiny, make_tiny_llama: Any) -> None:
    """New base weights broadcast with an adapter loaded: base answers follow, the adapter rides on the new base."""
    a = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    ids = tiny.engine.encode_prompt(PROMPT)
    with TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        c.sync_adapter(a, "a", "v1")
        new_base = make_tiny_llama(seed=5)
        c.sync(new_base.named_parameters(), "base-5")
        base = answer(tiny.engine, None, 8)
        assert base.weight_versions == ("base-5",) and list(base.token_ids) == greedy(new_base, ids, 8)[:8]
        on_new = lora(make_tiny_llama(seed=5))  # the same adapter on the new base
        peft.set_peft_model_state_dict(on_new, peft.get_peft_model_state_dict(a))
        tuned = answer(tiny.engine, "a", 8)
        assert tuned.adapter_versions == ("v1",)
        assert list(tuned.token_ids) == greedy(on_new, ids, 8)[: len(tuned.token_ids)]
    assert tiny.listed() == [("a", "v1")]


def test_an_adapter_update_in_flight_cannot_be_unloaded(tiny: Tiny, make_tiny_llama: Any) -> None:
    """UnloadAdapter of the adapter an update in flight loads: FAILED_PRECONDITION; the update then applies."""
    randomize(lora(make_tiny_llama(seed=0)), seed=1).save_pretrained(tiny.root / "a")
    spec = pb.AdapterSpec(name="a")
    header = pb.PrepareHeader(
        weight_version="v1", transport=pb.TRANSPORT_DISK, checkpoint_path=str(tiny.root / "a"), adapter=spec
    )
    r = tiny.stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        tiny.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"), timeout=10)
    assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(e.value) == "ADAPTER_UPDATE_IN_FLIGHT"
    assert tiny.stub.Complete(pb.CompleteRequest(update_id=r.update_id), timeout=30).weight_version == "v1"
    assert tiny.listed() == [("a", "v1")]


def _with_targets(root: Path, src: Path, name: str, targets: Any) -> Path:
    """A copy of the PEFT directory ``src`` whose adapter_config.json sets ``target_modules`` to ``targets``."""
    d = root / name
    d.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": targets}))
    (d / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return d


@pytest.mark.timeout(120)
def test_a_backtracking_target_regex_is_matched_in_bounded_time(tiny: Tiny, make_tiny_llama: Any) -> None:
    """PEFT's one-string target_modules is matched whole in linear time: ``(.|.)*`` regexes never freeze the engine.

    With Python's ``re``, each module name the regex does not match (k_proj, o_proj, the MLP...)
    backtracks through 2^len(name) paths: the engine, GIL held, would not answer for hours.
    """
    good = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    good.save_pretrained(tiny.root / "listed")
    matching = _with_targets(tiny.root, tiny.root / "listed", "regex", r"(.|.)*\.(q_proj|v_proj)")
    hopeless = _with_targets(tiny.root, tiny.root / "listed", "hopeless", "(.|.)*!")
    lookahead = _with_targets(tiny.root, tiny.root / "listed", "lookahead", r"(?=.*q_proj).*")
    ids = tiny.engine.encode_prompt(PROMPT)
    with StatusProbe(tiny.stub) as probe, TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        t0 = time.monotonic()
        with pytest.raises(SyncError) as e:
            c.sync_adapter(hopeless, "h", "v1")
        refused_s = time.monotonic() - t0
        failure = e.value.failures[tiny.target]
        assert (failure.code, failure.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "NO_TARGET_MODULES")
        assert "(.|.)" not in failure.message  # the file's content is not echoed
        with pytest.raises(SyncError) as e:
            c.sync_adapter(lookahead, "h", "v1")
        assert e.value.failures[tiny.target].reason == "BAD_TARGET_REGEX"
        c.sync_adapter(matching, "a", "v1")
    assert refused_s < 5, refused_s
    assert probe.calls > 0 and probe.slowest < 1.0, (probe.calls, probe.slowest)
    assert tiny.listed() == [("a", "v1")]
    listed = tiny.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters[0]
    assert list(listed.target_modules) == [r"(.|.)*\.(q_proj|v_proj)"]
    peft_sums = {n: tensor_sha256(t) for n, t in peft.get_peft_model_state_dict(good).items()}
    assert {n: tensor_sha256(t) for n, t in tiny.engine.adapter_tensors("a").items()} == peft_sums
    out = answer(tiny.engine, "a", 12)
    assert list(out.token_ids) == greedy(good, ids, 12)[: len(out.token_ids)]


MARKER = "OUTSIDE-THE-ROOT-7f3a"


def test_adapter_files_are_opened_beneath_the_root_only(
    tiny: Tiny, make_tiny_llama: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A symlinked or FIFO adapter_config.json or weights file is refused; nothing outside is read or echoed."""
    good = randomize(lora(make_tiny_llama(seed=0)), seed=1)
    good.save_pretrained(tiny.root / "good")
    outside = tmp_path_factory.mktemp("outside")
    cfg = json.loads((tiny.root / "good" / "adapter_config.json").read_text())
    (outside / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": MARKER}))
    (outside / "adapter_model.safetensors").write_bytes((tiny.root / "good" / "adapter_model.safetensors").read_bytes())

    def variant(name: str) -> Path:
        d = tiny.root / name
        d.mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (d / f).write_bytes((tiny.root / "good" / f).read_bytes())
        return d

    (variant("config-link") / "adapter_config.json").unlink()
    (tiny.root / "config-link" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    (variant("weights-link") / "adapter_model.safetensors").unlink()
    (tiny.root / "weights-link" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (variant("config-fifo") / "adapter_config.json").unlink()
    os.mkfifo(tiny.root / "config-fifo" / "adapter_config.json")
    with (variant("config-huge") / "adapter_config.json").open("r+b") as f:  # sparse: costs no disk
        f.truncate(MAX_ADAPTER_CONFIG_BYTES + 1)
    (tiny.root / "dir-link").symlink_to(tiny.root / "good")
    denied, invalid = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT
    cases = {
        "config-link": (denied, "SYMLINK_IN_PATH"),
        "weights-link": (denied, "SYMLINK_IN_PATH"),
        "dir-link": (denied, "SYMLINK_IN_PATH"),
        "config-fifo": (denied, "NOT_A_REGULAR_FILE"),
        "config-huge": (invalid, "ADAPTER_CONFIG_TOO_LARGE"),
    }
    with StatusProbe(tiny.stub) as probe, TrainerClient([tiny.target], rpc_timeout_s=30) as c:
        for name, expected in cases.items():
            with pytest.raises(SyncError) as e:
                c.sync_adapter(tiny.root / name, "a", f"bad-{name}")
            failure = e.value.failures[tiny.target]
            assert (failure.code, failure.reason) == expected, (name, failure)
            assert MARKER not in failure.message
            assert tiny.listed() == []
        c.sync_adapter(tiny.root / "good", "a", "v1")
    assert probe.calls > 0 and probe.slowest < 1.0
    assert tiny.listed() == [("a", "v1")]
