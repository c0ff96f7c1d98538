"""Where a sync's CPU time goes: per-thread CPU accounting and a py-spy sample of the Python threads.

Two views of the same runs, on the trainer (this process) and on an engine:

- :class:`ThreadCPU` reads every thread's user + system CPU time from
  ``/proc/<pid>/task/<tid>/stat`` before and after a batch of runs and
  groups it by the thread's kernel name: gloo's socket thread
  (``gloo_tcp_loop``, the loopback TCP copies), torch's gloo work queue
  (``pt_gloo_runloop``) and the Python interpreter's threads (``python``:
  packing on the trainer, the receiver's apply and gRPC on the engine, and
  torch's OpenMP threads). CPU of threads that ended between the two reads
  (the engine starts a receiver thread per update) is the process's total
  minus its live threads' and counts as Python. Exact and free of overhead,
  but blind to functions.
- :func:`record` runs ``py-spy record --nonblocking`` (sampling, no pauses)
  on a process while the runs repeat and :func:`top_functions` ranks the
  Python functions the samples land in (idle threads are not sampled, so
  the shares are of CPU time spent in Python threads, native code called
  from Python included).

Times are in seconds.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.common import stop_processes

GROUPS = {"gloo_tcp_loop": "gloo socket I/O", "pt_gloo_runloop": "gloo work queue"}
"""Kernel thread name -> the group it is reported in; any other thread is "Python threads"."""
PYTHON = "Python threads"

_TICK = os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (kernel thread name, user + system CPU seconds) for every live thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _process_cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


class ThreadCPU:
    """CPU seconds by thread group of one process between :meth:`start` and :meth:`stop`.

    Resolution is one clock tick (10 ms on Linux): measure a batch of runs
    and divide. Linux only (``/proc``).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._before: dict[int, tuple[str, float]] = {}
        self._total = 0.0

    def start(self) -> None:
        """Read the counters."""
        self._before = _threads(self.pid)
        self._total = _process_cpu(self.pid)

    def stop(self) -> dict[str, float]:
        """CPU seconds per group since :meth:`start` (:data:`GROUPS` values and :data:`PYTHON`)."""
        after = _threads(self.pid)
        total = _process_cpu(self.pid) - self._total
        out: dict[str, float] = collections.defaultdict(float)
        for tid, (name, cpu) in after.items():
            out[GROUPS.get(name, PYTHON)] += cpu - self._before.get(tid, (name, 0.0))[1]
        # Threads that ended in between (and rounding): what the live ones do not account for.
        out[PYTHON] += max(0.0, total - sum(out.values()))
        return dict(out)


def py_spy() -> str | None:
    """The ``py-spy`` executable next to this interpreter or on ``PATH``, or None."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


@contextlib.contextmanager
def record(pids: Sequence[int], out_dir: Path, rate: int = 200) -> Iterator[dict[int, Path]]:
    """Sample each of ``pids`` with py-spy while the body runs; yields pid -> raw (collapsed stacks) file.

    The files are complete when the block exits. py-spy attaches with
    ``ptrace``; a file that is missing or empty afterwards means it could not.

    Raises:
        FileNotFoundError: py-spy is not installed.
    """
    exe = py_spy()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    files = {pid: out_dir / f"py-spy-{pid}.txt" for pid in pids}
    procs = []
    for pid, path in files.items():
        cmd = [exe, "record", "--nonblocking", "--threads", "--rate", str(rate), "--format", "raw"]
        cmd += ["--output", str(path), "--pid", str(pid)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        time.sleep(1.0)  # attach
        yield files
    finally:
        stop_processes(procs, signal.SIGINT, grace=30)  # py-spy writes its file on SIGINT


def top_functions(path: Path, n: int = 5) -> dict[str, Any]:
    """The ``n`` Python functions most samples of a py-spy raw file end in, with their share of all samples.

    Returns:
        ``{"samples": total, "top": [[function, share], ...]}``; function is
        ``"name (file)"`` as py-spy writes a frame, without the line number.
    """
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            stack, _, num = line.rpartition(" ")
            if not stack or not num.isdigit():
                continue
            leaf = stack.split(";")[-1]
            name, _, where = leaf.partition(" (")
            file = where.rsplit(":", 1)[0]
            counts[f"{name} ({file})" if file else name] += int(num)
            total += int(num)
    top = [[f, c / total] for f, c in counts.most_common(n)] if total else []
    return {"samples": total, "top": top}
