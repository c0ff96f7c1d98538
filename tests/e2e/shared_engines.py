"""The vLLM engines the e2e modules share, and the state each is handed over in.

Starting a vLLM engine costs 20-30 s of a 2-core host (a tensor-parallel one more), so the suite starts
each kind once and hands it from module to module (``tests/e2e/conftest.py`` holds the fixtures). Which
engine covers what:

===============  ==============  ========================================  =====================================
engine           layers          flags (all: ``VLLM_TEST_ARGS``)           modules
===============  ==============  ========================================  =====================================
``tp1``          plain           TRL's ``--logprobs-mode                   ``test_vllm_engine``, ``test_trl_grpo``
                                 processed_logprobs`` and
                                 ``VLLM_SERVER_DEV_MODE=1``
``tp1-lora``     LoRA-wrapped    ``--enable-lora --max-lora-rank 8         ``test_vllm_lora``
                                 --max-loras 2``
``tp3``          plain, 3 ranks  ``--tensor-parallel-size 3``              ``test_vllm_tensor_parallel``
``tp3-lora``     LoRA-wrapped,   ``--tensor-parallel-size 3 --enable-lora  ``test_vllm_tensor_parallel``
                 3 ranks         --max-lora-rank 8``
===============  ==============  ========================================  =====================================

Every engine has two checkpoint roots: a scratch directory of its own (:attr:`Vllm.checkpoints`, where
tests save checkpoints and adapters) and the model's own directory, from which :func:`hand_over`
restores the checkpoint's weights by a disk update (no group to form, no tensor loaded in the test).

The known state a module receives an engine in (:func:`hand_over`): no owner and no group (the
lifecycle ``UNINITIALIZED``), serving (not paused), clean, and serving the checkpoint's weights as
weight version :data:`CHECKPOINT_VERSION` (or, freshly started, the version vLLM loaded them as).
Adapters a module loaded stay loaded: each LoRA engine has one module.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.testing import EngineProcess
from wsync_grpc.testing_vllm import VLLM_TEST_ARGS
from wsync_grpc.trainer import TrainerClient

PROMPT = "The capital of France is"
CHECKPOINT_VERSION = "checkpoint"
"""The weight version an engine serves the checkpoint's own weights as, once a module has changed them."""


@dataclass(frozen=True)
class VllmSpec:
    """How one shared engine is started: ``wsync serve --engine vllm`` with these settings.

    Attributes:
        tensor_parallel_size: vLLM's ``--tensor-parallel-size`` (its worker processes).
        vllm_args: the whole ``--vllm-args`` string (with ``--enable-lora``, vLLM wraps every linear layer).
        env: variables set for the engine on top of :func:`~wsync_grpc.testing_vllm.spawn_vllm_engine`'s.
    """

    tensor_parallel_size: int
    vllm_args: str
    env: tuple[tuple[str, str], ...] = ()


LORA_ARGS = "--enable-lora --max-lora-rank 8"
SPECS: dict[str, VllmSpec] = {
    # TRL's GRPOTrainer asks for processed log-probabilities and uses vLLM's development routes.
    "tp1": VllmSpec(1, f"{VLLM_TEST_ARGS} --logprobs-mode processed_logprobs", (("VLLM_SERVER_DEV_MODE", "1"),)),
    "tp1-lora": VllmSpec(1, f"{VLLM_TEST_ARGS} {LORA_ARGS} --max-loras 2"),
    "tp3": VllmSpec(3, VLLM_TEST_ARGS),
    "tp3-lora": VllmSpec(3, f"{VLLM_TEST_ARGS} {LORA_ARGS}"),
}
"""The shared engines by name (the ids of the ``vllm`` fixture's parameter)."""


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url``; the JSON reply."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


class Vllm:
    """A running ``wsync serve --engine vllm``: its process, gRPC target, HTTP base URL and model name.

    Attributes:
        name: its key in :data:`SPECS`.
        spec: how it was started.
        proc: the engine's process (vLLM's engine core and workers run below it).
        http: the base URL of vLLM's OpenAI-compatible API.
        model: the served model's name (the model directory) for the OpenAI ``model`` field.
        model_dir: the checkpoint directory the engine was started from (a checkpoint root).
        checkpoints: a scratch checkpoint root of this engine's own.
        target: the gRPC ``host:port``.
        initial_version: the weight version the engine reported when it started.
    """

    def __init__(
        self, name: str, spec: VllmSpec, proc: EngineProcess, http: str, model_dir: Path, checkpoints: Path
    ) -> None:
        self.name, self.spec, self.proc, self.http = name, spec, proc, http
        self.model_dir, self.checkpoints = model_dir, checkpoints
        self.model = str(model_dir)
        self.target = proc.target
        self.initial_version = self.status().weight_version

    def complete(self, prompt: str = PROMPT, max_tokens: int = 16) -> tuple[str, list[float]]:
        """Greedy completion through vLLM's OpenAI API: its text and each token's log probability (nats)."""
        out = post(
            f"{self.http}/v1/completions",
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1},
        )
        choice = out["choices"][0]
        return choice["text"], list(choice["logprobs"]["token_logprobs"])

    def status(self) -> pb.GetStatusResponse:
        """GetStatus (30 s deadline)."""
        with grpc.insecure_channel(self.target) as ch:
            resp: pb.GetStatusResponse = weight_sync_pb2_grpc.WeightSyncServiceStub(ch).GetStatus(
                pb.GetStatusRequest(), timeout=30
            )
            return resp


def serves_checkpoint(engine: Vllm, status: pb.GetStatusResponse) -> bool:
    """Whether ``status`` says ``engine`` serves the checkpoint's weights, whole (not dirty)."""
    return not status.dirty and status.weight_version in (CHECKPOINT_VERSION, engine.initial_version)


def in_known_state(engine: Vllm, status: pb.GetStatusResponse) -> bool:
    """Whether ``status`` is the state a module receives ``engine`` in (see the module's docstring)."""
    return (
        status.state == pb.LIFECYCLE_STATE_UNINITIALIZED
        and not status.HasField("owner")
        and not status.paused
        and serves_checkpoint(engine, status)
    )


def hand_over(engine: Vllm) -> pb.GetStatusResponse:
    """Bring ``engine`` to the known state, doing only what its status says is needed; its status then.

    An owner or group left behind is forced out (``Leave(force=True)``, an operator's call), a pause
    is lifted (``Resume(force=True)``), and weights other than the checkpoint's (another version, or
    dirty) are replaced by a staged disk update from :attr:`Vllm.model_dir` as
    :data:`CHECKPOINT_VERSION`, flushing vLLM's prefix cache.

    Raises:
        AssertionError: the engine did not reach the known state.
        grpc.RpcError: a call failed.
        wsync_grpc.trainer.SyncError: the disk update failed.
    """
    status = engine.status()
    with grpc.insecure_channel(engine.target) as ch:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
        if status.state != pb.LIFECYCLE_STATE_UNINITIALIZED or status.HasField("owner"):
            stub.Leave(pb.LeaveRequest(owner="e2e-hand-over", force=True), timeout=120)
        if status.paused:
            stub.Resume(pb.ResumeRequest(force=True), timeout=120)
    if not serves_checkpoint(engine, status):
        with TrainerClient([engine.target], rpc_timeout_s=300, owner="e2e-hand-over") as c:
            c.sync_from_disk(engine.model_dir, CHECKPOINT_VERSION, flush_cache=True)
    status = engine.status()
    assert in_known_state(engine, status), status
    return status


def sample(state: dict[str, torch.Tensor], also: tuple[str, ...] = ()) -> list[str]:
    """The tensors of the first and the last decoder layer (every part of the fused ``qkv_proj`` and ``gate_up_proj``,
    ``o_proj``, ``down_proj``, both norms) and the final norm, then ``also``."""
    last = max(int(n.split(".")[2]) for n in state if n.startswith("model.layers."))
    layers = ("model.layers.0.", f"model.layers.{last}.", "model.norm.")
    return list(dict.fromkeys([n for n in state if n.startswith(layers)] + list(also)))
