"""Starting and stopping wsync engines as processes: the launcher room.

An engine is started as a child process that writes a ready file once it serves; what a trainer
needs of it is its address (:attr:`EngineProcess.target`, ``host:port``), which it gives to a
:class:`~wsync_grpc.trainer.client.TrainerClient`.

- :func:`spawn_engine` starts ``python -m wsync_grpc.tools.cli serve ARGS --port 0 --port-file F``
  and waits until the port file appears; :func:`spawn_vllm_engine` does so for
  ``wsync serve --engine vllm`` (the ``vllm`` extra in the child; this module does not import
  vLLM); :func:`spawn_process` does the same for any command that writes a ready file once it
  serves (a custom launcher, a benchmark's engine). Each returns an :class:`EngineProcess`: its
  address, its process, its output, a graceful :meth:`~EngineProcess.stop`. A process that exits
  before it is ready, or is not ready in time, fails the start at once with the tail of its output
  (:class:`EngineStartError`, :class:`EngineStartTimeout`).
- :func:`wait_all` waits for many engines started with ``wait=False`` under one deadline;
  :func:`stop_all` stops many at once.
- :func:`child_env` is the environment that lets a child process import this package and the
  generated ``wsync.v1`` code from a source checkout; :func:`cli_command` is the ``wsync`` CLI's
  command line with this interpreter.
- ``end_with_parent=True`` (every ``spawn_*``; :func:`ending_with_parent` for a command line of one's own)
  has the engine killed when the process that started it ends, even by SIGKILL: a supervisor (a Ray actor,
  :mod:`wsync_grpc.ray`) that dies leaves no engine behind. ``wsync serve`` ends vLLM's processes with it
  in turn (:mod:`wsync_grpc.tools.orphans`).

Times are in seconds. This module imports nothing beyond the standard library (no gRPC, torch or
engine code: the engines run in their own processes), and nothing in the library below it (core,
wire, group, worker, transports, service, trainer, engines) imports it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import NoReturn

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "SOURCE_ROOT",
    "VLLM_CPU_ENV",
    "VLLM_CPU_TP_ENV",
    "VLLM_START_TIMEOUT_S",
    "VLLM_TEST_ARGS",
    "EngineProcess",
    "EngineStartError",
    "EngineStartTimeout",
    "child_env",
    "cli_command",
    "ending_with_parent",
    "spawn_engine",
    "spawn_process",
    "spawn_vllm_engine",
    "stop_all",
    "vllm_cpu_binds",
    "wait_all",
]

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The directory holding the ``wsync_grpc`` package (the repository root in a source checkout)."""

DEFAULT_START_TIMEOUT_S = 120.0
"""How long :func:`spawn_engine` and :func:`spawn_process` wait for the ready file by default, in seconds."""

OUTPUT_TAIL_CHARS = 4000
"""How many trailing characters of an engine's output go into an error message."""

_POLL_S = 0.05


class EngineStartError(RuntimeError):
    """An engine process exited before it wrote its ready file, or did not write it in time.

    Attributes:
        name: the engine's name (for messages).
        returncode: its exit status, ``None`` if it was still running (then it has been killed).
        output: the tail of its output (empty when the output was discarded).
    """

    def __init__(self, message: str, *, name: str, returncode: int | None, output: str) -> None:
        super().__init__(message)
        self.name = name
        self.returncode = returncode
        self.output = output


class EngineStartTimeout(EngineStartError, TimeoutError):
    """An engine process did not write its ready file within the timeout; it has been killed."""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that must import ``wsync_grpc`` and ``wsync.v1``.

    ``PYTHONPATH`` starts with :data:`SOURCE_ROOT` and its ``generated/`` directory (where a
    source checkout keeps ``wsync.v1``), followed by any ``PYTHONPATH`` already set; ``extra``
    is applied last (e.g. ``{"WSYNC_LOG_LEVEL": "INFO"}``).
    """
    paths = [str(SOURCE_ROOT), str(SOURCE_ROOT / "generated")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(extra or {})}


def cli_command(*args: str) -> list[str]:
    """``[python, -m, wsync_grpc.tools.cli, *args]`` with this interpreter."""
    return [sys.executable, "-m", "wsync_grpc.tools.cli", *args]


_END_WITH_PARENT = """\
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the parent ended before the signal was armed: it would have killed this process
os.execv(sys.argv[2], sys.argv[2:])
"""
"""Run by :func:`ending_with_parent`'s wrapper: arm the parent-death signal, check the parent, exec the command."""


def ending_with_parent(command: Sequence[str]) -> list[str]:
    """``command`` run so that it gets SIGKILL when the thread that starts it (and so its process) ends.

    On Linux the command runs under a short wrapper (``python -I -S -c ...``, a few milliseconds) that sets
    its parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), exits if its parent is already gone,
    then execs ``command``: the signal survives the ``exec``, and the child keeps the wrapper's pid.
    The kernel sends it when the *thread* that forked the child ends, so start the child from a thread that
    lives as long as the child should (a process's main thread; a Ray actor's methods run on its worker's
    main thread). Elsewhere ``command`` is returned unchanged: nothing ends the child with its parent.

    Args:
        command: the full command line; its first item must be a path (``sys.executable`` is).
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _END_WITH_PARENT, str(os.getpid()), *command]


class EngineProcess:
    """An engine running in a child process, with the file it writes once it serves.

    Use it as a context manager to :meth:`stop` it at the end. stdout and stderr go to
    :attr:`log` (a file), to a pipe (read them from :attr:`process`) or nowhere.

    Attributes:
        process: the child process (its output as bytes).
        ready_file: the file the child writes once it serves (a port file for the CLI).
        log: the file holding the child's stdout and stderr, or ``None``.
        name: a name for messages.
        host: the host in :attr:`target`.
        ready_text: the ready file's content, stripped; ``None`` until :meth:`wait_ready` returns.
        killed: whether :meth:`stop` or :meth:`kill` had to SIGKILL the child.
    """

    def __init__(
        self, process: subprocess.Popen[bytes], ready_file: Path, log: Path | None, *, name: str, host: str
    ) -> None:
        self.process = process
        self.ready_file = ready_file
        self.log = log
        self.name = name
        self.host = host
        self.ready_text: str | None = None
        self.killed = False

    @property
    def target(self) -> str:
        """``host:port`` from the port file, for clients.

        Raises:
            RuntimeError: the engine is not ready yet (see :meth:`wait_ready`).
            ValueError: the ready file does not hold a port number.
        """
        if self.ready_text is None:
            raise RuntimeError(f"engine {self.name} is not ready yet")
        return f"{self.host}:{int(self.ready_text)}"

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def wait_ready(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> str:
        """Wait up to ``timeout_s`` seconds for the ready file; return (and keep) its content, stripped.

        The file must appear whole (the CLI writes it with a rename), so it is read once.

        Raises:
            EngineStartError: the child exited first (the message holds the tail of its output).
            EngineStartTimeout: the file did not appear in time; the child has been killed.
        """
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                rc = self.process.returncode
                self._fail(EngineStartError, f"exited with {rc} before it served", rc)
            if time.monotonic() > deadline:
                self.kill()
                self._fail(EngineStartTimeout, f"did not serve within {timeout_s:g} s", None)
            time.sleep(_POLL_S)
        self.ready_text = self.ready_file.read_text().strip()
        return self.ready_text

    def _fail(self, kind: type[EngineStartError], what: str, rc: int | None) -> NoReturn:
        out = self.output_tail()
        where = f" (log {self.log})" if self.log is not None else ""
        raise kind(f"engine {self.name} {what}{where}: {out}", name=self.name, returncode=rc, output=out)

    def output_tail(self, chars: int = OUTPUT_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the child's output so far.

        From the log file; from the pipe only once the child has exited (this reads the pipe to
        its end); empty when the output is discarded.
        """
        if self.log is not None:
            return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""
        if self.process.stdout is not None and self.process.poll() is not None:
            return self.process.stdout.read().decode(errors="replace")[-chars:]
        return ""

    def kill(self, wait_s: float = 10.0) -> None:
        """SIGKILL the child if it still runs, then wait up to ``wait_s`` seconds for it to be reaped."""
        if self.process.poll() is None:
            self.process.kill()
            self.killed = True
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(wait_s)

    def terminate(self) -> None:
        """Send SIGTERM (the engine's graceful shutdown) if the child still runs; do not wait."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace_s`` seconds, then SIGKILL; return the exit status (``None`` if unreaped)."""
        self.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.process.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def spawn_process(
    command: Sequence[str],
    *,
    ready_file: Path,
    log: Path | int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    wait: bool = True,
    name: str | None = None,
    host: str = "127.0.0.1",
    end_with_parent: bool = False,
) -> EngineProcess:
    """Start ``command`` and (unless ``wait=False``) wait until it writes ``ready_file``.

    Args:
        command: the full command line; the child must write ``ready_file`` (whole, e.g. by a
            rename) once it serves.
        ready_file: removed first if it exists, so a stale file is never taken for readiness.
        log: a path (stdout and stderr go to that file, truncated), ``subprocess.PIPE`` (read
            them from :attr:`EngineProcess.process`) or ``None`` (discarded).
        env: the child's environment; ``None`` inherits this process's (see :func:`child_env`).
        cwd: the child's working directory; ``None`` keeps this process's.
        timeout_s: how long to wait for ``ready_file``, in seconds.
        wait: ``False`` returns at once; call :meth:`EngineProcess.wait_ready` or :func:`wait_all`.
        name: for messages; default the ready file's stem.
        host: the host in :attr:`EngineProcess.target`.
        end_with_parent: kill the child (SIGKILL) when the thread calling this ends, this process with it
            (Linux; see :func:`ending_with_parent`).

    Raises:
        OSError: the command could not be started.
        EngineStartError: the child exited before it wrote ``ready_file`` (the message holds the
            tail of its output).
        EngineStartTimeout: it did not write ``ready_file`` within ``timeout_s`` seconds; it has
            been killed.
    """
    ready_file.unlink(missing_ok=True)
    if end_with_parent:
        command = ending_with_parent(command)
    if isinstance(log, Path):
        with log.open("wb") as out:
            proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        log_path: Path | None = log
    else:
        stdout = subprocess.DEVNULL if log is None else log
        proc = subprocess.Popen(list(command), stdout=stdout, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        log_path = None
    engine = EngineProcess(proc, ready_file, log_path, name=name or ready_file.stem, host=host)
    if wait:
        engine.wait_ready(timeout_s)
    return engine


def spawn_engine(
    args: Sequence[str] = (),
    *,
    port_file: Path,
    log: Path | int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    wait: bool = True,
    name: str | None = None,
    host: str = "127.0.0.1",
    end_with_parent: bool = False,
) -> EngineProcess:
    """Start ``python -m wsync_grpc.tools.cli serve ARGS --port 0 --port-file PORT_FILE``; wait until it serves.

    ``args`` picks the engine and its options, e.g. ``["--synthetic", "tiny", "--grace", "1"]``.
    Use :attr:`EngineProcess.target` as its address. ``port_file`` is its ready file (the CLI
    writes its port there, whole, once it serves); ``timeout_s`` is how long to wait for it, in
    seconds; the other arguments are :func:`spawn_process`'s (``host`` names the engine in
    :attr:`EngineProcess.target`: pass ``--host`` in ``args`` to bind elsewhere than loopback).

    Raises:
        OSError: the command could not be started.
        EngineStartError: the engine exited before it served (the message holds the tail of its output).
        EngineStartTimeout: it did not serve within ``timeout_s`` seconds; it has been killed.
    """
    command = cli_command("serve", *args, "--port", "0", "--port-file", str(port_file))
    return spawn_process(
        command,
        ready_file=port_file,
        log=log,
        env=env,
        cwd=cwd,
        timeout_s=timeout_s,
        wait=wait,
        name=name,
        host=host,
        end_with_parent=end_with_parent,
    )


def wait_all(engines: Sequence[EngineProcess], timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
    """Wait for every engine's ready file, all within one ``timeout_s`` seconds from now.

    Raises:
        EngineStartError, EngineStartTimeout: for the first engine that fails (the others are
            left running: stop them, e.g. with :func:`stop_all`).
    """
    deadline = time.monotonic() + timeout_s
    for e in engines:
        e.wait_ready(max(0.0, deadline - time.monotonic()))


def stop_all(engines: Sequence[EngineProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every engine first, then wait up to ``grace_s`` seconds for each in turn and SIGKILL it if needed."""
    for e in engines:
        e.terminate()
    for e in engines:
        e.stop(grace_s)


VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""Environment a vLLM engine needs on a small CPU host: 1 GiB of KV cache (enough for SmolLM2-135M)."""

VLLM_CPU_TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""Added for tensor parallel workers on a host with fewer cores than workers (no core pinning, one thread each)."""


def vllm_cpu_binds(count: int, cpus: Sequence[int] | None = None) -> list[dict[str, str]]:
    """Environment for ``count`` single-worker vLLM CPU engines started on one host: each its own cores.

    vLLM's CPU backend binds each worker's forward to cores it picks itself (``VLLM_CPU_OMP_THREADS_BIND=auto``:
    the first cores of a NUMA node, one left to the engine's other processes), the same ones for every engine on
    the host, so engines started side by side would share one core and leave the others idle. Here engine ``i``
    gets its own contiguous share of ``cpus`` as ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's ``"0,1"`` list form), or
    one core round-robin where there are fewer cores than engines. Nothing is set for one engine, or where the
    caller's environment already sets ``VLLM_CPU_OMP_THREADS_BIND`` (its choice stands).

    Args:
        count: engines to start (each with tensor parallel size 1).
        cpus: the cores to share out; default this process's CPU affinity (``os.sched_getaffinity``).

    Returns:
        ``count`` dicts, engine ``i``'s variables at ``[i]`` (pass each as ``spawn_vllm_engine(env=...)``).
    """
    if count <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [{} for _ in range(count)]
    pool = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(pool) < count:
        shares = [[pool[i % len(pool)]] for i in range(count)]
    else:
        shares = [pool[i * len(pool) // count : (i + 1) * len(pool) // count] for i in range(count)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, share))} for share in shares]


VLLM_TEST_ARGS = "--enforce-eager --max-model-len 1024"
"""vLLM arguments for tests, demo and bench: no torch.compile warm-up (a minute on a cold CPU host)."""

VLLM_START_TIMEOUT_S = 300.0
"""How long :func:`spawn_vllm_engine` waits for its port file by default, in seconds (vLLM loads the model first)."""


def spawn_vllm_engine(
    model_dir: Path,
    *,
    port_file: Path,
    http_port: int,
    tensor_parallel_size: int = 1,
    vllm_args: str = VLLM_TEST_ARGS,
    env: Mapping[str, str] | None = None,
    log: Path | int | None = None,
    timeout_s: float = VLLM_START_TIMEOUT_S,
    wait: bool = True,
    name: str | None = None,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    end_with_parent: bool = False,
) -> EngineProcess:
    """Start ``wsync serve --engine vllm`` on ``model_dir`` (gRPC on a free port, HTTP on ``http_port``).

    The child needs the ``vllm`` extra; this process does not import vLLM. Its environment is
    :func:`child_env` plus :data:`VLLM_CPU_ENV` (and :data:`VLLM_CPU_TP_ENV` for more than one
    worker), then ``env``. Stop it with :meth:`EngineProcess.stop`: vLLM's engine core and worker
    processes end with it.

    Args:
        model_dir: the model's directory (config, tokenizer and safetensors weights).
        port_file: the file the engine writes its gRPC port to once it serves (see :func:`spawn_engine`).
        http_port: the port of vLLM's OpenAI-compatible HTTP API.
        tensor_parallel_size: vLLM's tensor parallel workers.
        vllm_args: further vLLM arguments, as one string.
        env: variables set for the child on top of the ones above.
        log, wait, name: as for :func:`spawn_process`.
        timeout_s: how long to wait for ``port_file``, in seconds.
        extra_args: further ``wsync serve`` arguments (e.g. ``["--checkpoint-root", DIR]``).
        host, end_with_parent: as for :func:`spawn_engine`.

    Raises:
        OSError: the command could not be started.
        EngineStartError: the engine exited before it served (the message holds the tail of its output).
        EngineStartTimeout: it did not serve within ``timeout_s`` seconds; it has been killed.
    """
    extra = dict(VLLM_CPU_ENV)
    if tensor_parallel_size > 1:
        extra.update(VLLM_CPU_TP_ENV)
    extra.update(env or {})
    args = [
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--http-port",
        str(http_port),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--vllm-args",
        vllm_args,
        *extra_args,
    ]
    return spawn_engine(
        args,
        port_file=port_file,
        log=log,
        env=child_env(extra),
        timeout_s=timeout_s,
        wait=wait,
        name=name,
        host=host,
        end_with_parent=end_with_parent,
    )
