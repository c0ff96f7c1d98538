"""Leftover engine processes on this host: what ``wsync serve`` reports at start instead of running slowly.

A SIGKILLed vLLM server (``wsync serve --engine vllm``, ``vllm serve``) leaves its engine core and
worker processes running: ``VLLM::EngineCore`` and ``VLLM::Worker...`` (vLLM names its processes
with ``setproctitle``, prefix ``VLLM_PROCESS_NAME_PREFIX``), each holding the model's memory, and
the engine core ignores SIGTERM. A ``wsync serve`` whose launcher was killed keeps running and
serving too. Syncs and generation on such a host stall while these compete for its memory and
cores, so ``wsync serve`` names them before its engine loads (:func:`warn_leftovers`).

A leftover is found, never ended:

- a vLLM engine process (title ``VLLM::...``) whose server is gone: its nearest ancestor that is
  not a vLLM engine process is gone, is the init process (pid 1) that adopted it, or is no Python
  process (a subreaper such as ``systemd --user`` or ``tini`` that adopted it); a vLLM server,
  or a Python program running vLLM in-process, is a Python process;
- a ``wsync serve`` process (``wsync serve ...``, ``python -m wsync_grpc.tools.cli serve ...``)
  adopted by the init process (pid 1): whatever started it is gone (a killed launcher, or a
  deliberate ``nohup``);
- and every process below either.

This process, its ancestors and its descendants are never leftovers. Linux only (``/proc``);
elsewhere nothing is found. Memory is in bytes, CPU in cores (1.0: one core kept busy), times in
seconds.
"""

from __future__ import annotations

import logging
import os
import pwd
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CPU_SAMPLE_S",
    "HostMemory",
    "Leftover",
    "find_leftovers",
    "host_memory",
    "leftovers_warning",
    "warn_leftovers",
]

log = logging.getLogger("wsync")

CPU_SAMPLE_S = 0.2
"""How long :func:`find_leftovers` watches the leftovers it found to measure their CPU use, in seconds."""

_PROC = Path("/proc")
_TITLE_CHARS = 100
_GB = 1e9


@dataclass(frozen=True)
class Leftover:
    """One leftover engine process.

    Attributes:
        pid: its process id.
        title: its process title (the command line, spaces between arguments; vLLM's ``VLLM::EngineCore``),
            cut to 100 characters (ending in ``...`` where cut).
        kind: ``"vllm"`` (a vLLM engine process), ``"wsync serve"``, or ``"child"`` (another process below one
            of those).
        why: why it is a leftover, e.g. ``"a vLLM engine process whose server is gone, adopted by pid 1"`` or
            ``"below pid 42"`` (the leftover it runs below).
        rss_bytes: its resident memory, in bytes.
        cpu_cores: the cores it kept busy while :func:`find_leftovers` watched it (1.0: one core; 0.0 if it
            was not watched).
        user: the name of the user it runs as.
    """

    pid: int
    title: str
    kind: str
    why: str
    rss_bytes: int
    cpu_cores: float
    user: str


@dataclass(frozen=True)
class HostMemory:
    """This host's memory, from ``/proc/meminfo``.

    Attributes:
        available_bytes: what new processes can get without swapping (``MemAvailable``), in bytes.
        total_bytes: the host's memory (``MemTotal``), in bytes.
    """

    available_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    argv: tuple[str, ...]
    uid: int
    cpu_ticks: int
    rss_pages: int
    zombie: bool


def _read_proc(pid: int) -> _Proc | None:
    """``/proc/PID``'s parent, command line, owner, CPU ticks and resident pages; ``None`` once it is gone."""
    base = _PROC / str(pid)
    try:
        stat = (base / "stat").read_text()
        raw = (base / "cmdline").read_bytes()
        statm = (base / "statm").read_text().split()
        uid = base.stat().st_uid
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    argv = tuple(a for a in raw.decode(errors="replace").split("\0") if a)
    return _Proc(
        pid=pid,
        ppid=int(fields[1]),
        argv=argv,
        uid=uid,
        cpu_ticks=int(fields[11]) + int(fields[12]),
        rss_pages=int(statm[1]),
        zombie=fields[0] == "Z",
    )


def _processes() -> dict[int, _Proc]:
    procs: dict[int, _Proc] = {}
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return procs
    for name in entries:
        if name.isdigit() and (p := _read_proc(int(name))) is not None:
            procs[p.pid] = p
    return procs


def _vllm_prefixes() -> tuple[str, ...]:
    return tuple({"VLLM::", f"{os.environ.get('VLLM_PROCESS_NAME_PREFIX', 'VLLM')}::"})


def _is_vllm(p: _Proc) -> bool:
    return bool(p.argv) and p.argv[0].startswith(_vllm_prefixes())


def _is_wsync_serve(p: _Proc) -> bool:
    for i, arg in enumerate(p.argv):
        if arg == "wsync_grpc.tools.cli" or os.path.basename(arg) == "wsync":
            return "serve" in p.argv[i + 1 :]
    return False


def _is_python(p: _Proc) -> bool:
    """Whether ``p`` runs a Python interpreter (its executable, else its first argument, says so)."""
    try:
        exe = os.readlink(_PROC / str(p.pid) / "exe")
    except OSError:
        exe = p.argv[0] if p.argv else ""
    return os.path.basename(exe).startswith(("python", "pypy")) or _is_vllm(p)


def _orphan_vllm(p: _Proc, procs: dict[int, _Proc]) -> str | None:
    """Why vLLM engine process ``p`` has no server (``None``: one runs it, or ``p`` is below another vLLM one)."""
    parent = procs.get(p.ppid)
    if parent is not None and _is_vllm(parent):
        return None  # judged at the top of its tree
    gone = "a vLLM engine process whose server is gone"
    if parent is None:
        return gone
    if parent.pid == 1 and not any(w in " ".join(parent.argv) for w in ("vllm", "wsync")):
        return f"{gone}, adopted by pid 1"
    if not _is_python(parent):
        return f"{gone}, adopted by pid {parent.pid} ({os.path.basename(parent.argv[0]) if parent.argv else '?'})"
    return None


def _roots(procs: dict[int, _Proc]) -> dict[int, tuple[str, str]]:
    """The leftovers at the top of their trees: pid -> (kind, why)."""
    roots: dict[int, tuple[str, str]] = {}
    for p in procs.values():
        if p.zombie:
            continue
        if _is_vllm(p):
            why = _orphan_vllm(p, procs)
            if why is not None:
                roots[p.pid] = ("vllm", why)
        elif _is_wsync_serve(p) and p.ppid == 1:
            roots[p.pid] = ("wsync serve", "a wsync serve whose launcher is gone, adopted by pid 1")
    return roots


def _lineage(pid: int, procs: dict[int, _Proc]) -> set[int]:
    """``pid`` and its ancestors."""
    seen: set[int] = set()
    while pid in procs and pid not in seen:
        seen.add(pid)
        pid = procs[pid].ppid
    return seen


def _trees(roots: Sequence[int], procs: dict[int, _Proc]) -> dict[int, int]:
    """The roots and every process below them, in tree order: pid -> the root it is below (itself for a root)."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    order: dict[int, int] = {}
    todo = [(pid, pid) for pid in sorted(roots, reverse=True)]
    while todo:
        pid, root = todo.pop()
        if pid not in order:
            order[pid] = root
            todo += [(child, root) for child in sorted(children.get(pid, ()), reverse=True)]
    return order


def _title(p: _Proc) -> str:
    title = " ".join(p.argv) or f"[pid {p.pid}]"
    return title if len(title) <= _TITLE_CHARS else title[: _TITLE_CHARS - 3] + "..."


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def find_leftovers(cpu_sample_s: float = CPU_SAMPLE_S) -> list[Leftover]:
    """The leftover engine processes on this host (see the module's docstring), in tree order; never ends any.

    Reads ``/proc`` once (a few milliseconds for a few hundred processes), then, only if it found some,
    watches them ``cpu_sample_s`` seconds to measure the cores they keep busy. Processes that end meanwhile are
    left out. On a host without ``/proc`` it returns an empty list.

    Args:
        cpu_sample_s: how long to watch the leftovers found, in seconds; 0 skips it (``cpu_cores`` 0.0).

    Raises:
        ValueError: ``cpu_sample_s`` is negative.
    """
    if cpu_sample_s < 0:
        raise ValueError(f"cpu_sample_s must not be negative, got {cpu_sample_s!r}")
    procs = _processes()
    roots = _roots(procs)
    if not roots:
        return []
    mine = _lineage(os.getpid(), procs)
    mine |= set(_trees([os.getpid()], procs))
    roots = {pid: kw for pid, kw in roots.items() if pid not in mine}
    tree = _trees(list(roots), procs)
    pids = [pid for pid in tree if pid not in mine and not procs[pid].zombie]
    if not pids:
        return []
    cpu = {pid: 0.0 for pid in pids}
    if cpu_sample_s > 0:
        start = time.monotonic()
        time.sleep(cpu_sample_s)
        later = {pid: p for pid in pids if (p := _read_proc(pid)) is not None}
        elapsed_ticks = (time.monotonic() - start) * os.sysconf("SC_CLK_TCK")
        pids = [pid for pid in pids if pid in later]
        cpu = {pid: (later[pid].cpu_ticks - procs[pid].cpu_ticks) / elapsed_ticks for pid in pids}
    page = os.sysconf("SC_PAGE_SIZE")
    return [
        Leftover(
            pid=pid,
            title=_title(procs[pid]),
            kind=roots[pid][0] if pid in roots else "vllm" if _is_vllm(procs[pid]) else "child",
            why=roots[pid][1] if pid in roots else f"below pid {tree[pid]}",
            rss_bytes=procs[pid].rss_pages * page,
            cpu_cores=max(0.0, cpu[pid]),
            user=_user(procs[pid].uid),
        )
        for pid in pids
    ]


def host_memory() -> HostMemory | None:
    """This host's available and total memory (``/proc/meminfo``); ``None`` where it cannot be read."""
    values: dict[str, int] = {}
    try:
        for line in (_PROC / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "MemTotal"):
                values[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if len(values) != 2:
        return None
    return HostMemory(available_bytes=values["MemAvailable"], total_bytes=values["MemTotal"])


def leftovers_warning(leftovers: Sequence[Leftover], memory: HostMemory | None) -> str:
    """The warning ``wsync serve`` logs about ``leftovers`` (one message, a line per process); ``""`` for none."""
    if not leftovers:
        return ""
    rss = sum(p.rss_bytes for p in leftovers)
    cores = sum(p.cpu_cores for p in leftovers)
    me = _user(os.getuid())
    lines = [
        f"{len(leftovers)} leftover engine process{'es' if len(leftovers) > 1 else ''} of an earlier engine on "
        f"this host {'hold' if len(leftovers) > 1 else 'holds'} {rss / _GB:.2f} GB of memory and "
        f"{'keep' if len(leftovers) > 1 else 'keeps'} {cores:.1f} cores busy"
        + (f" ({memory.available_bytes / _GB:.1f} GB of {memory.total_bytes / _GB:.1f} GB available)" if memory else "")
        + ": syncs and generation here are slower while they run"
    ]
    for p in leftovers:
        owner = f", user {p.user}" if p.user != me else ""
        lines.append(
            f"  pid {p.pid}: {p.rss_bytes / _GB:.2f} GB, {100 * p.cpu_cores:.0f}% CPU, {p.title} ({p.why}{owner})"
        )
    pids = " ".join(str(p.pid) for p in leftovers)
    lines.append(f"end them, if no one uses them, with: kill -9 {pids} (vLLM's EngineCore ignores SIGTERM)")
    return "\n".join(lines)


def warn_leftovers() -> list[Leftover]:
    """Log :func:`leftovers_warning` on the ``wsync`` logger if this host has leftovers; return them.

    Never raises: a failure to look is logged at debug level and finds nothing.
    """
    try:
        leftovers = find_leftovers()
    except Exception:  # a diagnostic must never stop the engine from starting
        log.debug("looking for leftover engine processes failed", exc_info=True)
        return []
    if leftovers:
        log.warning("%s", leftovers_warning(leftovers, host_memory()))
    return leftovers
