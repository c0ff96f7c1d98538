"""No orphans (issue 42, item 4): what an engine forks ends with it, even when it is SIGKILLed.

Real processes, never mocked: a chain of forked Python processes, and a real ``wsync serve --engine vllm``
SIGKILLed once vLLM's engine core and worker exist. Each test touches only the processes it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

from wsync_grpc.launch import child_env, spawn_vllm_engine
from wsync_grpc.testing import free_port

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's"),
]

ENDS_WITHIN_S = 5.0

CHAIN = """
import multiprocessing as mp, os, sys, threading, time
import wsync_grpc.tools.engines  # what a spawned child of `wsync serve` imports (its parent's main module does)
from wsync_grpc.tools.orphans import end_forked_children_with_this_process, end_spawned_children_with_this_process

def grandchild(running):
    running.set()  # started: past the start-up that arms its parent-death signal
    time.sleep(600)

def child(path, method):
    ctx = mp.get_context(method)
    running = ctx.Event()
    g = ctx.Process(target=grandchild, args=(running,))
    g.start()
    running.wait(120)  # a spawned grandchild's imports take seconds on a loaded host
    with open(path, "w") as out:
        out.write(f"{os.getpid()} {g.pid}\\n")
    time.sleep(600)

def from_a_thread(path):
    ctx = mp.get_context("fork")
    running = ctx.Event()
    c = ctx.Process(target=grandchild, args=(running,))
    c.start()
    running.wait(120)
    with open(path, "w") as out:
        out.write(f"{c.pid}\\n")

if __name__ == "__main__":
    assert end_forked_children_with_this_process() and end_spawned_children_with_this_process()
    path, how = sys.argv[1:]
    if how == "thread":
        t = threading.Thread(target=from_a_thread, args=(path,))
        t.start()
        t.join()
    else:
        mp.get_context(how).Process(target=child, args=(path, how)).start()
    time.sleep(600)
"""
"""Forks or spawns (``fork``, ``spawn``) a child that does the same with a grandchild, or forks one child from a
thread that ends (``thread``); writes their pids once the last one runs (its start-up done), then waits to be killed."""


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (ended, or a zombie waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(condition: object, what: str, timeout_s: float) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _kill(pids: Iterable[int]) -> None:
    """SIGKILL whichever of ``pids`` still runs (this test's own processes only)."""
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


def _start_chain(tmp: Path, how: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    pids_file = tmp / f"{how}.pids"
    script = tmp / "chain.py"
    script.write_text(CHAIN)
    top = subprocess.Popen([sys.executable, str(script), str(pids_file), how], env=child_env())
    want = 1 if how == "thread" else 2

    def written() -> bool:
        assert top.poll() is None, f"the chain's top exited with {top.returncode}"
        return pids_file.exists() and len(pids_file.read_text().split()) == want

    _wait(written, "the chain is forked", 30)
    return top, [int(p) for p in pids_file.read_text().split()]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_chain_ends_with_its_killed_top(tmp_path: Path, method: str) -> None:
    top, below = _start_chain(tmp_path, method)
    try:
        child, grandchild = below
        assert psutil.Process(child).ppid() == top.pid
        assert psutil.Process(grandchild).ppid() == child
        top.kill()
        top.wait(10)
        t0 = time.monotonic()
        _wait(lambda: all(_gone(p) for p in below), "the child and grandchild end", ENDS_WITHIN_S)
        print(f"ended {time.monotonic() - t0:.2f} s after the SIGKILL")
    finally:
        top.kill()
        top.wait(10)
        _kill(below)


def test_a_child_forked_from_a_thread_that_ended_is_not_killed(tmp_path: Path) -> None:
    """A parent-death signal fires when the *thread* that forked ends: such a child is not armed."""
    top, (child,) = _start_chain(tmp_path, "thread")
    try:
        time.sleep(0.5)  # the forking thread has ended (joined): a signal would have come by now
        assert not _gone(child), "a child forked from a thread that ended was killed"
    finally:
        top.kill()
        top.wait(10)
        _kill([child])


LAUNCHER = """
import sys, time
from pathlib import Path
from wsync_grpc.launch import spawn_engine
end = sys.argv[3] == "end"
engine = spawn_engine(["--synthetic", "tiny", "--grace", "1"], port_file=Path(sys.argv[1]), log=Path(sys.argv[2]),
                      end_with_parent=end)
print(engine.pid, flush=True)
time.sleep(600)
"""
"""A launcher (as a Ray engine actor is) that starts ``wsync serve``, says its pid once it serves, and waits."""


@pytest.mark.parametrize("end", [True, False], ids=["end_with_parent", "default"])
def test_an_engine_started_to_end_with_its_launcher_ends_when_the_launcher_is_sigkilled(
    tmp_path: Path, end: bool
) -> None:
    """``spawn_engine(end_with_parent=True)`` (what ``wsync_grpc.ray``'s engine actor uses): the engine gets
    SIGKILL with its launcher, keeping its pid through the wrapper's exec; without it, the engine outlives it."""
    args = [str(tmp_path / "engine.port"), str(tmp_path / "engine.log"), "end" if end else "stay"]
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *args], stdout=subprocess.PIPE, env=child_env())
    pid = 0
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line, f"the launcher failed: {(tmp_path / 'engine.log').read_text(errors='replace')[-4000:]}"
        pid = int(line)
        assert psutil.Process(pid).ppid() == launcher.pid and "wsync_grpc.tools.cli" in " ".join(
            psutil.Process(pid).cmdline()
        )
        launcher.kill()
        launcher.wait(10)
        t0 = time.monotonic()
        if end:
            _wait(lambda: _gone(pid), "the engine ends with its launcher", ENDS_WITHIN_S)
            print(f"ended {time.monotonic() - t0:.2f} s after its launcher's SIGKILL")
        else:
            time.sleep(0.5)
            assert not _gone(pid), "an engine started without end_with_parent ended with its launcher"
    finally:
        launcher.kill()
        launcher.wait(10)
        if pid:
            _kill([pid])


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.vllm
def test_a_killed_vllm_server_leaves_no_vllm_process(tmp_path: Path, smollm2_dir: Path) -> None:
    """SIGKILL ``wsync serve --engine vllm`` once vLLM started its engine core and worker (before the model
    loads, to keep the test short): within 5 s, none of its ``VLLM::`` processes runs."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    t0 = time.monotonic()
    server = spawn_vllm_engine(
        smollm2_dir, port_file=tmp_path / "port", http_port=free_port(), log=tmp_path / "vllm.log", wait=False
    )
    below: list[psutil.Process] = []
    try:

        def worker_started() -> bool:
            assert server.process.poll() is None, server.output_tail()
            below[:] = psutil.Process(server.pid).children(recursive=True)
            titles = [_title(p) for p in below]
            return any(t.startswith("VLLM::EngineCore") for t in titles) and any(
                t.startswith("VLLM::Worker") for t in titles
            )

        _wait(worker_started, "vLLM starts its engine core and worker", timeout_s=120)
        engine = [p for p in below if _title(p).startswith("VLLM::")]
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait(10)
        killed = time.monotonic()
        try:
            _wait(lambda: all(_gone(p.pid) for p in below), "every process below the server ends", ENDS_WITHIN_S)
        except AssertionError as e:
            left = [(p.pid, _title(p), p.status()) for p in below if not _gone(p.pid)]
            raise AssertionError(f"{e}: still running {left}") from None
        print(
            f"{len(engine)} VLLM:: and {len(below) - len(engine)} other processes ended "
            f"{time.monotonic() - killed:.2f} s after the SIGKILL; {time.monotonic() - t0:.1f} s in all"
        )
    finally:
        server.kill()
        for p in below:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
