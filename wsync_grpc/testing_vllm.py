"""Helpers for tests, the demo and the bench that run vLLM engines (the ``vllm`` extra): start one, stream from it.

- :func:`spawn_vllm_engine` starts ``wsync serve --engine vllm`` with the environment a small
  CPU host needs and waits until both its ports serve (:func:`wsync_grpc.testing.spawn_engine`).
- :class:`GenerateStream` streams one request from the engine's ``/inference/v1/generate`` on a
  thread and records when each chunk arrived and which weight versions produced it.

Times are in seconds. Nothing here imports vLLM: the engine is a separate process.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wsync_grpc.testing import EngineProcess, child_env, spawn_engine

__all__ = ["VLLM_CPU_ENV", "VLLM_CPU_TP_ENV", "VLLM_TEST_ARGS", "GenerateStream", "spawn_vllm_engine"]


VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""Environment a vLLM engine needs on a small CPU host: 1 GiB of KV cache (enough for SmolLM2-135M)."""

VLLM_CPU_TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""Added for tensor parallel workers on a host with fewer cores than workers (no core pinning, one thread each)."""

VLLM_TEST_ARGS = "--enforce-eager --max-model-len 1024"
"""vLLM arguments for tests, demo and bench: no torch.compile warm-up (a minute on a cold CPU host)."""


def spawn_vllm_engine(
    model_dir: Path,
    *,
    port_file: Path,
    http_port: int,
    tensor_parallel_size: int = 1,
    vllm_args: str = VLLM_TEST_ARGS,
    env: Mapping[str, str] | None = None,
    log: Path | int | None = None,
    timeout_s: float = 300.0,
    wait: bool = True,
    name: str | None = None,
    extra_args: Sequence[str] = (),
) -> EngineProcess:
    """Start ``wsync serve --engine vllm`` on ``model_dir`` (gRPC on a free port, HTTP on ``http_port``).

    ``extra_args`` go to ``wsync serve`` (e.g. ``["--checkpoint-root", DIR]``).

    Needs the ``vllm`` extra. The environment is :func:`child_env` plus
    :data:`VLLM_CPU_ENV` (and :data:`VLLM_CPU_TP_ENV` for more than one
    worker), then ``env``. Stop it with :meth:`EngineProcess.stop`: vLLM's
    engine core and worker processes end with it. Errors are :func:`spawn_process`'s.
    """
    extra = dict(VLLM_CPU_ENV)
    if tensor_parallel_size > 1:
        extra.update(VLLM_CPU_TP_ENV)
    extra.update(env or {})
    args = [
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--http-port",
        str(http_port),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--vllm-args",
        vllm_args,
        *extra_args,
    ]
    return spawn_engine(
        args, port_file=port_file, log=log, env=child_env(extra), timeout_s=timeout_s, wait=wait, name=name
    )


class GenerateStream(threading.Thread):
    """One greedy request streaming from a vLLM engine's ``/inference/v1/generate`` (``ignore_eos``), on a thread.

    Args:
        http: the engine's HTTP base URL (``http://host:port``).
        model: the served model's name.
        token_ids: the prompt's token ids.
        max_tokens: tokens to generate.

    Attributes:
        arrivals: when each chunk of tokens arrived, on the monotonic clock (seconds).
        versions: the final chunk's ``weight_versions`` (``[{"version", "start", "end"}, ...]``: which
            weight version produced which output tokens); empty until it arrived.
    """

    def __init__(self, http: str, model: str, token_ids: Sequence[int], max_tokens: int) -> None:
        super().__init__(name="generate-stream", daemon=True)
        self.http, self.model, self.token_ids, self.max_tokens = http, model, list(token_ids), max_tokens
        self.arrivals: list[float] = []
        self.versions: list[dict[str, Any]] = []

    def run(self) -> None:
        body = {
            "model": self.model,
            "token_ids": self.token_ids,
            "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        req = urllib.request.Request(
            f"{self.http}/inference/v1/generate",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices", []):
                    self.arrivals.append(time.monotonic())
                    if choice.get("weight_versions"):
                        self.versions = list(choice["weight_versions"])

    def wait_tokens(self, n: int, timeout_s: float = 120.0) -> None:
        """Wait until ``n`` chunks arrived, at most ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while len(self.arrivals) < n and time.monotonic() < deadline:
            time.sleep(0.01)
