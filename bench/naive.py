"""The naive way, as RL frameworks drive SGLang today: the baseline wsync is compared against.

Metadata travels as JSON over HTTP (SGLang's ``/update_weights_from_distributed``
body: ``names``, ``dtypes``, ``shapes``), one request per bucket of about
``bucket_bytes`` (:data:`NAIVE_BUCKET_BYTES`, 512 MiB, the size RL frameworks
commonly use); bytes travel as one broadcast per tensor. On the engine,
each request allocates a fresh tensor per name, posts every receive, waits
for all of them, then loads them into the model (SGLang's
``ModelRunner.update_weights_from_distributed``). The trainer sends the
request from a helper thread, broadcasts every tensor of the bucket, and waits
for the reply before the next bucket (the engine applies one request at a
time).

It shares nothing with wsync's sender or receiver: it broadcasts on a plain
torch process group (:class:`bench.common.RawGroup`) and waits on each
``Work`` as SGLang does.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from bench.common import RawGroup, post_json
from wsync_grpc.core.dtypes import dtype_name, parse_dtype
from wsync_grpc.core.engine import Engine

NAIVE_BUCKET_BYTES = 512 * 1024 * 1024
"""Tensors per HTTP request of the naive way: up to this many bytes (512 MiB)."""

# ----------------------------------------------------------------------------- engine side


def receive_and_load(
    engine: Engine,
    group: RawGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
) -> int:
    """One ``/update_weights_from_distributed`` request: receive every tensor, then load them; return the count."""
    weights: list[tuple[str, torch.Tensor]] = []
    works = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        w = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=group.device)
        works.append(group.broadcast(w))
        weights.append((name, w))
    for work in works:
        work.wait()
    aliases = engine.aliases()
    with engine.weights_lock():
        return engine.load_weights(0, [(aliases.get(n, n), w) for n, w in weights])


# ----------------------------------------------------------------------------- trainer side


@dataclass(frozen=True)
class NaiveResult:
    """One naive sync.

    Attributes:
        seconds: first request sent to the last reply, in seconds.
        requests: HTTP requests per engine.
        broadcasts: collectives issued (one per tensor).
        payload_bytes: bytes of weights sent, in bytes.
        json_bytes: JSON bodies sent to one engine, in bytes.
    """

    seconds: float
    requests: int
    broadcasts: int
    payload_bytes: int
    json_bytes: int


def naive_sync(
    engines: Sequence[str],
    group: RawGroup,
    tensors: Mapping[str, torch.Tensor],
    bucket_bytes: int = NAIVE_BUCKET_BYTES,
) -> NaiveResult:
    """Push ``tensors`` to every engine (HTTP addresses) the naive way; see the module docstring."""
    start = time.monotonic()
    batches: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if batches[-1] and size + n > bucket_bytes:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += n
    json_bytes = 0
    payload = 0
    broadcasts = 0
    with concurrent.futures.ThreadPoolExecutor(len(engines), thread_name_prefix="naive-http") as pool:
        for batch in batches:
            body = {
                "names": batch,
                "dtypes": [dtype_name(tensors[n].dtype) for n in batch],
                "shapes": [list(tensors[n].shape) for n in batch],
                "group_name": "bench_baseline",
            }
            data = json.dumps(body).encode()
            json_bytes += len(data)
            replies = [pool.submit(post_json, e, "/update_weights_from_distributed", data) for e in engines]
            works = []
            for name in batch:
                t = tensors[name].detach().contiguous()
                works.append(group.broadcast(t))
                payload += t.numel() * t.element_size()
            for w in works:
                w.wait()
            broadcasts += len(works)
            for r in replies:
                r.result()
    return NaiveResult(time.monotonic() - start, len(batches), broadcasts, payload, json_bytes)
