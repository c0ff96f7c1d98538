"""The fleet case of the benchmarks: how each cost of a sync grows with the number of engines.

``max(counts)`` engine processes (``wsync serve --synthetic tiny``: a 2-layer Llama-shaped model of
about 0.3 MB in bf16, so that the wire is a small part of a sync) are started once on this host and
kept for the whole case. Each repetition walks every fleet size N in ``counts`` in turn (interleaved,
so that the other load of this shared host falls on every N alike): a fresh
:class:`~wsync_grpc.trainer.client.TrainerClient` over the first N engines (real gRPC, one gloo group
of N + 1 ranks), its first ``init`` and one untimed sync (warm-up), then, timed:

- ``init(force=True)``: forming the group again over the same engines (``GetStatus`` everywhere, the
  engines leave their old group, ``Init`` everywhere while the trainer joins as rank 0); the first
  ``init`` (engines free: nothing to leave) is timed too, once per repetition, as ``init_first``;
- :data:`SYNCS_PER_REP` staged syncs (the model with every value changed each time): the call's wall
  time and its phases from :class:`~wsync_grpc.trainer.results.SyncResult` (Prepare fan-out, the wire,
  Complete's verifying and applying fan-outs), the trainer's CPU seconds (this process, every thread,
  from ``psutil``), the engines' CPU seconds, and the trainer's OS threads: the most seen during the
  sync (sampled by a thread every :data:`SAMPLE_S`, itself not counted) and, idle, after it.

then the client is closed (its engines leave the group and are free for the next N).

The exclusion cost (:func:`exclusion`), at the largest N with the fleet policy
``FleetPolicy.exclude``: per round, a normal sync and an ``init(force=True)``, then one engine
SIGKILLed and the next sync timed (it leaves the dead engine out and forms the group again over the
survivors).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, child_env, spawn_engine, stop_all, wait_all
from wsync_grpc.trainer import FleetPolicy, SyncResult, TrainerClient

PRESET = "tiny"
"""The engines' synthetic model (:data:`wsync_grpc.engines.synthetic.PRESETS`)."""
SYNCS_PER_REP = 2
"""Timed syncs per fleet size and repetition, after one ``init(force=True)``."""
SAMPLE_S = 0.002
"""How often the thread sampler reads the trainer's thread count during a sync, in seconds."""
SETTLE_S = 0.3
"""Wait after a call before the idle thread count is read, in seconds (threads that end with the call end)."""
KILLS = 3
"""Exclusion rounds at the largest fleet size: engines SIGKILLed one after another, one per round."""
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "WSYNC_LOG_LEVEL": "WARNING"}
"""The engines' extra environment: one OpenMP thread each (tens of processes share the host's cores)."""


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


class ThreadSampler:
    """Reads the thread count of this process every ``interval`` seconds while in a ``with`` block.

    ``peak`` is the most threads seen, the sampler's own thread not counted; ``cpu`` its own CPU
    seconds (to subtract from the process's).
    """

    def __init__(self, interval: float = SAMPLE_S) -> None:
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self.cpu = 0.0
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-threads", daemon=True)

    def _run(self) -> None:
        c0 = time.thread_time()
        while True:
            self.peak = max(self.peak, self._proc.num_threads() - 1)
            self.samples += 1
            if self._stop.wait(self.interval):
                break
        self.cpu = time.thread_time() - c0

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def idle_threads() -> int:
    """This process's thread count after :data:`SETTLE_S` seconds."""
    time.sleep(SETTLE_S)
    return int(psutil.Process().num_threads())


class Fleet:
    """The engine processes of the case and the trainer's model."""

    def __init__(self, n: int, tmp: Path) -> None:
        self.tmp = tmp
        self.model = synthetic.build(PRESET, seed=1, dtype=torch.bfloat16)
        self.step = 0
        env = child_env(ENGINE_ENV)
        args = ["--synthetic", PRESET, "--dtype", "bfloat16", "--grace", "1"]
        self.engines: list[EngineProcess] = []
        try:
            for i in range(n):
                self.engines.append(
                    spawn_engine(
                        args, port_file=tmp / f"e{i}.port", log=tmp / f"e{i}.log", env=env, wait=False, name=f"e{i}"
                    )
                )
            wait_all(self.engines, timeout_s=120 + 10 * n)
        except BaseException:
            self.close()
            raise
        self.procs = {e.target: psutil.Process(e.pid) for e in self.engines}

    def next_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The model with every value changed (so that every sync really moves new bytes)."""
        self.step += 1
        for t in self.model.values():
            t.add_(1.0)
        return list(self.model.items())

    def engine_cpu(self, targets: Sequence[str]) -> float:
        """CPU seconds used so far by the engines at ``targets`` (every thread)."""
        total = 0.0
        for t in targets:
            with contextlib.suppress(psutil.Error):
                total += _cpu(self.procs[t])
        return total

    def rss(self) -> list[int]:
        """Each live engine's resident memory, in bytes."""
        out = []
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                out.append(int(p.memory_info().rss))
        return out

    def close(self) -> None:
        stop_all(self.engines, grace_s=5)


def timed_sync(client: TrainerClient, fleet: Fleet, targets: Sequence[str]) -> dict[str, Any]:
    """One staged sync with its phases, the trainer's CPU and threads, and the engines' CPU."""
    me = psutil.Process()
    weights = fleet.next_weights()
    marks: dict[str, float] = {}
    e0 = fleet.engine_cpu(targets)
    c0 = _cpu(me)
    t0 = time.monotonic()

    def on_phase(phase: str) -> None:
        marks[phase] = time.monotonic() - t0

    with ThreadSampler() as sampler:
        r = client.sync(weights, f"fleet-{fleet.step}", on_phase=on_phase)
    wall = time.monotonic() - t0
    cpu = _cpu(me) - c0 - sampler.cpu
    engines_cpu = fleet.engine_cpu(targets) - e0
    return {**result_fields(r), "seconds": wall, "cpu": cpu, "engines_cpu": engines_cpu,
            "threads_peak": sampler.peak, "threads_samples": sampler.samples, "marks": marks,
            "threads_idle": idle_threads()}  # fmt: skip


def result_fields(r: SyncResult) -> dict[str, Any]:
    """The trainer's timings of a sync (seconds) and what it sent."""
    out: dict[str, Any] = {
        "init": r.init_seconds,
        "plan": r.plan_seconds,
        "prepare": r.prepare_seconds,
        "broadcast": r.broadcast_seconds,
        "verify": r.verify_seconds,
        "apply": r.complete_seconds - r.verify_seconds,
        "complete": r.complete_seconds,
        "total": r.total_seconds,
        "buckets": r.bucket_count,
        "payload": r.payload_bytes,
    }
    if r.excluded:  # the fleet policy's: the engines left out of this sync, and why
        out["excluded"] = sorted(r.excluded)
        out["excluded_why"] = {t: str(f)[:300] for t, f in r.excluded.items()}
    out["attempts"] = r.attempts
    return out


@contextlib.contextmanager
def _client(targets: Sequence[str], **kwargs: Any) -> Iterator[TrainerClient]:
    c = TrainerClient(list(targets), group_timeout_s=120, rpc_timeout_s=60, **kwargs)
    try:
        yield c
    finally:
        c.close()


def one_size(fleet: Fleet, n: int) -> dict[str, Any]:
    """One repetition at fleet size ``n``: a fresh client, a warm-up, ``init(force=True)``, the timed syncs."""
    targets = [e.target for e in fleet.engines[:n]]
    with _client(targets) as c:
        t0 = time.monotonic()
        c.init()  # the engines are free (the last client's close made them leave): no Leave first
        first_s = time.monotonic() - t0
        c.sync(fleet.next_weights(), f"fleet-{fleet.step}")  # warm-up
        me = psutil.Process()
        c0 = _cpu(me)
        t0 = time.monotonic()
        c.init(force=True)
        init_s = time.monotonic() - t0
        init_cpu = _cpu(me) - c0
        syncs = [timed_sync(c, fleet, targets) for _ in range(SYNCS_PER_REP)]
        return {"init": init_s, "init_cpu": init_cpu, "init_first": first_s, "syncs": syncs}


def exclusion(fleet: Fleet, n: int, kills: int = KILLS) -> dict[str, Any]:
    """At fleet size ``n``: per round, a normal sync and ``init(force=True)``, then a SIGKILL and the next sync.

    The engines killed are the last ones of the first ``n``, one per round; after the case they are gone.
    After each round the dead engine is removed from the client (``remove_engine``), so that the next
    round's normal sync and re-formation are over live engines only. A failure ends the rounds and is
    recorded (``error``) with the rounds done.
    """
    targets = [e.target for e in fleet.engines[:n]]
    rounds: list[dict[str, Any]] = []
    out: dict[str, Any] = {"engines": n, "min_engines": n - kills, "rounds": rounds}
    policy = FleetPolicy.exclude(min_engines=n - kills)
    try:
        with _client(targets, policy=policy) as c:
            c.init()
            c.sync(fleet.next_weights(), f"fleet-{fleet.step}")  # warm-up
            for k in range(kills):
                live = list(c.targets)
                victim = fleet.engines[n - 1 - k]
                normal = timed_sync(c, fleet, live)
                t0 = time.monotonic()
                c.init(force=True)
                init_s = time.monotonic() - t0
                victim.kill()
                excluded = timed_sync(c, fleet, live)
                after = timed_sync(c, fleet, live)
                rounds.append({"victim": victim.target, "normal": normal, "init": init_s, "excluded": excluded,
                               "after": after})  # fmt: skip
                _say(
                    f"  exclusion {k + 1}: normal sync {normal['seconds'] * 1e3:.0f} ms, init {init_s * 1e3:.0f} "
                    f"ms, sync excluding {victim.target} {excluded['seconds'] * 1e3:.0f} ms "
                    f"(excluded: {excluded.get('excluded')}), next sync {after['seconds'] * 1e3:.0f} ms"
                )
                c.remove_engine(victim.target)
    except Exception as exc:  # recorded with the rounds done: the report says what failed
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        _say(f"  exclusion failed: {out['error']}")
    return out


def case_fleet(counts: Sequence[int], reps: int, *, exclude: bool = True) -> dict[str, Any]:
    """Run the case over fleet sizes ``counts``, ``reps`` interleaved repetitions each (see the module)."""
    counts = sorted(set(counts))
    tmp = Path(tempfile.mkdtemp(prefix="wsync-bench-fleet-"))
    largest = counts[-1]
    try:
        _say(f"fleet: starting {largest} engines ({PRESET})")
        t0 = time.monotonic()
        fleet = Fleet(largest, tmp)
        start_s = time.monotonic() - t0
        try:
            rss = fleet.rss()
            base_threads = idle_threads()
            nbytes = sum(t.numel() * t.element_size() for t in fleet.model.values())
            _say(
                f"fleet: {largest} engines up in {start_s:.0f} s, {statistics.median(rss) / 2**20:.0f} MiB RSS each; "
                f"trainer threads without a client: {base_threads}"
            )
            runs: dict[str, list[dict[str, Any]]] = {str(n): [] for n in counts}
            for rep in range(reps):
                for n in counts:
                    r = one_size(fleet, n)
                    runs[str(n)].append(r)
                    s = r["syncs"]
                    _say(
                        f"  rep {rep + 1}, {n} engines: init {r['init'] * 1e3:.0f} ms, sync "
                        + ", ".join(f"{x['seconds'] * 1e3:.0f}" for x in s)
                        + " ms (wire "
                        + ", ".join(f"{x['broadcast'] * 1e3:.1f}" for x in s)
                        + f" ms), threads idle {s[-1]['threads_idle']} peak {max(x['threads_peak'] for x in s)}"
                    )
            excl = exclusion(fleet, largest) if exclude and largest > KILLS else {"skipped": "not asked"}
            if "skipped" in excl:
                _say(f"fleet: exclusion skipped: {excl['skipped']}")
        finally:
            fleet.close()
        return {
            "preset": PRESET,
            "model_bytes": nbytes,
            "tensors": len(fleet.model),
            "counts": counts,
            "reps": reps,
            "syncs_per_rep": SYNCS_PER_REP,
            "settle_seconds": SETTLE_S,
            "sample_seconds": SAMPLE_S,
            "start_seconds": start_s,
            "engine_rss_bytes": rss,
            "threads_without_client": base_threads,
            "runs": runs,
            "exclusion": excl,
            "cpu_count": os.cpu_count(),
            "measured": time.strftime("%Y-%m-%d %H:%M %Z"),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
