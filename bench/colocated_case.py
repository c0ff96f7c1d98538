"""The colocated case of the benchmarks: the shared-memory transport against the broadcast, on one host.

Per configuration (SmolLM2-135M's shapes in float32, 538 MB, and the synthetic ``1gb`` model in bf16;
staged and streaming apply) one engine process (:mod:`bench.engine`: the
:class:`~wsync_grpc.engines.tensor.TensorEngine` of ``wsync serve --synthetic``, plus the raw-broadcast
routes) and the trainer (this process). After a warm-up (every way twice), each round runs back to
back on the same processes, the ways after the ceiling in a rotated order, each way's measured sync right after an
unmeasured one of its own (a trainer syncs one way every step, and the engine's receive buffers are what that way
leaves: a staged sync through shared memory copies each tensor into a buffer of its own that the engine then
serves, a broadcast receives whole buckets; a sync right after another way's would pay to reshape them):

- ``ceiling``: one raw gloo broadcast of the model's bytes over loopback into a reused, touched
  buffer (:meth:`bench.run.Session.raw`): the old "physical limit" of this host's network path;
- ``broadcast``: :meth:`~wsync_grpc.trainer.client.TrainerClient.sync` by broadcast (the default);
- ``shm``: the same sync with ``transport="shared_memory"``: the trainer packs each bucket into a ring
  of two slots of a memfd, the engine copies it out;
- ``shm_shared``: the same, the trainer's tensors already in shared memory (``share_memory_()`` of a
  copy of the model, as ``Module.share_memory()`` does): the transport's zero-copy path, the engine reading
  every bucket straight from the trainer's storages (``os.preadv``, never mapped; nothing packed: each
  sync's ``storage_buckets`` and ``packed_buckets`` are recorded), what the target of "one copy in all" asks;
- ``broadcast_digests`` and ``shm_digests``: the two syncs with bucket digests, the client's default
  on CPU (the other syncs run without, as the other cases' do);
- ``one_copy``: not a sync: the bytes copied once out of a memfd mapped read-only for the copy into
  touched memory, in this process: the bound of a copy through a mapping (the zero-copy path reads with
  ``pread`` instead, which a storage its owner truncates cannot crash, at a kernel copy's speed).

The engine's memory: the peak extra resident memory of the engine process during a sync (``VmHWM``
reset through ``/proc/PID/clear_refs`` before it), with its anonymous (its own buffers) and shared (the
ring mapped) resident memory sampled by a thread of this process, against the ring's bytes (two slots):
for the engine's first sync (a fresh process, its receive-buffer pool empty: streaming, by shared
memory, before anything else), then, per mode after the rounds, two steady syncs of each transport.

Last, if ``vllm_rounds``: one vLLM engine (``wsync serve --engine vllm``, SmolLM2-135M-Instruct,
538 MB in float32), staged syncs by broadcast and by shared memory alternated (two weight versions),
Prepare to applied (:attr:`~wsync_grpc.trainer.results.SyncResult.total_seconds`). A shared-memory
sync that fails there is recorded and the rest skipped.

Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wsync_grpc.core.planning import plan_buckets
from wsync_grpc.transports import shared_memory
from wsync_grpc.transports.shared_memory.handover import page_round
from wsync_grpc.transports.shared_memory.sender import SLOTS, SharedMemorySender
from wsync_grpc.transports.shared_memory.storages import SendCounts

if TYPE_CHECKING:
    from bench.run import Harness, Session

CONFIGS = (("smollm2-shapes", "float32"), ("1gb", "bfloat16"))
"""(synthetic preset, dtype) of each configuration."""
MODES = ("staged", "streaming")
SYNC_WAYS = ("broadcast", "shm", "shm_shared", "broadcast_digests", "shm_digests")
"""The syncs of a round (rotated after the ceiling); ``one_copy`` runs last."""
SAMPLE_S = 0.002
"""How often the memory sampler reads the engine's ``/proc/PID/status``, in seconds."""
VLLM_WAYS = ("broadcast", "shm", "broadcast_nodigests", "shm_nodigests")
"""The vLLM syncs of a round: by broadcast and by shared memory, with the client's default digests and without."""


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _status(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile``, ``RssShmem``, ``VmHWM`` of ``pid``, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class MemorySampler:
    """The peak of the engine's anonymous and shared resident memory while in a ``with`` block (bytes)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: dict[str, int] = {}
        self.before = _status(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-mem", daemon=True)

    def _run(self) -> None:
        while True:
            for k, v in _status(self.pid).items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            if self._stop.wait(SAMPLE_S):
                break

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def extra(self) -> dict[str, int]:
        """Peak minus before, per field (``RssAnon``: the engine's own buffers; ``RssShmem``: the ring mapped)."""
        return {k: self.peak.get(k, 0) - self.before.get(k, 0) for k in ("VmRSS", "RssAnon", "RssShmem")}


def _shared_copy(s: Session) -> dict[str, torch.Tensor]:
    """The trainer's tensors again, as views of one copy of its flat buffer moved to shared memory."""
    flat = s.model.flat
    assert flat is not None
    shared = flat.clone().share_memory_()  # type: ignore[no-untyped-call]
    base = flat.data_ptr()
    out = {}
    for name, t in s.model.tensors.items():
        off = t.data_ptr() - base
        out[name] = shared[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out


class OneCopy:
    """The model's bytes in a memfd; :meth:`run` maps it read-only, copies it into touched memory and unmaps."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.nbytes = flat.numel()
        self.fd = os.memfd_create("wsync-bench-one-copy", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        with mmap.mmap(self.fd, self.nbytes) as m:
            torch.frombuffer(m, dtype=torch.uint8).copy_(flat)
        self.dst = torch.zeros(self.nbytes, dtype=torch.uint8)

    def run(self) -> float:
        t0 = time.monotonic()
        with mmap.mmap(self.fd, self.nbytes, prot=mmap.PROT_READ) as m:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
                src = torch.frombuffer(m, dtype=torch.uint8)
            self.dst.copy_(src)
            del src
        return time.monotonic() - t0

    def close(self) -> None:
        os.close(self.fd)


def _sync(
    s: Session,
    mode: str,
    transport: str,
    *,
    tensors: dict[str, torch.Tensor] | None = None,
    digests: bool = False,
    mem: bool = False,
) -> dict[str, Any]:
    """One :meth:`TrainerClient.sync`: wall seconds, its phases, CPU seconds (trainer and engine) and, with
    ``mem``, the engine's peak extra memory."""
    before = s.mem_reset(False) if mem else 0
    s.client.digests = digests
    s.version += 1
    sampler = MemorySampler(s.engines[0].pid) if mem else None
    with sampler or contextlib.nullcontext():
        c0 = s.cpu()
        t0 = time.monotonic()
        r = s.client.sync(
            (tensors or s.model.tensors).items(),
            f"bench-colocated-{s.version}",
            apply_mode=mode,  # type: ignore[arg-type]
            transport=transport,  # type: ignore[arg-type]
        )
        wall = time.monotonic() - t0
        cpu = s.cpu() - c0
    s.client.digests = False
    out: dict[str, Any] = {
        "seconds": wall,
        "cpu": cpu,
        "prepare": r.prepare_seconds,
        "broadcast": r.broadcast_seconds,
        "pack": r.pack_seconds,
        "complete": r.complete_seconds,
        "verify": r.verify_seconds,
        "apply": max(e.apply_seconds for e in r.engines.values()),
        "buckets": r.bucket_count,
        "payload": r.payload_bytes,
    }
    if transport == "shared_memory":  # what the sender did with the buckets: packed, or read from the storages
        counts = _shm_counts(s)
        out["packed_buckets"], out["storage_buckets"] = counts.packed_buckets, counts.storage_buckets
    if mem:
        out.update(s.mem_after(before))
        assert sampler is not None
        out["sampled"] = sampler.extra()
    return out


def _shm_counts(s: Session) -> SendCounts:
    """The client's shared-memory sender's counts of its last send."""
    sender = s.client._senders.of(shared_memory.PART)
    assert isinstance(sender, SharedMemorySender)
    return sender.last_send


def _config(h: Harness, model: str, dtype: str, reps: int) -> dict[str, Any]:
    from bench.run import session

    _say(f"colocated {model} ({dtype}): starting one engine")
    with session(h, model, dtype=dtype) as s:
        assert s.model.flat is not None
        shared = _shared_copy(s)
        one = OneCopy(s.model.flat)
        try:
            ways: dict[str, Callable[[str], dict[str, Any]]] = {
                "broadcast": lambda mode: _sync(s, mode, "broadcast"),
                "shm": lambda mode: _sync(s, mode, "shared_memory"),
                "shm_shared": lambda mode: _sync(s, mode, "shared_memory", tensors=shared),
                "broadcast_digests": lambda mode: _sync(s, mode, "broadcast", digests=True),
                "shm_digests": lambda mode: _sync(s, mode, "shared_memory", digests=True),
            }
            buckets = plan_buckets(
                s.model.tensors.items(),
                s.client.bucket_bytes,
                ramp_bytes=s.client.ramp_bytes,
                solo_bytes=s.client.solo_bytes,
            )
            largest = max(b.size_bytes for b in buckets)
            res: dict[str, Any] = {
                "model": model,
                "dtype": dtype,
                "bytes": s.model.nbytes,
                "tensors": len(s.model.tensors),
                "buckets": len(buckets),
                "largest_bucket": largest,
                "ring_bytes": SLOTS * page_round(largest),
                "first": {},
                "rounds": {},
                "memory": {},
            }
            res["first_ceiling"] = s.raw()
            res["first_one_copy"] = one.run()
            # The engine's first sync, a fresh process (its receive-buffer pool empty): streaming, by shared memory.
            res["memory_first"] = _sync(s, "streaming", "shared_memory", mem=True)
            _say(f"  first sync, streaming by shared memory: engine {_mem_line(res['memory_first'])}")
            for mode in MODES:
                first = {way: fn(mode) for way, fn in ways.items()}  # the first of each way in this mode
                res["first"][mode] = first
                for fn in ways.values():  # and a second: the steady state (see bench.run._steady)
                    fn(mode)
                rounds = []
                order = list(SYNC_WAYS)
                for i in range(reps):
                    r: dict[str, Any] = {"ceiling": s.raw(), "ceiling_cpu": s.last_raw_cpu}
                    rotated = order[i % len(order) :] + order[: i % len(order)]
                    for way in rotated:
                        ways[way](mode)  # unmeasured: the engine's buffers as this way leaves them (module doc)
                        r[way] = ways[way](mode)
                    r["one_copy"] = one.run()
                    rounds.append(r)
                    _say(
                        f"  {model} {mode}: ceiling {r['ceiling']:.3f} s, broadcast {r['broadcast']['seconds']:.3f} s,"
                        f" shm {r['shm']['seconds']:.3f} s (shared {r['shm_shared']['seconds']:.3f} s, "
                        f"{r['shm_shared']['storage_buckets']} of {r['shm_shared']['buckets']} buckets zero-copy), "
                        "digests "
                        f"{r['broadcast_digests']['seconds']:.3f} / {r['shm_digests']['seconds']:.3f} s, "
                        f"one copy {r['one_copy']:.3f} s"
                    )
                res["rounds"][mode] = rounds
                res["memory"][mode] = _memory(s, mode)
            s.client.digests = True  # the last sync of the case by shared memory, each bucket's digest checked
            _sync(s, "staged", "shared_memory", digests=True)
            res["verified"] = s.verify()
            return res
        finally:
            one.close()


def _mem_line(r: dict[str, Any]) -> str:
    m = r["sampled"]
    return (
        f"+{r['peak_extra'] / 2**20:.0f} MiB at peak (its own +{m['RssAnon'] / 2**20:.0f} MiB, "
        f"the ring mapped +{m['RssShmem'] / 2**20:.0f} MiB)"
    )


def _memory(s: Session, mode: str) -> dict[str, Any]:
    """The engine's peak extra memory in two steady syncs of each transport."""
    out: dict[str, Any] = {}
    for transport, key in (("shared_memory", "shm"), ("broadcast", "broadcast")):
        _sync(s, mode, transport)  # back in this transport's steady state
        out[key] = [_sync(s, mode, transport, mem=True) for _ in range(2)]
        _say(f"  memory, {mode}, {key}: engine {_mem_line(max(out[key], key=lambda r: r['peak_extra']))}")
    return out


# ----------------------------------------------------------------------------- vLLM


@contextlib.contextmanager
def _vllm_engine(model_dir: Path) -> Iterator[Any]:
    from wsync_grpc.testing import free_port
    from wsync_grpc.testing_vllm import spawn_vllm_engine

    with tempfile.TemporaryDirectory(prefix="wsync-bench-colocated-vllm-") as tmp:
        proc = spawn_vllm_engine(model_dir, port_file=Path(tmp) / "port", http_port=free_port(), log=Path(tmp) / "log")
        try:
            yield proc
        finally:
            proc.stop(grace_s=30)


def case_vllm_colocated(rounds: int) -> dict[str, Any]:
    """A vLLM engine: ``rounds`` rounds of staged syncs (:data:`VLLM_WAYS`, rotated) after a warm-up round."""
    from safetensors.torch import load_file

    from wsync_grpc.engines.models import ensure_smollm2_dir
    from wsync_grpc.trainer import TrainerClient

    model_dir = ensure_smollm2_dir()
    state = load_file(str(model_dir / "model.safetensors"))
    versions = [state, {n: t + 0.02 * t.std() * torch.randn_like(t) if t.dim() == 2 else t for n, t in state.items()}]
    out: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "rounds": [],
        "error": None,
    }
    t_start = time.monotonic()
    with _vllm_engine(model_dir) as proc, TrainerClient([proc.target], group_timeout_s=120) as c:
        out["start_seconds"] = time.monotonic() - t_start
        n = 0

        def sync(way: str) -> dict[str, Any]:
            nonlocal n
            n += 1
            transport = "shared_memory" if way.startswith("shm") else "broadcast"
            c.digests = not way.endswith("_nodigests")
            t0 = time.monotonic()
            r = c.sync(versions[n % 2].items(), f"colocated-{n}", apply_mode="staged", transport=transport)  # type: ignore[arg-type]
            return {
                "seconds": time.monotonic() - t0,
                "total": r.total_seconds,
                "prepare": r.prepare_seconds,
                "broadcast": r.broadcast_seconds,
                "complete": r.complete_seconds,
                "verify": r.verify_seconds,
                "apply": r.engines[proc.target].apply_seconds,
                "payload": r.payload_bytes,
            }

        try:
            for i in range(rounds + 1):  # round 0 warms up
                order = VLLM_WAYS[i % len(VLLM_WAYS) :] + VLLM_WAYS[: i % len(VLLM_WAYS)]
                r = {way: sync(way) for way in order}
                if not i:
                    out["first"] = r
                else:
                    out["rounds"].append(r)
                    _say(
                        f"  vLLM staged, Prepare to applied: broadcast {r['broadcast']['total']:.3f} s, "
                        f"shared memory {r['shm']['total']:.3f} s; without digests "
                        f"{r['broadcast_nodigests']['total']:.3f} / {r['shm_nodigests']['total']:.3f} s"
                    )
        except Exception as e:  # the shared-memory path into vLLM may not work yet: recorded, not fatal
            out["error"] = f"{type(e).__name__}: {e}"[:2000]
            _say(f"  vLLM over shared memory failed: {out['error'][:300]}")
    out["seconds"] = time.monotonic() - t_start
    return out


def case_colocated(h: Harness, reps: int, vllm_rounds: int) -> dict[str, Any]:
    """Every configuration of :data:`CONFIGS`, then the vLLM rounds (none if ``vllm_rounds`` is 0)."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"reps": reps, "configs": {}}
    for model, dtype in CONFIGS:
        out["configs"][model] = _config(h, model, dtype, reps)
    out["seconds_synthetic"] = time.monotonic() - t0
    if vllm_rounds:
        _say("colocated vLLM: starting one engine")
        out["vllm"] = case_vllm_colocated(vllm_rounds)
    return out


# ----------------------------------------------------------------------------- figures


def p95(xs: list[float]) -> float:
    """The 95th percentile of ``xs`` (linear between order statistics; the max for fewer than 2)."""
    if len(xs) < 2:
        return max(xs)
    return statistics.quantiles(xs, n=20, method="inclusive")[18]


def way_seconds(rounds: list[dict[str, Any]], way: str, key: str = "seconds") -> list[float]:
    """Seconds of ``way`` in every round (``key`` of a sync's record; the ceiling and one copy are plain)."""
    return [float(r[way] if way in ("ceiling", "one_copy") else r[way][key]) for r in rounds]


def speedup(rounds: list[dict[str, Any]], way: str, over: str = "ceiling") -> list[float]:
    """Per round: ``over``'s seconds / ``way``'s (how many times the throughput of ``over``)."""
    return [a / b for a, b in zip(way_seconds(rounds, over), way_seconds(rounds, way), strict=True)]
