"""Helpers shared by the trainer side (:mod:`bench.run`) and the engine side (:mod:`bench.engine`).

Sizes are in bytes, times in seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import http.client
import json
import math
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.synthetic import LlamaShape


def stop_processes(procs: list[subprocess.Popen[bytes]], signum: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Send ``signum`` to each of ``procs`` still running, wait up to ``grace`` seconds for each, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


SPEC_MODELS: dict[str, LlamaShape] = {
    # 32B-class dense: Qwen2.5-32B's dimensions (64 layers x 9 tensors + 3 = 579; its q/k/v biases left out).
    "dense-32b": LlamaShape(hidden=5120, intermediate=27648, layers=64, vocab=152064, heads=40, kv_heads=8),
    # Large MoE: Qwen3-235B-A22B's dimensions with 352 experts per layer instead of 128: 94 x (7 + 3 x 352) + 3.
    "moe-100k": LlamaShape(hidden=4096, intermediate=1536, layers=94, vocab=151936, heads=64, kv_heads=4, experts=352),
}
"""Models whose metadata the control-plane benchmark sends (served from ``meta`` tensors, no weights)."""


def model_shape(name: str) -> LlamaShape:
    """A :data:`wsync_grpc.engines.synthetic.PRESETS` preset or a :data:`SPEC_MODELS` entry, by name."""
    return SPEC_MODELS[name] if name in SPEC_MODELS else synthetic.PRESETS[name]


@dataclass
class FlatModel:
    """A model whose tensors are views into one contiguous ``uint8`` buffer.

    Attributes:
        flat: the buffer (``None`` for a ``meta`` model).
        tensors: name -> tensor (views of ``flat``), in model order.
        nbytes: sum of the tensors' sizes, in bytes (``flat``'s length).
    """

    flat: torch.Tensor | None
    tensors: dict[str, torch.Tensor]
    nbytes: int


def build_flat(
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    *,
    meta: bool = False,
    device: torch.device | str = "cpu",
) -> FlatModel:
    """Build model ``name`` (see :func:`model_shape`) as views into one flat buffer.

    The tensors sit back to back (every size is a multiple of the element
    size), so a raw broadcast of ``flat`` moves exactly the model's bytes and
    the ceiling needs no second copy of the model. Values are a seeded normal
    pattern tiled over each tensor, as :func:`wsync_grpc.engines.synthetic.build`
    does; ``meta=True`` builds ``meta`` tensors (shapes only, no memory).
    """
    shapes = synthetic.tensor_shapes(model_shape(name))
    esize = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(s) * esize for _, s in shapes)
    if meta:
        return FlatModel(None, {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes}, total)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for n, s in shapes:
        numel = math.prod(s)
        view = flat[offset : offset + numel * esize].view(dtype)
        pattern = torch.randn(min(4096, numel), generator=gen).to(dtype=dtype, device=device)
        full, rest = divmod(numel, pattern.numel())
        if full:
            view[: full * pattern.numel()].view(full, pattern.numel()).copy_(pattern.expand(full, -1))
        if rest:
            view[full * pattern.numel() :].copy_(pattern[:rest])
        tensors[n] = view.view(s)
        offset += numel * esize
    return FlatModel(flat, tensors, total)


def post_json(address: str, path: str, body: Any = None, timeout: float = 600.0) -> Any:
    """POST ``body`` as JSON to ``http://address/path`` on a fresh connection; return the decoded reply.

    ``body`` is JSON-encoded unless it already is ``bytes``.

    Raises:
        RuntimeError: a non-200 reply (its body is in the message).
    """
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body if body is not None else {}).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path} to {address}: HTTP {resp.status}: {payload[:2000]!r}")
        return json.loads(payload) if payload else None
    finally:
        conn.close()


def proc_memory(pid: int | str = "self") -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of a process, in bytes (Linux ``/proc``)."""
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def reset_peak_memory() -> int:
    """Return freed heap memory to the OS, reset this process's VmHWM to its RSS; return the RSS in bytes."""
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_memory()[0]


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no stray engines after a crash)."""
    if sys.platform != "linux":
        return
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        import signal

        ctypes.CDLL(libc_name).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def machine_info() -> dict[str, str]:
    """What the write-up records about the machine."""
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import grpc

    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "memory": f"{mem / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "torch threads": str(torch.get_num_threads()),
        "cuda": torch.version.cuda or "none",
    }


class RawGroup:
    """A plain torch process group, as SGLang's ``init_custom_process_group`` builds one.

    The baselines (ceiling and naive way) broadcast on it directly, with none
    of wsync's bookkeeping: a ``TCPStore`` served by rank 0, a
    ``PrefixStore``, and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
    (CUDA) over it, the same construction as :func:`wsync_grpc.group.process_group.join_group`.

    Attributes:
        device: where its collectives run.
        timeout_s: per-collective timeout, in seconds.
    """

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        group_name: str = "bench_baseline",
        timeout_s: float = 120.0,
    ) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore, TCPStore

        self.device = device
        self.timeout_s = timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        store = TCPStore(
            master_address,
            master_port,
            world_size if rank == 0 else None,
            rank == 0,
            timeout=self._timeout,
            wait_for_workers=False,
        )
        self._store = store
        prefix = PrefixStore(group_name, store)
        self._pg: Any
        if device.type == "cuda":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout
            self._pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            self.broadcast(torch.zeros(1, device=device)).wait()  # NCCL connects lazily
        else:
            self._pg = dist.ProcessGroupGloo(prefix, rank, world_size, self._timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Post a broadcast of ``tensor`` from rank ``src``; returns the ``Work`` (``.wait()`` it)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._timeout
        return self._pg.broadcast([tensor], opts)

    def destroy(self) -> None:
        """Drop the process group (NCCL: shut it down first)."""
        if self._pg is not None and self.device.type == "cuda":
            with contextlib.suppress(Exception):
                self._pg.shutdown()
        self._pg = None
