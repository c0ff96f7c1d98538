"""The examples of the README and the guides run as written against real engine processes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from support import ENV, ROOT
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.testing import spawn_engine

pytestmark = pytest.mark.timeout(600)


@contextmanager
def serve(tmp_path: Path, *args: str) -> Iterator[str]:
    engine = spawn_engine(args, port_file=tmp_path / "port", env=ENV, timeout_s=120)
    try:
        yield engine.target
    finally:
        engine.stop(30)


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=500,
        env={**ENV, **(env or {})},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_bare_stub_example(tmp_path: Path) -> None:
    with serve(tmp_path, "--synthetic", "tiny", "--dtype", "bfloat16") as target:
        out = run_example("bare_stub.py", target)
        assert "engine serves all-halves: 20 tensors" in out
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(target))
        sums = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)
        for c in sums.checksums:
            assert c.sha256 == tensor_sha256(torch.full(tuple(c.shape), 0.5, dtype=torch.bfloat16)), c.name


@pytest.mark.slow
def test_minimal_trainer_example(tmp_path: Path) -> None:
    with serve(tmp_path) as target:
        out = run_example("minimal_trainer.py", target)
        assert [ln.split(":")[0] for ln in out.splitlines()] == ["step 1", "step 2", "step 3"]
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(target))
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=30).weight_version == "step-3"


def _marked(marker: str, run: str) -> list[str]:
    """The live processes (not zombies) whose environment has ``marker=run``: what a run left behind."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(marker) == run:
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or ())[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="engines end with their actor on Linux")
def test_ray_fleet_example() -> None:
    """Its local Ray cluster, 3 engines and 2 FSDP2 ranks as actors: 3 synced steps, an engine killed and left
    out of the 4th, restarted and caught up, bit-exact; nothing it started (Ray's processes included, which
    inherit its environment) outlives it."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    run = uuid.uuid4().hex
    out = run_example("ray_fleet.py", env={"WSYNC_EXAMPLE_RUN": run, "RAY_USAGE_STATS_ENABLED": "0"})
    lines = out.splitlines()
    engines = [ln.split()[2].rstrip(":") for ln in lines if ln.startswith("engine ray-fleet-")]
    assert len(engines) == 3, out
    assert any(ln.startswith("trainer: 2 FSDP2 ranks, their group formed through Ray") for ln in lines), out
    for step in (1, 2, 3):
        assert any(ln.startswith(f"step {step}: loss ") and ln.endswith("synced into 3 engines") for ln in lines), out
    old = engines[2]
    assert f"killed ray-fleet-2 (ray.kill): {old} gone" in lines, out
    assert any(ln.startswith("step 4: ") and ln.endswith(f"synced into 2 engines, left out {old}") for ln in lines)
    restarted = next(ln for ln in lines if ln.startswith("restarted by Ray: ray-fleet-2 serves at "))
    new = restarted.split()[6]
    assert new != old and f"(was {old})" in restarted, out
    assert f"catch_up: {new} brought to step-4" in lines, out
    assert "checked: 3 engines serve step-4, bit-exact with the trainer" in lines, out
    assert lines[-1] == "done", out
    deadline = time.monotonic() + 10
    while _marked("WSYNC_EXAMPLE_RUN", run) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _marked("WSYNC_EXAMPLE_RUN", run), "the example left processes behind"


def _readme_block(containing: str) -> list[str]:
    """The commands of the vLLM guide's ``bash`` block that contains ``containing``, continuation lines joined."""
    text = (ROOT / "docs" / "guides" / "vllm.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    block = next(b for b in blocks if containing in b)
    commands: list[str] = []
    pending = ""
    for line in block.splitlines():
        pending += line.rstrip().removesuffix("\\")
        if line.rstrip().endswith("\\"):
            pending += " "
            continue
        if pending.strip():
            commands.append(pending.strip())
        pending = ""
    return commands


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_the_readmes_vllm_commands_run_as_written(smollm2_dir: Path, request: pytest.FixtureRequest) -> None:
    """``wsync serve --engine vllm ... --vllm-args "--enforce-eager"``, the ``curl`` and ``wsync status``, by a shell.

    An engine of its own: the command that starts it, on the guide's ports, is what is checked. The ``pip``
    lines are the environment this suite already runs in; every
    other line runs exactly as the vLLM guide prints it. The engine runs with a temporary directory
    (``TMPDIR``) of its own, empty again once it stopped: vLLM's IPC sockets went in a directory of the
    server's, removed at its end (torch's caches may stay). A directory a SIGKILLed server left there is removed by
    the engine's start.
    """
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    commands = _readme_block("wsync serve --engine vllm")
    if smollm2_dir != Path.home() / ".cache" / "wsync" / "smollm2-135m-instruct":
        pytest.skip("the model is not where the guide's command reads it (WSYNC_CACHE_DIR is set)")
    if _port_in_use(50051) or _port_in_use(8000):
        pytest.skip("the guide's ports 50051/8000 are taken on this host")
    serve, curl, status = (next(c for c in commands if word in c) for word in ("wsync serve", "curl ", "wsync status"))
    assert all(c.startswith("pip ") for c in commands if c not in (serve, curl, status)), commands
    tmp = Path(tempfile.mkdtemp(prefix="t"))  # short: a socket's path takes at most 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    stale = tmp / f"wsync-vllm-{os.stat('/proc/self/ns/pid').st_ino}-999999999-x"  # a SIGKILLed server's (no such pid)
    stale.mkdir()
    with socket.socket(socket.AF_UNIX) as left_behind:
        left_behind.bind(str(stale / "0b7e5a2c"))  # one of vLLM's sockets in it
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{ENV.get('PATH', os.defpath)}", "TMPDIR": str(tmp)}
    env.pop("VLLM_RPC_BASE_PATH", None)
    proc = subprocess.Popen(
        ["bash", "-c", serve],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()[-3000:]
            r = subprocess.run(["bash", "-c", status], env=env, capture_output=True, text=True, timeout=60)
            if r.returncode == 0 and _port_in_use(8000):
                break
            assert time.monotonic() < deadline, r.stdout + r.stderr
            time.sleep(2)
        st = json.loads(r.stdout)
        assert st["state"] == "LIFECYCLE_STATE_UNINITIALIZED" and not st["dirty"], st
        out = subprocess.run(["bash", "-c", curl], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["model"] == str(smollm2_dir) and answer["choices"][0]["text"].strip(), answer
        assert answer["usage"]["completion_tokens"] == 8
        assert not stale.exists()
        rpc = [p.name for p in tmp.iterdir() if p.name.startswith("wsync-vllm-")]
        assert len(rpc) == 1 and any((tmp / rpc[0]).iterdir()), "vLLM's sockets are in the server's directory"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert shlex.split(serve)[-2:] == ["--vllm-args", "--enforce-eager"]
    left = sorted(p.name for p in tmp.iterdir() if p.is_socket() or p.name.startswith("wsync-vllm-"))
    assert left == [], f"the stopped engine left these in its temporary directory: {sorted(os.listdir(tmp))}"
