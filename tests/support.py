"""Shared helpers for the tests: in-process engines, the stub trainer process, short RPC helpers.

Engine processes, in-process servers, free ports and joining as the trainer come from
:mod:`wsync_grpc.testing`; the names re-exported here are the ones the tests import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import torch
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256s
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.server import WsyncServer
from wsync_grpc.testing import child_env, free_port, in_process_server, join_as_trainer
from wsync_grpc.trainer import TrainerClient

__all__ = [
    "ENV",
    "ROOT",
    "assert_serve",
    "build_tiny_llama",
    "code_of",
    "free_port",
    "join_as_trainer",
    "lease_credential",
    "run_stub_trainer",
    "served",
    "start_stub_trainer",
    "status",
    "tensor_server",
]

ROOT = Path(__file__).resolve().parent.parent
"""The repository root."""
ENV = child_env()
"""The environment for child processes: this one's, with ``PYTHONPATH`` for the package and ``generated/``."""

VLLM_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm")
"""How the ``/dev/shm`` names of vLLM's processes begin (its message queues, Python multiprocessing's semaphores,
its CPU communicator). A test counting wsync's own segments leaves them out (other jobs may run meanwhile); the
suite unlinks those that vLLM processes it SIGKILLed left (``tests/conftest.py``)."""


@contextmanager
def tensor_server(
    preset: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.bfloat16, checkpoint_roots: Sequence[str] = ()
) -> Iterator[tuple[WsyncServer, TensorEngine, weight_sync_pb2_grpc.WeightSyncServiceStub]]:
    """A real gRPC server on a loopback port serving a synthetic :class:`TensorEngine`."""
    engine = TensorEngine(synthetic.build(preset, seed=seed, dtype=dtype), aliases=synthetic.aliases(preset))
    with in_process_server(engine, checkpoint_roots=checkpoint_roots) as (srv, stub):
        yield srv, engine, stub


def _stub_trainer_cmd(target: str, port: int, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "stub_trainer.py"), "--target", target, "--port", str(port), *args]


def run_stub_trainer(target: str, port: int, *args: str, timeout: float = 120) -> dict[str, object]:
    """Run ``tests/stub_trainer.py`` to the end; return its last JSON line."""
    r = subprocess.run(_stub_trainer_cmd(target, port, args), capture_output=True, text=True, timeout=timeout, env=ENV)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"stub trainer printed nothing (rc {r.returncode}): {r.stderr[-3000:]}"
    result: dict[str, object] = json.loads(lines[-1])
    return result


def start_stub_trainer(target: str, port: int, *args: str) -> subprocess.Popen[str]:
    """Start ``tests/stub_trainer.py`` in the background."""
    return subprocess.Popen(
        _stub_trainer_cmd(target, port, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def status(stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> pb.GetStatusResponse:
    """GetStatus with a short deadline."""
    return stub.GetStatus(pb.GetStatusRequest(), timeout=10)


class StatusProbe:
    """Calls GetStatus in a loop on a thread of its own; records the slowest answer, in seconds."""

    def __init__(self, stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> None:
        self.stub, self.slowest, self.calls = stub, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            status(self.stub)
            self.slowest = max(self.slowest, time.monotonic() - t0)
            self.calls += 1
            self._stop.wait(0.02)

    def __enter__(self) -> StatusProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def lease_credential(stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> str:
    """The lease credential the caller of ``stub`` (an :func:`~wsync_grpc.testing.owner_channel`) holds, as the
    first message of a KeepAlive it opens echoes it (closing that call ends the lease's ttl at once, as the
    owner's last KeepAlive does; the owner's next call renews it)."""
    call = stub.KeepAlive(pb.KeepAliveRequest(), timeout=10)
    credential: str = next(call).lease_credential
    call.cancel()
    return credential


def code_of(e: grpc.RpcError) -> grpc.StatusCode:
    """The status code of a failed call."""
    code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
    return code


def train(model: Any, tokenizer: Any, steps: int, lr: float) -> None:
    """``steps`` real AdamW steps of next-token loss on one sentence, on ``model``'s trainable parameters.

    The trainer's side of an RL step: it teaches SmolLM2 that the capital of France is Lyon.
    """
    batch = tokenizer(["The capital of France is Lyon. The capital of France is Lyon."], return_tensors="pt")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(**batch, labels=batch["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def smollm2_lora(model_dir: Path, targets: Sequence[str], rank: int = 8, *, random_b: bool = False) -> Any:
    """SmolLM2-135M from ``model_dir`` (float32) under a PEFT LoRA adapter of ``rank`` (alpha 16, no dropout).

    ``random_b``: PEFT's ``init_lora_weights=False`` (``lora_B`` not zero), so that the adapter changes
    answers before any training.
    """
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=not random_b
    )
    return peft.get_peft_model(base, config)


def write_tls(directory: Path, *names: str) -> dict[str, Path]:
    """A test CA (``trustme``) and a server certificate for ``names`` signed by it, written as PEM files.

    Returns:
        ``{"ca": ..., "cert": ... (the chain), "key": ...}`` under ``directory``.
    """
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*names)
    paths = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    with paths["cert"].open("wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    return paths


def build_tiny_llama(vocab_size: int = 49152, seed: int = 0, tie: bool = True) -> Any:
    """A tiny random LlamaForCausalLM (hidden 64, 2 layers, context 512), identical for a given seed.

    Generating with ``model.generate`` on SmolLM2 chat prompts needs an explicit all-ones
    ``attention_mask``: pad and end-of-turn share id 2, so the default mask hides ``<|im_end|>``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.2,  # wide logits: varied greedy tokens, no near-ties between code paths
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    return model.eval()


def served(targets: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """target -> (weight version, name -> SHA-256), read by a client of its own."""
    with TrainerClient(targets, rpc_timeout_s=30) as reader:
        versions = {t: s.weight_version for t, s in reader.status().items()}
        sums = {t: {x.name: x.sha256 for x in c.checksums} for t, c in reader.checksums().items()}
    return {t: (versions[t], sums[t]) for t in targets}


def assert_serve(targets: list[str], version: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every engine of ``targets`` serves ``version`` with ``tensors`` bit for bit (by SHA-256)."""
    expected = dict(zip(tensors, tensor_sha256s(tensors.values()), strict=True))
    for target, (v, sums) in served(targets).items():
        assert v == version, (target, v)
        assert {n: sums[n] for n in expected} == expected, target


@contextmanager
def ray_cluster(head: dict[str, Any], nodes: int, node_cpus: int, store_bytes: int) -> Iterator[Any]:
    """A real local Ray cluster (``ray.cluster_utils.Cluster``, Ray's usage reporting off): a head started with
    ``head`` (its node arguments) and ``nodes`` more nodes of ``node_cpus`` CPUs and ``store_bytes`` of object store
    each (bytes), this process connected as its driver; shut down, driver first, at the end."""
    import pytest
    import ray
    from ray import cluster_utils  # the ray extra: imported by the tests that use it only

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        c = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
        try:
            for _ in range(nodes):
                c.add_node(num_cpus=node_cpus, object_store_memory=store_bytes)
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
            c.wait_for_nodes()
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
