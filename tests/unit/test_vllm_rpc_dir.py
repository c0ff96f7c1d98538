"""Where ``wsync serve --engine vllm`` has vLLM put its IPC socket files: a directory of the server's own.

The engine itself (its sockets in the directory, the directory gone after a SIGTERM, a SIGKILLed server's
removed by the next start) is checked end to end in ``tests/e2e/test_examples.py``; here, the choices around it
on real directories, without an engine.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from wsync_grpc.tools.engines.vllm_server import RPC_DIR_PREFIX, private_rpc_dir

NS = os.stat("/proc/self/ns/pid").st_ino  # this process's pid namespace


@pytest.fixture()
def tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short temporary directory (socket paths take at most 107 bytes) as ``tempfile.gettempdir()``."""
    path = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    yield path
    for p in sorted(path.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    path.rmdir()


def test_the_directory_is_the_servers_own_while_it_runs_and_gone_after(tmp: Path) -> None:
    with private_rpc_dir() as d:
        assert d is not None and d.parent == tmp and d.name.startswith(f"{RPC_DIR_PREFIX}{NS}-{os.getpid()}-")
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(d)
        assert d.stat().st_mode & 0o777 == 0o700
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(d / ("0" * 36)))  # as long a name as vLLM's (a uuid4)
    assert not d.exists() and "VLLM_RPC_BASE_PATH" not in os.environ


def test_a_dead_servers_directory_goes_and_a_running_or_unknown_ones_stays(tmp: Path) -> None:
    dead = tmp / f"{RPC_DIR_PREFIX}{NS}-999999999-abc"  # no process has that pid
    alive = tmp / f"{RPC_DIR_PREFIX}{NS}-{os.getppid()}-abc"
    elsewhere = tmp / f"{RPC_DIR_PREFIX}{NS + 1}-999999999-abc"  # another pid namespace: its pids are not seen
    other = tmp / f"{RPC_DIR_PREFIX}notapid"
    for d in (dead, alive, elsewhere, other):
        d.mkdir()
        (d / "f").touch()
    with private_rpc_dir() as d:
        assert d is not None
        assert not dead.exists() and alive.exists() and elsewhere.exists() and other.exists()


def test_a_path_set_by_the_caller_or_too_long_for_a_socket_is_left_to_vllm(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp))
    with private_rpc_dir() as d:
        assert d is None and os.environ["VLLM_RPC_BASE_PATH"] == str(tmp)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    deep = tmp / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with private_rpc_dir() as d:
        assert d is None and "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []
