"""Helpers for tests, the demo and the bench that run vLLM engines (the ``vllm`` extra): stream from one.

- :class:`GenerateStream` streams one request from the engine's ``/inference/v1/generate`` on a
  thread and records when each chunk arrived and which weight versions produced it.

Starting a vLLM engine (:func:`~wsync_grpc.launch.spawn_vllm_engine`, ``wsync serve --engine vllm``
with the environment a small CPU host needs) is :mod:`wsync_grpc.launch`'s; this module re-exports
it and its settings under the same names.

Times are in seconds. Nothing here imports vLLM: the engine is a separate process.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from wsync_grpc.launch import VLLM_CPU_ENV, VLLM_CPU_TP_ENV, VLLM_TEST_ARGS, spawn_vllm_engine

__all__ = ["VLLM_CPU_ENV", "VLLM_CPU_TP_ENV", "VLLM_TEST_ARGS", "GenerateStream", "spawn_vllm_engine"]


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
