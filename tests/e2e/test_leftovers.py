"""``wsync serve`` names an earlier engine's processes left on this host (issue 44: leftovers said, not suffered).

Real leftovers, never mocked: a ``wsync serve`` whose launcher was SIGKILLed (adopted by pid 1), and the
``VLLM::EngineCore`` a SIGKILLed vLLM API server (vLLM's own: ``wsync serve --engine vllm``'s engine processes end
with it) leaves behind. Each test starts engines of its
own, since it kills them; each ends its leftovers with ``kill -9`` and checks that none remain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

from wsync_grpc.launch import VLLM_CPU_ENV, VLLM_TEST_ARGS, child_env, spawn_engine
from wsync_grpc.testing import free_port
from wsync_grpc.tools.leftovers import find_leftovers, host_memory, leftovers_warning

pytestmark = pytest.mark.timeout(180)

SYNTHETIC = ["--synthetic", "tiny", "--grace", "1"]

LAUNCHER = """
import sys, time
from pathlib import Path
from wsync_grpc.launch import spawn_engine
engine = spawn_engine({args!r}, port_file=Path(sys.argv[1]), log=Path(sys.argv[2]))
print(engine.pid, flush=True)
time.sleep(600)
"""
"""A launcher that starts an engine, says its pid once it serves, and waits to be killed."""


def _orphaned_engine(tmp: Path) -> int:
    """Start ``wsync serve --synthetic tiny`` from a launcher process, SIGKILL the launcher; the engine's pid."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.format(args=SYNTHETIC), str(tmp / "orphan.port"), str(tmp / "orphan.log")],
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line, f"the launcher failed: {(tmp / 'orphan.log').read_text(errors='replace')[-4000:]}"
        pid = int(line)
    finally:
        launcher.kill()
        launcher.wait(10)
    _wait(lambda: psutil.Process(pid).ppid() != launcher.pid, "the engine is adopted")
    return pid


def _wait(condition: object, what: str, timeout_s: float = 30.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _kill_and_check_gone(pids: Iterable[int]) -> None:
    """``kill -9`` each pid (as the warning says), then check that none of them runs any more."""
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, f"still running after kill -9: {alive}"
    assert not {p.pid for p in find_leftovers(cpu_sample_s=0)} & {p.pid for p in procs}


def test_serve_names_an_orphaned_engine_at_start_and_ends_nothing(tmp_path: Path) -> None:
    t0 = time.monotonic()
    orphan = _orphaned_engine(tmp_path)
    try:
        if psutil.Process(orphan).ppid() != 1:
            pytest.skip("orphans are adopted by a subreaper here, not pid 1")
        start = time.monotonic()
        found = {p.pid: p for p in find_leftovers()}
        assert time.monotonic() - start < 0.5
        assert orphan in found, found
        left = found[orphan]
        assert left.kind == "wsync serve"
        assert "wsync_grpc.tools.cli serve --synthetic tiny" in left.title
        assert left.rss_bytes > 50e6  # torch and the model
        assert left.cpu_cores >= 0.0
        assert leftovers_warning([], host_memory()) == ""  # nothing found, nothing said

        # A new engine says so in its log before it loads, and leaves the orphan running.
        engine = spawn_engine(SYNTHETIC, port_file=tmp_path / "new.port", log=tmp_path / "new.log")
        try:
            log = (tmp_path / "new.log").read_text()
            assert f"pid {orphan}: " in log, log
            assert f"kill -9 {orphan}" in log, log
            assert "GB available" in log, log
            assert psutil.Process(orphan).is_running()
            # The new engine is no leftover: its parent (this test) lives.
            assert engine.pid not in {p.pid for p in find_leftovers(cpu_sample_s=0)}
            print(log)
        finally:
            engine.stop()
    finally:
        _kill_and_check_gone([orphan])
    print(f"{time.monotonic() - t0:.1f} s")


def _vllm_own_server(model_dir: Path, tmp: Path) -> subprocess.Popen[bytes]:
    """vLLM's own OpenAI API server on ``model_dir`` (not ``wsync serve --engine vllm``, whose engine processes end
    with it), with the CPU settings of :func:`~wsync_grpc.launch.spawn_vllm_engine`; its output in ``tmp/vllm.log``."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        *VLLM_TEST_ARGS.split(),
    ]
    with (tmp / "vllm.log").open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(VLLM_CPU_ENV))


@pytest.mark.vllm
def test_a_killed_vllm_servers_engine_core_and_worker_are_named_then_ended(tmp_path: Path, smollm2_dir: Path) -> None:
    """SIGKILL vLLM's own API server once vLLM started its worker (before the model loads, to keep the test
    short): the engine core and the worker stay, named. (``wsync serve --engine vllm``'s end with it:
    test_no_orphans.py.)"""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    t0 = time.monotonic()
    server = _vllm_own_server(smollm2_dir, tmp_path)
    engine: list[psutil.Process] = []  # the engine core, then its worker
    try:

        def worker_started() -> bool:
            assert server.poll() is None, (tmp_path / "vllm.log").read_text(errors="replace")[-4000:]
            below = psutil.Process(server.pid).children(recursive=True)
            engine[:] = [p for p in below if _title(p).startswith(("VLLM::EngineCore", "VLLM::Worker"))]
            return len(engine) == 2

        _wait(worker_started, "vLLM starts its engine core and worker", timeout_s=120)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        core, worker = engine
        _wait(lambda: core.ppid() != server.pid, "the engine core is adopted")
        assert core.is_running() and worker.is_running(), "vLLM's processes ended with the server: none is left over"

        found = {p.pid: p for p in find_leftovers()}
        assert {core.pid, worker.pid} <= set(found), found
        assert (found[core.pid].kind, found[worker.pid].kind) == ("vllm", "vllm")
        assert found[core.pid].title == "VLLM::EngineCore"
        assert found[worker.pid].why == f"below pid {core.pid}"
        assert found[core.pid].rss_bytes > 100e6
        warning = leftovers_warning(list(found.values()), host_memory())
        assert f"pid {core.pid}: " in warning
        assert "VLLM::EngineCore (a vLLM engine process whose server is gone, adopted by pid" in warning
        assert f"kill -9 {' '.join(map(str, found))}" in warning
        print(warning)
    finally:
        server.kill()
        server.wait(10)
        below = [p for c in engine if c.is_running() for p in c.children(recursive=True)]
        _kill_and_check_gone([p.pid for p in engine] + [p.pid for p in below])
    print(f"{time.monotonic() - t0:.1f} s")
