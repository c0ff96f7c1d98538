"""LoRA adapters on a real vLLM engine: loaded from PEFT directories through vLLM's own LoRA support, named by
the OpenAI API's ``model`` field, replaced under the same name without ever answering with the old one.

A real vLLM engine (``wsync serve --engine vllm --vllm-args "... --enable-lora"``, the shared ``tp1-lora``
engine of ``shared_engines``) serving SmolLM2-135M; a trainer that trains a real PEFT LoRA adapter a few steps
and writes it with ``save_pretrained``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from shared_engines import Vllm, post
from support import code_of, smollm2_lora, train
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.testing import EngineProcess
from wsync_grpc.trainer import SyncError, TrainerClient
from wsync_grpc.wire.status import error_reason

pytest.importorskip("vllm", reason="the vllm extra is not installed")
pytest.importorskip("peft")

pytestmark = pytest.mark.vllm_engines("tp1-lora")

PROMPT = "The capital of France is"
OWNER = "vllm-lora-tests"
"""One owner for every test of the module's engine (a call without one would own it for a lease's ttl)."""


class LoraEngine:
    def __init__(self, proc: EngineProcess, http: str, root: Path) -> None:
        self.proc, self.http, self.root, self.target = proc, http, root, proc.target
        self.last_model = ""

    def complete(self, model: str, max_tokens: int = 12) -> dict[str, Any]:
        """A greedy completion through vLLM's OpenAI API, naming ``model`` (the base model or an adapter).

        Its ``model`` field (``name@version`` for an adapter) is kept in :attr:`last_model`.
        """
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
        out = post(f"{self.http}/v1/completions", body)
        self.last_model = str(out["model"])
        return out["choices"][0]

    def listed(self) -> list[tuple[str, str]]:
        with grpc.insecure_channel(self.target) as ch:
            r = weight_sync_pb2_grpc.WeightSyncServiceStub(ch).ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        assert r.supported
        return [(a.name, a.version) for a in r.adapters]


@pytest.fixture(scope="module")
def lora_engine(engine: Vllm) -> LoraEngine:
    """The shared LoRA engine, adapters saved under its own checkpoint root."""
    return LoraEngine(engine.proc, engine.http, engine.checkpoints)


@pytest.mark.timeout(900)
def test_an_adapter_is_named_by_the_openai_model_field_and_replaced_cleanly(
    lora_engine: LoraEngine, smollm2_dir: Path, smollm2_tokenizer: Any
) -> None:
    base_name = str(smollm2_dir)
    trainer = smollm2_lora(smollm2_dir, ["q_proj", "v_proj"])
    before = lora_engine.complete(base_name)
    train(trainer, smollm2_tokenizer, steps=3, lr=1e-2)
    trainer.save_pretrained(lora_engine.root / "v1")
    with TrainerClient([lora_engine.target], rpc_timeout_s=120, owner=OWNER) as c:
        r = c.sync_adapter(lora_engine.root / "v1", "lyon", "v1")
        assert r.tensor_count == 2 * 2 * 30
        v1 = lora_engine.complete("lyon")
        assert lora_engine.last_model == "lyon@v1"  # the answer names the adapter version that computed it
        assert v1["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
        assert lora_engine.complete(base_name) == before  # the base model answers as before
        train(trainer, smollm2_tokenizer, steps=3, lr=1e-2)
        trainer.save_pretrained(lora_engine.root / "v2")
        c.sync_adapter(lora_engine.root / "v2", "lyon", "v2")  # replaced under the same name
        c.sync_adapter(lora_engine.root / "v2", "fresh", "v2")  # the same weights, never loaded before
        replaced, fresh = lora_engine.complete("lyon"), lora_engine.complete("fresh")
        assert replaced == fresh, "the replaced adapter does not answer as the new one"
        assert replaced["logprobs"]["token_logprobs"] != v1["logprobs"]["token_logprobs"]
        assert lora_engine.listed() == [("fresh", "v2"), ("lyon", "v2")]
        # The live model (still v2's weights), its tensors broadcast to vLLM's workers over the group.
        live = c.sync_adapter(trainer, "lyon", "v2-live")
        assert live.tensor_count == 2 * 2 * 30 and live.bucket_count >= 1
        assert lora_engine.complete("lyon") == fresh, "the broadcast adapter does not answer as its saved copy"
        # The same tensors through shared memory (no group): read once by the front out of the trainer's segment.
        shm = c.sync_adapter(trainer, "lyon", "v2-shm", transport="shared_memory")
        assert shm.tensor_count == 2 * 2 * 30 and shm.init_seconds == 0
        assert lora_engine.complete("lyon") == fresh, "the shared-memory adapter does not answer as its saved copy"
        assert lora_engine.last_model == "lyon@v2-shm"
        train(trainer, smollm2_tokenizer, steps=2, lr=1e-2)
        c.sync_adapter(trainer, "lyon", "v3-live")
        v3 = lora_engine.complete("lyon")
        assert v3["logprobs"]["token_logprobs"] != fresh["logprobs"]["token_logprobs"]
        trainer.save_pretrained(lora_engine.root / "v3")
        c.sync_adapter(lora_engine.root / "v3", "fresh", "v3")
        assert lora_engine.complete("fresh") == v3, "the broadcast v3 does not answer as v3 read from disk"
        assert lora_engine.listed() == [("fresh", "v3"), ("lyon", "v3-live")]
        # Rank 16 > --max-lora-rank 8: refused at Prepare, the old adapter keeps serving.
        bad = smollm2_lora(smollm2_dir, ["q_proj"], rank=16, random_b=True)
        with pytest.raises(SyncError) as refused:
            c.sync_adapter(bad, "lyon", "v4-too-big")
        failure = refused.value.failures[lora_engine.target]
        assert (failure.code, failure.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_RANK_TOO_LARGE")
        assert lora_engine.complete("lyon") == v3
        assert lora_engine.listed() == [("fresh", "v3"), ("lyon", "v3-live")]
    with grpc.insecure_channel(lora_engine.target) as ch:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
        r2 = stub.UnloadAdapter(pb.UnloadAdapterRequest(name="lyon", owner=OWNER), timeout=60)
        assert (r2.was_loaded, r2.version) == (True, "v3-live")
        with pytest.raises(grpc.RpcError) as bad:
            header = pb.PrepareHeader(
                owner=OWNER,
                weight_version="x",
                transport=pb.TRANSPORT_DISK,
                checkpoint_path="/etc",
                adapter=pb.AdapterSpec(name="x"),
            )
            stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=60)
        assert (
            code_of(bad.value) == grpc.StatusCode.PERMISSION_DENIED and error_reason(bad.value) == "PATH_OUTSIDE_ROOTS"
        )
    assert lora_engine.listed() == [("fresh", "v3")]
    with pytest.raises(urllib.error.HTTPError) as gone:
        lora_engine.complete("lyon")
    assert gone.value.code == 404


class Stream:
    """A streamed greedy completion read on a thread of its own: every chunk's ``model`` and text, and how it ended."""

    def __init__(self, engine: LoraEngine, model: str, max_tokens: int) -> None:
        body = {
            "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True,
        }  # fmt: skip
        self.request = urllib.request.Request(
            f"{engine.http}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        self.chunks: list[dict[str, Any]] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with urllib.request.urlopen(self.request, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip().removeprefix("data: ")
                if line and line != "[DONE]":
                    self.chunks.append(json.loads(line))
                    if len(self.chunks) >= 4:
                        self.started.set()
        self.started.set()

    def finish(self) -> tuple[set[str], str | None, int]:
        """Wait for the end: the ``model`` of every chunk, the last finish reason, the tokens streamed."""
        self.thread.join(300)
        assert not self.thread.is_alive()
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks if c["choices"]]
        return {c["model"] for c in self.chunks}, reasons[-1] if reasons else None, len(reasons)


@pytest.mark.timeout(900)
def test_a_request_running_with_a_replaced_adapter_is_aborted_and_answers_name_their_version(
    lora_engine: LoraEngine, smollm2_dir: Path, smollm2_tokenizer: Any
) -> None:
    trainer = smollm2_lora(smollm2_dir, ["q_proj", "v_proj"])
    train(trainer, smollm2_tokenizer, steps=2, lr=1e-2)
    with TrainerClient([lora_engine.target], rpc_timeout_s=120, owner=OWNER) as c:
        c.sync_adapter(trainer, "running", "r1")
        lora_engine.complete("running")
        assert lora_engine.last_model == "running@r1"
        train(trainer, smollm2_tokenizer, steps=2, lr=1e-2)  # r2, before the long request starts
        long = Stream(lora_engine, "running", max_tokens=900)
        assert long.started.wait(120)
        c.sync_adapter(trainer, "running", "r2")  # replaced while the long request runs with r1
        models, reason, tokens = long.finish()
        assert models == {"running@r1"} and reason == "abort" and tokens < 900, (models, reason, tokens)
        after = lora_engine.complete("running")
        assert lora_engine.last_model == "running@r2"
        trainer.save_pretrained(lora_engine.root / "r2")
        c.sync_adapter(lora_engine.root / "r2", "r2-disk", "d")
        assert lora_engine.complete("r2-disk") == after and lora_engine.last_model == "r2-disk@d"
        again = Stream(lora_engine, "running", max_tokens=900)
        assert again.started.wait(120)
        # The owner's own call: the client's stub presents its lease credential.
        r = c.stubs[lora_engine.target].UnloadAdapter(pb.UnloadAdapterRequest(name="running", owner=OWNER), timeout=60)
        assert (r.was_loaded, r.version, r.aborted_requests) == (True, "r2", 1)
        models, reason, _ = again.finish()
        assert models == {"running@r2"} and reason == "abort"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("apply_mode", ["staged", "streaming"])
def test_a_base_update_with_lora_enabled_keeps_the_adapters_serving(
    lora_engine: LoraEngine, smollm2_dir: Path, apply_mode: str
) -> None:
    """vLLM wraps its linear layers for LoRA (``--enable-lora``): base weights still sync bit-exact under them."""
    from safetensors.torch import load_file
    from test_vllm_engine import assert_serves, perturbed

    base_name = str(smollm2_dir)
    originals = dict(load_file(str(smollm2_dir / "model.safetensors")))
    adapter = smollm2_lora(smollm2_dir, ["q_proj", "o_proj"], random_b=True)
    with TrainerClient([lora_engine.target], rpc_timeout_s=120, group_timeout_s=60, owner=OWNER) as c:
        c.sync_adapter(adapter, f"kept-{apply_mode}", "a1")
        base_before, with_adapter = lora_engine.complete(base_name), lora_engine.complete(f"kept-{apply_mode}")
        new = perturbed(originals, seed=7)
        c.sync(new.items(), f"base-{apply_mode}", apply_mode=apply_mode, flush_cache=True)  # type: ignore[arg-type]
        assert_serves(c, lora_engine.target, new, f"base-{apply_mode}", whole=apply_mode == "staged")
        assert lora_engine.complete(base_name) != base_before
        moved = lora_engine.complete(f"kept-{apply_mode}")
        assert (
            lora_engine.last_model == f"kept-{apply_mode}@a1" and moved != with_adapter
        )  # the adapter on the new base
        c.sync(originals.items(), "base-0", apply_mode=apply_mode, flush_cache=True)  # type: ignore[arg-type]
        assert_serves(c, lora_engine.target, originals, "base-0")
        assert lora_engine.complete(base_name) == base_before
        assert lora_engine.complete(f"kept-{apply_mode}") == with_adapter
