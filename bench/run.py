"""The wsync benchmark suite: ``make bench`` (``python -m bench.run``).

This process is the trainer (rank 0 of every group). It starts engine
processes (:mod:`bench.engine`), and for each case measures side by side, in
interleaved repetitions on the same processes:

- the ceiling: one raw ``broadcast`` of the model's bytes as one flat
  ``uint8`` tensor, received into a reused, already touched buffer;
- wsync end to end: :meth:`wsync_grpc.trainer.client.TrainerClient.sync`, Prepare
  through Complete, streaming and staged apply;
- the naive way (:mod:`bench.naive`): JSON over HTTP, one broadcast per tensor;

plus the control-plane cost (Prepare of 579 and ~100k tensors, protobuf
stream vs one JSON body), fan-out to 1-3 engines, the engine's peak extra
memory and a bucket-size sweep. The cases (``--cases``): ``models``, ``moe``,
``fanout``, ``control``, ``fleet`` (:mod:`bench.fleet_case`: 1 to 32 engines
serving a tiny model; how group formation, Prepare, Complete, the trainer's
threads and CPU grow with the fleet, and what a dead engine left out costs),
``disk`` (:mod:`bench.disk_case`), ``digests`` (:mod:`bench.digest_case`: the
cost of bucket digests), ``sharded`` (:mod:`bench.sharded_case`),
``detection`` (:mod:`bench.detection_case`: trainer processes SIGKILLed
mid-broadcast, and how long the engine takes to report it),
``profile``, ``vllm`` (:mod:`bench.vllm_case`), ``vllm_tail``
(:mod:`bench.vllm_tail_case`: 31 staged syncs per configuration into a
serving vLLM engine, the tail of sync time and token gaps) and ``colocated``
(:mod:`bench.colocated_case`: the shared-memory transport against the raw
broadcast and wsync's broadcast on the same host) and ``delta`` (:mod:`bench.delta_case`: SmolLM2
trained with AdamW at three learning rates, each step synced as a delta and whole, side by side) and ``ray``
(:mod:`bench.ray_case`: a fleet launched as Ray actors against the same fleet launched directly). One case alone:
``python -m bench.run --cases vllm_tail --merge``. It writes ``BENCHMARKS.md``,
``bench/throughput.png``, ``bench/buckets.png``, ``bench/fleet.png``,
``bench/vllm_tail.png``, ``bench/colocated.png`` and ``bench/results.json``; with ``--merge`` the cases
run replace theirs in the existing ``results.json`` and the report covers them all.

The first run of every kind on a fresh set of processes is a warm-up,
reported apart (memory) or discarded (throughput). Figures are medians over
``--reps`` repetitions with min and max; every ratio is taken per repetition
between runs made back to back, then its median is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from wsync.v1 import weight_sync_pb2 as pb

from bench import naive, profile, report
from bench.common import FlatModel, RawGroup, build_flat, machine_info, post_json, stop_processes
from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.layout import total_wire_bytes
from wsync_grpc.core.planning import DEFAULT_BUCKET_BYTES, DEFAULT_RAMP_BYTES, DEFAULT_SOLO_BYTES, plan_buckets
from wsync_grpc.group.process_group import free_port
from wsync_grpc.testing import EngineProcess, child_env, spawn_process, wait_all
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.wire.convert import batch_bucket_specs, bucket_spec

log = logging.getLogger("bench")

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GB = 1e9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the trainer's weights live: NCCL on CUDA (engines on the next GPUs), gloo on CPU."""


def _engine_device(i: int) -> str:
    if DEVICE == "cpu":
        return "cpu"
    return f"cuda:{(i + 1) % torch.cuda.device_count()}"


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ----------------------------------------------------------------------------- processes


@dataclass
class EngineProc:
    """One engine helper process."""

    proc: subprocess.Popen[bytes]
    grpc: str
    http: str
    pid: int
    log_path: Path


class Harness:
    """Starts engine processes and makes sure every one of them ends, whatever happens."""

    def __init__(self, solo_bytes: int = DEFAULT_SOLO_BYTES) -> None:
        self.solo_bytes = solo_bytes
        """The clients' ``solo_bytes`` (:class:`TrainerClient`)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="wsync-bench-"))
        self.checkpoints = self.tmp / "checkpoints"
        """The engines' checkpoint root (``--checkpoint-root``): disk updates read here."""
        self.checkpoints.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    def start_engines(
        self, model: str, n: int = 1, *, meta: bool = False, timeout: float = 600, dtype: str = "bfloat16"
    ) -> list[EngineProc]:
        """Start ``n`` engines serving ``model`` (seed 0, in ``dtype``) and wait until each serves (``timeout`` seconds
        in all).

        Raises:
            wsync_grpc.testing.EngineStartError: an engine exited first or did not serve in time.
        """
        env = child_env()
        started: list[EngineProcess] = []
        for i in range(n):
            tag = uuid.uuid4().hex[:8]
            info = self.tmp / f"engine-{tag}.json"
            cmd = [sys.executable, "-m", "bench.engine", "--model", model, "--info-file", str(info)]
            cmd += ["--device", _engine_device(i), "--dtype", dtype] + (["--meta"] if meta else [])
            cmd += ["--checkpoint-root", str(self.checkpoints)]
            e = spawn_process(cmd, ready_file=info, log=self.tmp / f"engine-{tag}.log", env=env, cwd=ROOT, wait=False)
            with self._lock:
                self.procs.append(e.process)
            started.append(e)
        wait_all(started, timeout)
        engines = []
        for e in started:
            d = json.loads(e.ready_text or "")
            assert e.log is not None
            engines.append(EngineProc(e.process, d["grpc"], d["http"], int(d["pid"]), e.log))
        return engines

    def stop(self, engines: Sequence[EngineProc]) -> None:
        """Terminate ``engines`` (SIGTERM, then SIGKILL after 10 s)."""
        self._end([e.proc for e in engines])

    def _end(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        stop_processes(list(procs))
        with self._lock:
            self.procs = [p for p in self.procs if p not in procs]

    def close(self) -> None:
        """End every process still running and remove the scratch directory."""
        with self._lock:
            procs = list(self.procs)
        self._end(procs)
        shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- one trainer session


class Session:
    """The trainer's side of one set of engines: a wsync client and a baseline group (raw + naive).

    Both groups span the same processes with the same backend; the baseline
    group is a plain torch process group (:class:`bench.common.RawGroup`),
    because the servicer does not lend its group to other code.
    """

    def __init__(
        self,
        engines: Sequence[EngineProc],
        model: FlatModel,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        solo_bytes: int = DEFAULT_SOLO_BYTES,
    ):
        self.engines = list(engines)
        self.model = model
        self.version = 0
        self._largest: dict[int, int] = {}
        self._procs = [psutil.Process(), *(psutil.Process(e.pid) for e in engines)]
        self.last_raw_cpu = 0.0
        device = torch.device(DEVICE if DEVICE == "cpu" else "cuda:0")
        self.client = TrainerClient(  # digests off: the transfer itself; the digests case times what they add
            [e.grpc for e in engines], bucket_bytes=bucket_bytes, solo_bytes=solo_bytes, device=device, digests=False
        )
        self.group: RawGroup | None = None
        try:
            self.client.init()
            self.group = self._baseline_group(device)
        except BaseException:
            self.close()
            raise

    def _baseline_group(self, device: torch.device) -> RawGroup:
        port = free_port()
        world = 1 + len(self.engines)
        results: list[Any] = [None] * len(self.engines)
        errors: list[BaseException] = []

        def ask(i: int, e: EngineProc) -> None:
            body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": i + 1, "world_size": world}
            try:
                results[i] = post_json(e.http, "/init_weights_update_group", body)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i, e), daemon=True) for i, e in enumerate(self.engines)]
        for t in threads:
            t.start()
        group = RawGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=world, device=device)
        for t in threads:
            t.join(130)
        if errors:
            group.destroy()
            raise errors[0]
        return group

    def close(self) -> None:
        """Leave both groups (engines and trainer)."""
        with contextlib.suppress(Exception):
            self.client.close()
        if self.group is not None:
            self.group.destroy()

    # ------------------------------------------------------------------ the three ways

    def raw(self, nbytes: int | None = None) -> float:
        """The ceiling: one raw broadcast of ``nbytes`` (default the model) as one flat tensor, in seconds.

        Every engine posts its receive first (as wsync's Prepare does); the
        time runs from the trainer posting its broadcast to the last engine's
        receive completing (``CLOCK_MONOTONIC`` is shared by the processes).
        """
        assert self.group is not None and self.model.flat is not None
        n = nbytes or self.model.nbytes
        for e in self.engines:
            post_json(e.http, "/raw/arm", {"nbytes": n})
        c0 = self.cpu()
        t0 = time.monotonic()
        work = self.group.broadcast(self.model.flat[:n])
        work.wait()
        t_sent = time.monotonic()
        done = [float(post_json(e.http, "/raw/wait")["done_at"]) for e in self.engines]
        self.last_raw_cpu = self.cpu() - c0
        return max(t_sent, *done) - t0

    def wsync(
        self,
        mode: str,
        *,
        layout: str = "flattened",
        bucket_bytes: int | None = None,
        mem: bool = False,
        drop_pool: bool = False,
    ) -> dict[str, Any]:
        """One :meth:`TrainerClient.sync`; wall time of the call (planning included) and its breakdown."""
        before = self.mem_reset(drop_pool) if mem else 0
        self.version += 1
        c0 = self.cpu()
        t0 = time.monotonic()
        r = self.client.sync(
            self.model.tensors.items(),
            f"bench-{self.version}",
            layout=layout,  # type: ignore[arg-type]
            apply_mode=mode,  # type: ignore[arg-type]
            bucket_bytes=bucket_bytes,
        )
        wall = time.monotonic() - t0
        cpu = self.cpu() - c0
        out: dict[str, Any] = {
            "seconds": wall,
            "cpu": cpu,
            "largest_bucket": self.largest_bucket(bucket_bytes or self.client.bucket_bytes),
            "plan": r.plan_seconds,
            "prepare": r.prepare_seconds,
            "broadcast": r.broadcast_seconds,
            "pack": r.pack_seconds,
            "complete": r.complete_seconds,
            "verify": r.verify_seconds,
            "apply": max(e.apply_seconds for e in r.engines.values()),
            "buckets": r.bucket_count,
            "payload": r.payload_bytes,
        }
        if mem:
            out.update(self.mem_after(before))
        return out

    def naive(self, *, mem: bool = False) -> dict[str, Any]:
        """One naive sync (:func:`bench.naive.naive_sync`)."""
        assert self.group is not None
        before = self.mem_reset(False) if mem else 0
        c0 = self.cpu()
        r = naive.naive_sync([e.http for e in self.engines], self.group, self.model.tensors)
        cpu = self.cpu() - c0
        out: dict[str, Any] = {"seconds": r.seconds, "cpu": cpu, "requests": r.requests, "json_bytes": r.json_bytes}
        if mem:
            out.update(self.mem_after(before))
        return out

    # ------------------------------------------------------------------ memory and checks

    def cpu(self) -> float:
        """CPU time used so far by this process and the engines (user + system, every thread), in seconds."""
        total = 0.0
        for p in self._procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def largest_bucket(self, bucket_bytes: int) -> int:
        """Size of the largest bucket the client plans for this model at ``bucket_bytes``, in bytes."""
        if bucket_bytes not in self._largest:
            plan = plan_buckets(
                self.model.tensors.items(),
                bucket_bytes,
                ramp_bytes=self.client.ramp_bytes,
                solo_bytes=self.client.solo_bytes,
            )
            self._largest[bucket_bytes] = max(b.size_bytes for b in plan)
        return self._largest[bucket_bytes]

    def mem_reset(self, drop_pool: bool) -> int:
        """Reset the first engine's peak memory (optionally emptying its buffer pool); its RSS in bytes."""
        return int(post_json(self.engines[0].http, "/mem/reset", {"drop_pool": drop_pool})["rss"])

    def mem_after(self, before: int) -> dict[str, int]:
        """The first engine's peak extra memory since :meth:`mem_reset` returned ``before``, and what it kept."""
        m = post_json(self.engines[0].http, "/mem")
        return {"peak_extra": int(m["hwm"]) - before, "kept": int(m["rss"]) - before, "rss_before": before}

    def verify(self) -> bool:
        """Whether every engine serves the trainer's bytes (SHA-256 of the first, a middle and the last tensor)."""
        names = list(self.model.tensors)
        pick = [names[0], names[len(names) // 2], names[-1]]
        want = {n: tensor_sha256(self.model.tensors[n]) for n in pick}
        for reply in self.client.checksums(pick).values():
            if {c.name: c.sha256 for c in reply.checksums} != want:
                return False
        return True


@contextlib.contextmanager
def session(h: Harness, model_name: str, engines: int = 1, dtype: str = "bfloat16") -> Iterator[Session]:
    """Engines serving ``model_name`` (seed 0), the trainer's copy (seed 1), both in ``dtype``, and a
    :class:`Session` over them."""
    procs: list[EngineProc] = []
    s: Session | None = None
    try:
        box: list[FlatModel] = []
        torch_dtype = getattr(torch, dtype)
        builder = threading.Thread(
            target=lambda: box.append(build_flat(model_name, torch_dtype, seed=1, device=DEVICE))
        )
        builder.start()
        procs = h.start_engines(model_name, engines, dtype=dtype)
        builder.join()
        s = Session(procs, box[0], solo_bytes=h.solo_bytes)
        yield s
    finally:
        if s is not None:
            s.close()
        h.stop(procs)


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- cases


def _paired(s: Session, fn: Callable[[], dict[str, Any]], reps: int, label: str) -> list[dict[str, Any]]:
    """``reps`` runs of ``fn``, each right after a run of the ceiling (stored under ``"raw"``) for a paired ratio."""
    out = []
    for _ in range(reps):
        raw = s.raw()
        raw_cpu = s.last_raw_cpu
        r = fn()
        r["raw"] = raw
        r["raw_cpu"] = raw_cpu
        out.append(r)
    line = ", ".join(f"{r['seconds']:.3f} s (ceiling {r['raw']:.3f} s)" for r in out)
    _say(f"  {label}: {line}")
    return out


def _steady(s: Session, mode: str) -> None:
    """Two more untimed syncs after a warm-up, so that timed syncs find the engine in its steady state.

    With staged apply the first swap cannot hand back this engine's initial
    weights (views of one flat buffer, see :mod:`bench.engine`), so the next
    sync allocates and first-touches a whole update's buffers again (page
    faults: seconds for a GB on this host); from the third sync on, each
    sync's buffers are the memory the previous one replaced. An engine
    serving separately allocated weights gets there after one sync. The
    first sync's time and memory are reported apart (section 5).
    """
    for _ in range(2):
        s.wsync(mode)


def case_models(
    h: Harness, models: Sequence[str], reps: int, sweep: Sequence[int], sweep_models: Sequence[str]
) -> dict[str, Any]:
    """Per model, one engine: ceiling vs wsync (streaming, then staged) vs naive; engine memory; bucket sweep.

    Each way runs as its own phase (a trainer keeps one apply mode; switching
    modes would make the engine's buffer pool reallocate), starting with a
    first sync on an emptied pool (memory of a first sync, timing reported
    apart), and each repetition is paired with a ceiling run just before it.
    """
    out: dict[str, Any] = {}
    for name in models:
        _say(f"model {name}: starting one engine")
        with session(h, name) as s:
            res: dict[str, Any] = {"bytes": s.model.nbytes, "tensors": len(s.model.tensors), "runs": {}}
            _say(f"model {name}: {s.model.nbytes / GB:.2f} GB, {len(s.model.tensors)} tensors")
            s.raw()  # warm-up
            for mode in ("streaming", "staged"):
                res[f"first_{mode}"] = s.wsync(mode, mem=True, drop_pool=True)
                _steady(s, mode)
                res["runs"][mode] = _paired(s, functools.partial(s.wsync, mode, mem=True), reps, f"{name} {mode}")
            res["first_naive"] = s.naive(mem=True)
            res["runs"]["naive"] = _paired(s, lambda: s.naive(mem=True), reps, f"{name} naive")
            res["verified"] = s.verify()
            if name in sweep_models and sweep:
                res["sweep"] = _sweep(s, sweep, reps)
            out[name] = res
    return out


def _sweep(s: Session, sizes: Sequence[int], reps: int) -> dict[str, Any]:
    """Each bucket size and apply mode in turn: a first sync on an emptied pool, then paired reps."""
    first: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for b in sizes:
        for mode in ("streaming", "staged"):
            key = f"{b}/{mode}"
            first[key] = s.wsync(mode, bucket_bytes=b, mem=True, drop_pool=True)
            sync = functools.partial(s.wsync, mode, bucket_bytes=b, mem=True)
            runs[key] = _paired(s, sync, reps, f"{b // MiB} MiB {mode}")
    return {"sizes": list(sizes), "first": first, "runs": runs}


def case_moe(h: Harness, reps: int) -> dict[str, Any]:
    """~20k small tensors: wsync flattened (both apply modes) vs wsync individual vs naive."""
    name = "moe-20k"
    _say(f"{name}: starting one engine")
    with session(h, name) as s:
        res: dict[str, Any] = {"bytes": s.model.nbytes, "tensors": len(s.model.tensors), "runs": {}}
        _say(f"{name}: {s.model.nbytes / GB:.2f} GB, {len(s.model.tensors)} tensors")
        kinds: dict[str, Callable[[], dict[str, Any]]] = {
            "flattened/streaming": lambda: s.wsync("streaming"),
            "flattened/staged": lambda: s.wsync("staged"),
            "individual/staged": lambda: s.wsync("staged", layout="individual"),
            "naive": lambda: s.naive(),
        }
        s.raw()
        for k, fn in kinds.items():
            fn()  # warm-up
            res["runs"][k] = _paired(s, fn, reps, f"{name} {k}")
        res["verified"] = s.verify()
    return res


def case_fanout(h: Harness, counts: Sequence[int], reps: int) -> dict[str, Any]:
    """The 1 GB model to 2 and 3 engines at once (1 engine: see the model case)."""
    out: dict[str, Any] = {}
    for n in counts:
        _say(f"fan-out: starting {n} engines (1gb)")
        with session(h, "1gb", n) as s:
            s.raw()
            runs: dict[str, list[dict[str, Any]]] = {}
            for mode in ("streaming", "staged"):
                s.wsync(mode)  # warm-up
                _steady(s, mode)
                runs[mode] = _paired(s, functools.partial(s.wsync, mode), reps, f"{n} engines {mode}")
            out[str(n)] = {"bytes": s.model.nbytes, "engines": n, "runs": runs, "verified": s.verify()}
    return out


def _prepare_messages(model: FlatModel, bucket_bytes: int) -> tuple[pb.PrepareHeader, list[pb.PrepareRequest]]:
    """What :meth:`TrainerClient.sync` streams as Prepare: the header, then the planned buckets, batched."""
    buckets = plan_buckets(
        model.tensors.items(), bucket_bytes, ramp_bytes=DEFAULT_RAMP_BYTES, solo_bytes=DEFAULT_SOLO_BYTES
    )
    header = pb.PrepareHeader(
        update_id=uuid.uuid4().hex,
        weight_version="bench",
        transport=pb.TRANSPORT_BROADCAST,
        layout=pb.BUCKET_LAYOUT_FLATTENED,
        apply_mode=pb.APPLY_MODE_STAGED,
        bucket_count=len(buckets),
        total_bytes=total_wire_bytes(buckets),
    )
    return header, batch_bucket_specs([bucket_spec(b) for b in buckets])


def case_control(h: Harness, reps: int, bucket_sizes: Sequence[int]) -> dict[str, Any]:
    """Prepare-to-ready for 579 and ~100k tensors: protobuf stream (wsync) vs one JSON body over HTTP.

    The engine is spec-only (``meta`` tensors): Prepare validates every
    tensor against the model and arms the receiver, then the update is
    cancelled and the group re-formed before the next repetition. The JSON
    body (SGLang's ``names``/``dtypes``/``shapes``) is parsed and validated
    against the same model by the engine process's HTTP server.
    """
    out: dict[str, Any] = {}
    for name in ("dense-32b", "moe-100k"):
        _say(f"control plane {name}: starting a spec-only engine")
        engines = h.start_engines(name, 1, meta=True)
        client: TrainerClient | None = None
        try:
            model = build_flat(name, meta=True)
            names = list(model.tensors)
            json_body = {
                "names": names,
                "dtypes": ["bfloat16"] * len(names),
                "shapes": [list(model.tensors[n].shape) for n in names],
            }
            client = TrainerClient([engines[0].grpc])
            stub = client.stubs[engines[0].grpc]
            res: dict[str, Any] = {"tensors": len(names), "model_bytes": model.nbytes, "by_bucket": {}}
            json_runs: list[float] = []
            for bucket_bytes in bucket_sizes:
                t = time.monotonic()
                header, msgs = _prepare_messages(model, bucket_bytes)
                build_s = time.monotonic() - t
                header.owner = client.owner  # the client owns the engine (Init): its Prepare names it
                sizes = [pb.PrepareRequest(header=header).ByteSize()] + [m.ByteSize() for m in msgs]
                runs: dict[str, list[float]] = {"prepare": [], "ready": []}
                for rep in range(reps + 1):  # the first is a warm-up
                    client.init()
                    header.update_id = uuid.uuid4().hex
                    first = [pb.PrepareRequest(header=header)]
                    t0 = time.monotonic()
                    reply = stub.Prepare(iter(first + msgs), timeout=120)
                    prep = time.monotonic() - t0
                    client.cancel("benchmark: only Prepare is timed")
                    t0 = time.monotonic()
                    post_json(engines[0].http, "/validate_json", json.dumps(json_body).encode())
                    js = time.monotonic() - t0
                    if rep:
                        runs["prepare"].append(prep)
                        runs["ready"].append(reply.ready_seconds)
                        json_runs.append(js)
                    _say(
                        f"  {name}, {bucket_bytes // MiB} MiB buckets ({header.bucket_count}), rep {rep}: Prepare "
                        f"{prep * 1e3:.1f} ms (engine {reply.ready_seconds * 1e3:.1f} ms), JSON {js * 1e3:.1f} ms"
                    )
                res["by_bucket"][str(bucket_bytes)] = {
                    "buckets": header.bucket_count,
                    "plan_seconds": build_s,
                    "proto_bytes": sum(sizes),
                    "proto_largest_message": max(sizes),
                    "proto_messages": len(sizes),
                    "runs": runs,
                }
            res["json_bytes"] = len(json.dumps(json_body).encode())
            res["json_runs"] = json_runs
            out[name] = res
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            h.stop(engines)
    return out


def _measure(pids: dict[str, int], runs: int, fn: Callable[[], object]) -> dict[str, Any]:
    """Wall seconds per call of ``fn`` over ``runs`` calls, and CPU seconds per call by side and thread group."""
    cpus = {k: profile.ThreadCPU(pid) for k, pid in pids.items()}
    for c in cpus.values():
        c.start()
    t0 = time.monotonic()
    for _ in range(runs):
        fn()
    wall = (time.monotonic() - t0) / runs
    return {"seconds": wall, **{k: {g: v / runs for g, v in c.stop().items()} for k, c in cpus.items()}}


def case_profile(h: Harness, models: Sequence[str], syncs: int) -> dict[str, Any]:
    """Where the CPU goes: per-thread CPU of trainer and engine, ceiling vs wsync, plus a py-spy sample.

    Per model, one engine: ``syncs`` ceiling runs, then per apply mode
    ``syncs`` syncs with per-thread CPU accounting (:class:`bench.profile.ThreadCPU`),
    then ``syncs`` more under py-spy (:func:`bench.profile.record`). Figures
    are per run (CPU seconds and wall seconds).
    """
    out: dict[str, Any] = {}
    for name in models:
        _say(f"profile {name}: starting one engine")
        with session(h, name) as s:
            pids = {"trainer": os.getpid(), "engine": s.engines[0].pid}
            res: dict[str, Any] = {"bytes": s.model.nbytes, "syncs": syncs, "runs": {}, "py_spy": {}}

            s.raw()
            res["runs"]["ceiling"] = _measure(pids, syncs, s.raw)
            for mode in ("streaming", "staged"):
                sync = functools.partial(s.wsync, mode)
                sync()  # warm-up: the receive-buffer pool fills
                _steady(s, mode)
                res["runs"][mode] = _measure(pids, syncs, sync)
                if profile.py_spy() is None:
                    continue
                with profile.record(list(pids.values()), h.tmp) as files:
                    for _ in range(syncs):
                        sync()
                res["py_spy"][mode] = {k: profile.top_functions(files[pid]) for k, pid in pids.items()}
            line = ", ".join(f"{k} {r['seconds'] * 1e3:.0f} ms" for k, r in res["runs"].items())
            _say(f"  {name}: {line}")
            out[name] = res
    return out


# ----------------------------------------------------------------------------- background load


class LoadMonitor:
    """Samples how much CPU other processes take while the suite runs (this machine is shared).

    ``cores`` of a case: the mean number of cores busy with processes that
    are neither this one nor its children, from ``/proc/stat`` (psutil).
    """

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (monotonic time, background cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _ours(self) -> dict[int, float]:
        me = psutil.Process()
        cpu: dict[int, float] = {}
        for p in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system + t.children_user + t.children_system
        return cpu

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    def _run(self) -> None:
        last_t, last_busy, last_ours = time.monotonic(), self._busy(), self._ours()
        while not self._stop.wait(self.interval):
            now, busy, ours = time.monotonic(), self._busy(), self._ours()
            ours_delta = sum(v - last_ours.get(pid, v) for pid, v in ours.items())
            cores = max(0.0, (busy - last_busy - ours_delta) / (now - last_t))
            self.samples.append((now, cores))
            last_t, last_busy, last_ours = now, busy, ours

    def mean(self, start: float, end: float) -> float:
        """Mean background cores between two ``time.monotonic()`` instants."""
        xs = [c for t, c in self.samples if start <= t <= end]
        return statistics.fmean(xs) if xs else 0.0


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=5, help="measured repetitions per case (after one warm-up)")
    p.add_argument("--models", default="smollm2-shapes,0.25gb,1gb,4gb", help="synthetic presets for the model case")
    p.add_argument("--sweep", default="16,64,256,1024", help="bucket sizes in MiB for the sweep (empty: none)")
    p.add_argument("--sweep-models", default="1gb,4gb", help="models the bucket sweep runs on")
    p.add_argument("--fanout", default="2,3", help="engine counts for the fan-out case (empty: none)")
    p.add_argument("--fleet", default="1,4,16,32", help="engine counts for the fleet case (tiny model)")
    p.add_argument("--control-buckets", default="256,1024", help="bucket sizes in MiB for the control-plane case")
    p.add_argument(
        "--solo", type=float, default=DEFAULT_SOLO_BYTES / MiB, help="client solo_bytes in MiB (0: pack every tensor)"
    )
    p.add_argument("--profile-models", default="smollm2-shapes,1gb", help="models the CPU profile runs on")
    p.add_argument("--profile-syncs", type=int, default=20, help="runs per figure in the CPU profile")
    p.add_argument(
        "--cases",
        default="models,moe,fanout,control,fleet,disk,digests,sharded,detection,profile,vllm,vllm_tail,colocated,delta,ray",
        help="which cases to run",
    )
    p.add_argument("--disk-model", default="1gb", help="synthetic preset of the disk case")
    p.add_argument("--digest-model", default="1gb", help="synthetic preset of the digest case")
    p.add_argument("--detection-model", default="1gb", help="synthetic preset of the detection case")
    p.add_argument(
        "--detection-kills", type=int, default=6, help="trainers SIGKILLed per apply mode in the detection case"
    )
    p.add_argument(
        "--tail-syncs", type=int, default=31, help="syncs per configuration in the vllm_tail case (the first apart)"
    )
    p.add_argument("--tail-dumps", type=Path, default=None, help="vllm_tail: keep slow syncs' py-spy dumps here")
    p.add_argument(
        "--colocated-reps", type=int, default=9, help="rounds per configuration in the colocated case (after warm-up)"
    )
    p.add_argument(
        "--colocated-vllm", type=int, default=5, help="colocated: vLLM rounds, broadcast and shared memory (0: none)"
    )
    p.add_argument("--delta-steps", type=int, default=10, help="training steps per learning rate in the delta case")
    p.add_argument("--delta-lrs", default="1e-6,1e-5,1e-4", help="AdamW learning rates of the delta case")
    p.add_argument(
        "--delta-vllm", type=int, default=10, help="delta case: vLLM rounds of a whole and a delta sync (0: none)"
    )
    p.add_argument("--delta-link", type=int, default=6, help="delta case: steps over the rate-limited link (0: none)")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--plots", type=Path, default=ROOT / "bench")
    p.add_argument("--report-only", action="store_true", help="only rewrite --out and the plots from results.json")
    p.add_argument(
        "--merge",
        action="store_true",
        help="put the cases run into the existing results.json (the other cases' results kept) and report on all",
    )
    args = p.parse_args(argv)
    if args.report_only:
        return _report(json.loads((args.plots / "results.json").read_text()), args.out, args.plots)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]

    def mib_list(text: str) -> list[int]:
        return [int(x) * MiB for x in text.split(",") if x.strip()]

    h = Harness(int(args.solo * MiB))
    monitor = LoadMonitor()

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks: every engine is stopped

    signal.signal(signal.SIGTERM, on_signal)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_info(),
        "backend": "nccl" if DEVICE == "cuda" else "gloo",
        "reps": args.reps,
        "default_bucket_bytes": DEFAULT_BUCKET_BYTES,
        "default_ramp_bytes": DEFAULT_RAMP_BYTES,
        "solo_bytes": int(args.solo * MiB),
        "load_before": os.getloadavg(),
    }
    start = time.monotonic()
    timings: dict[str, float] = {}
    background: dict[str, float] = {}
    monitor.start()
    try:
        for case in cases:
            t = time.monotonic()
            if case == "models":
                models = [m.strip() for m in args.models.split(",") if m.strip()]
                sweep_models = [m.strip() for m in args.sweep_models.split(",") if m.strip()]
                results["models"] = case_models(h, models, args.reps, mib_list(args.sweep), sweep_models)
            elif case == "moe":
                results["moe"] = case_moe(h, args.reps)
            elif case == "fanout":
                results["fanout"] = case_fanout(h, [int(x) for x in args.fanout.split(",") if x.strip()], args.reps)
            elif case == "control":
                results["control"] = case_control(h, args.reps, mib_list(args.control_buckets))
            elif case == "fleet":
                from bench.fleet_case import case_fleet

                results["fleet"] = case_fleet([int(x) for x in args.fleet.split(",") if x.strip()], args.reps)
            elif case == "disk":
                from bench.disk_case import case_disk

                results["disk"] = case_disk(h, args.disk_model, args.reps)
            elif case == "digests":
                from bench.digest_case import case_digests

                results["digests"] = case_digests(h, args.digest_model, args.reps)
            elif case == "sharded":
                from bench.sharded_case import case_sharded

                results["sharded"] = case_sharded(max(2, args.reps // 2))
            elif case == "detection":
                from bench.detection_case import case_detection

                results["detection"] = case_detection(h, args.detection_model, args.detection_kills)
            elif case == "vllm":
                from bench.vllm_case import case_vllm

                results["vllm"] = case_vllm(max(3, args.reps // 2))
            elif case == "vllm_tail":
                from bench.vllm_tail_case import case_vllm_tail

                results["vllm_tail"] = case_vllm_tail(args.tail_syncs, args.tail_dumps)
            elif case == "colocated":
                from bench.colocated_case import case_colocated

                results["colocated"] = case_colocated(h, args.colocated_reps, args.colocated_vllm)
            elif case == "delta":
                from bench.delta_case import case_delta

                lrs = [float(x) for x in args.delta_lrs.split(",") if x.strip()]
                results["delta"] = case_delta(h, args.delta_steps, lrs, args.delta_vllm, args.delta_link)
            elif case == "ray":
                from bench.ray_case import case_ray

                results["ray"] = case_ray()
            elif case == "profile":
                names = [m.strip() for m in args.profile_models.split(",") if m.strip()]
                results["profile"] = case_profile(h, names, args.profile_syncs)
            else:
                raise SystemExit(f"unknown case {case!r}")
            timings[case] = time.monotonic() - t
            background[case] = monitor.mean(t, time.monotonic())
    finally:
        monitor.stop()
        h.close()
    results["load_after"] = os.getloadavg()
    results["timings"] = timings
    results["background_cores"] = background
    results["total_seconds"] = time.monotonic() - start
    args.plots.mkdir(parents=True, exist_ok=True)
    stored = args.plots / "results.json"
    if args.merge:
        results = merge(json.loads(stored.read_text()), results, cases)
    elif stored.is_file() and "cuda_ipc" in (old := json.loads(stored.read_text())):
        results["cuda_ipc"] = old["cuda_ipc"]  # run on a GPU (make gpu-bench), never here: kept as it was
    stored.write_text(json.dumps(results, indent=1, default=str))
    _report(results, args.out, args.plots)
    _say(f"done in {results['total_seconds']:.0f} s; wrote {args.out}")
    return 0


def merge(old: dict[str, Any], new: dict[str, Any], cases: Sequence[str]) -> dict[str, Any]:
    """``old`` (a previous run's results) with the results, timings and background load of ``cases`` from ``new``.

    Everything else in ``old`` (its date, machine and the other cases) is kept; the total time is the old
    one with the cases' new times in place of their old ones. A merged case that records no date of its own gets
    ``new``'s (its section says when it was measured).
    """
    out = dict(old)
    replaced = sum(old.get("timings", {}).get(c, 0.0) for c in cases)
    added = sum(new.get("timings", {}).get(c, 0.0) for c in cases)
    for key in ("timings", "background_cores"):
        out[key] = {**old.get(key, {}), **new.get(key, {})}
    for case in cases:
        c = new[case]
        out[case] = {**c, "date": new["date"]} if isinstance(c, dict) and "date" not in c and "date" in new else c
    out["total_seconds"] = float(old.get("total_seconds", 0.0)) - replaced + added
    return out


def _report(results: dict[str, Any], out: Path, plots: Path) -> int:
    """Write ``out`` and the plots from ``results`` (:func:`bench.report.write`) and print the checks."""
    for c in report.write(results, out, plots):
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.target}: {c.measured}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
