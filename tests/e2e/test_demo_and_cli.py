"""The main job and the command line, run as a user runs them (separate processes)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ENV, ROOT

from wsync_grpc.testing import spawn_engine

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_demo_one_step_syncs_smollm2_into_two_engines() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.demo", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=540,
        env=ENV,
        cwd=ROOT,
    )
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    assert "all checks passed: 1 steps synced into 2 engines, bit-exact" in out
    assert out.count("all 272 tensor checksums match") == 2
    assert out.count("greedy (step-1): same") == 2
    assert out.count("stopped (exit 0)") == 2  # engines shut down cleanly on SIGTERM
    assert re.search(r"sync step-1: \d+ buckets, 538\.1 MB to 2 engines", out), out[-3000:]


def _wsync(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_cli_serve_status_pause_resume_and_sigterm(tmp_path: Path) -> None:
    engine = spawn_engine(
        ["--synthetic", "tiny"], port_file=tmp_path / "port", log=subprocess.PIPE, env=ENV, timeout_s=60
    )
    proc = engine.process
    try:
        target = engine.target
        st = json.loads(_wsync("status", "--target", target).stdout)
        assert st["state"] == "LIFECYCLE_STATE_UNINITIALIZED" and st["paused"] is False
        assert st["engine"]["tensor_count"] == 20
        paused = json.loads(_wsync("pause", "--mode", "keep", "--target", target).stdout)
        assert paused["mode"] == "PAUSE_MODE_KEEP" and paused["already_paused"] is False
        again = json.loads(_wsync("pause", "--mode", "keep", "--target", target).stdout)
        assert again["already_paused"] is True  # idempotent
        assert json.loads(_wsync("status", "--target", target).stdout)["paused"] is True
        resumed = json.loads(_wsync("resume", "--target", target).stdout)
        assert resumed["was_paused"] is True
        bad = _wsync("leave", "--target", "127.0.0.1:1", "--timeout", "2")
        assert bad.returncode == 1 and "UNAVAILABLE" in bad.stderr
        sums = json.loads(_wsync("checksums", "model.norm.weight", "--target", target).stdout)
        assert len(sums["checksums"][0]["sha256"]) == 64
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, out
        assert "listening on 127.0.0.1:" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
