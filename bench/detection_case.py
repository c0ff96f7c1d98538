"""The detection case of the benchmarks: how long an engine takes to notice a trainer SIGKILLed mid-broadcast.

One engine process (:mod:`bench.engine`, serving a synthetic model; ``1gb`` by default, as the
other cases) is started once. Per apply mode (staged, then streaming), ``kills`` times over:

1. a trainer is started in a process of its own (:mod:`bench.detection_trainer`: it builds its
   weights, forms the group with :meth:`~wsync_grpc.trainer.client.TrainerClient.init` and starts
   one sync);
2. this process polls the engine's ``GetStatus`` every :data:`ARM_POLL_S` until the update of that
   sync has received some of its bytes but not all (``update.bytes_received`` above 0, above the
   kill's fraction of ``update.bytes_expected`` (:data:`KILL_AT`, so that kills land early and
   midway) and below it): the broadcast is under way;
3. it SIGKILLs the trainer, then polls ``GetStatus`` every :data:`POLL_S` until the engine reports
   ``state: FAILED`` for that update, at most :data:`GIVE_UP_S`;
4. it records the seconds from the kill to the first such reply (``seconds``), the reason the
   engine gave (``PEER_LOST`` expected) and how it noticed (:data:`PATHS`), and the engine's own
   time of the failure (``last_error.unix_seconds``) minus the kill's wall-clock time
   (``engine_seconds``: this host's processes share the clock).

A kill the engine notices through a broken receive rather than its ``Watch`` window (see below) does
not measure the window, so past ``kills`` the case goes on killing (up to twice ``kills``) until
:data:`MIN_WATCH_KILLS` kills of the mode were noticed by the window.

Nothing is done to the engine between kills: after a failure it has left the group, and the
killed trainer's lease ended with its connection, so the next trainer's plain ``init`` takes it
(``docs/failure-semantics.md``). After the kills of a mode one more trainer syncs to the end (the
recovery: the engine must then serve that version, clean and not paused, and not be ``FAILED``).

What the engine's detection time is made of (``wsync_grpc/service/watch.py``): the killed trainer's
held ``Watch`` call ends with its connection (gRPC's end-of-call callback, or the stream's own check
for a gone caller every ``GONE_POLL_S``); the engine then waits ``REATTACH_S`` for a bucket or a
re-attached ``Watch`` (a dropped connection of a live trainer is no death) before it declares the
trainer lost, one more ``REATTACH_S`` when a bucket still completes during that wait. A receive
posted in the group can also break first when the trainer's sockets close, which fails the update at
once (the ``group`` path of :data:`PATHS`). The case records both constants with its results.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.service import watch
from wsync_grpc.testing import child_env

if TYPE_CHECKING:
    from bench.run import Harness

ROOT = Path(__file__).resolve().parent.parent
MODES = ("staged", "streaming")
POLL_S = 0.01
"""Time between two ``GetStatus`` calls after the kill, in seconds (the resolution of ``seconds``)."""
ARM_POLL_S = 0.002
"""Time between two ``GetStatus`` calls while waiting for the broadcast to be under way, in seconds."""
GIVE_UP_S = 10.0
"""How long after the kill the case waits for ``FAILED`` before it records the kill as not detected, in seconds."""
START_S = 300.0
"""How long a trainer may take to build its weights, form the group and start its broadcast, in seconds."""
RPC_S = 10.0
"""Deadline of each ``GetStatus`` call, in seconds."""
KILL_AT = (0.0, 0.25, 0.5)
"""Kill ``k`` of a mode waits for more than ``KILL_AT[k % 3]`` of the update's bytes (a fraction) to have arrived."""
MIN_WATCH_KILLS = 3
"""Kills per mode the engine must notice by its ``Watch`` window (not by a broken receive) for the bound to be
measured; the case kills more trainers (up to twice ``kills``) until it has them."""
PATHS = {
    "the trainer's Watch call ended": "watch",
    "the weight-sync group broke": "group",
}
"""Start of a ``PEER_LOST`` message -> how the engine noticed: its held ``Watch`` ended, or a receive broke."""


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Trainer:
    """One :mod:`bench.detection_trainer` process; its stdout and stderr go to files under ``tmp``."""

    def __init__(self, tmp: Path, tag: str, target: str, model: str, mode: str, version: str, seed: int) -> None:
        self.out = tmp / f"trainer-{tag}.out"
        self.err = tmp / f"trainer-{tag}.err"
        cmd = [sys.executable, "-m", "bench.detection_trainer", f"--target={target}", f"--model={model}",
               f"--mode={mode}", f"--version={version}", f"--seed={seed}"]  # fmt: skip
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(), cwd=ROOT)

    def failure(self) -> str:
        """Why the process ended early: its exit status and the end of its stderr."""
        return f"trainer exited ({self.proc.returncode}): {self.err.read_text(errors='replace')[-2000:]}"

    def events(self) -> list[dict[str, Any]]:
        """The JSON lines it printed so far."""
        lines = self.out.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def end(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _by_watch(runs: list[dict[str, Any]]) -> int:
    return sum(r.get("path") == "watch" for r in runs)


def _status(stub: Any) -> pb.GetStatusResponse:
    reply: pb.GetStatusResponse = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_S)
    return reply


def wait_mid_broadcast(stub: Any, trainer: Trainer, version: str, at: float) -> pb.GetStatusResponse:
    """Poll ``GetStatus`` until the update installing ``version`` received more than ``at`` (a fraction) of its
    bytes, and at least one byte, but not all.

    Raises:
        RuntimeError: the trainer exited first, or the broadcast was not under way within :data:`START_S`.
    """
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        st = _status(stub)
        u = st.update
        mid = max(0.0, at * u.bytes_expected) < u.bytes_received < u.bytes_expected
        if st.HasField("update") and u.weight_version == version and mid:
            return st
        if trainer.proc.poll() is not None:
            raise RuntimeError(trainer.failure())
        time.sleep(ARM_POLL_S)
    raise RuntimeError(f"the broadcast of {version} was not under way within {START_S:g} s")


def one_kill(stub: Any, trainer: Trainer, version: str, at: float = 0.0) -> dict[str, Any]:
    """Wait for the broadcast (past ``at`` of its bytes), SIGKILL the trainer, poll until the update is FAILED.

    Returns the kill's record: ``seconds`` (kill to the first FAILED reply, seconds; ``None`` if none
    within :data:`GIVE_UP_S`), ``engine_seconds`` (kill to the engine's recorded failure time, seconds),
    ``reason``, ``path`` (see :data:`PATHS`), ``polls``, and the bytes received (of those expected) when the
    kill was sent.
    """
    armed = wait_mid_broadcast(stub, trainer, version, at)
    update_id = armed.update.update_id
    os.kill(trainer.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    killed_unix = time.time()
    polls = 0
    out: dict[str, Any] = {
        "update_id": update_id,
        "bytes_received": armed.update.bytes_received,
        "bytes_expected": armed.update.bytes_expected,
        "buckets_received": armed.update.buckets_received,
        "buckets_expected": armed.update.buckets_expected,
        "seconds": None,
        "engine_seconds": None,
        "reason": "",
        "path": "",
        "kill_at": at,
    }
    while True:
        st = _status(stub)
        polls += 1
        now = time.monotonic()
        if st.state == pb.LIFECYCLE_STATE_FAILED and st.last_error.update_id == update_id:
            out.update(seconds=now - killed, reason=st.last_error.reason, dirty=st.dirty, paused=st.paused)
            out["engine_seconds"] = st.last_error.unix_seconds - killed_unix
            out["weight_version"] = st.weight_version
            out["message"] = st.last_error.message[:300]
            out["path"] = next((v for k, v in PATHS.items() if st.last_error.message.startswith(k)), "other")
            break
        if now - killed > GIVE_UP_S:
            out["reason"] = f"still {pb.LifecycleState.Name(st.state)} after {GIVE_UP_S:g} s"
            break
        time.sleep(POLL_S)
    out["polls"] = polls
    trainer.end()
    return out


def recover(stub: Any, tmp: Path, target: str, model: str, mode: str, version: str) -> dict[str, Any]:
    """One more trainer syncs ``version`` to the end; whether the engine then serves it, clean and not paused."""
    trainer = Trainer(tmp, f"{mode}-recovery", target, model, mode, version, seed=99)
    try:
        trainer.proc.wait(START_S)
    except subprocess.TimeoutExpired:
        trainer.end()
    st = _status(stub)
    synced = [e for e in trainer.events() if e.get("event") == "synced"]
    # The trainer's close makes the engine leave the group: UNINITIALIZED (or READY), never FAILED.
    ok = bool(synced) and st.state != pb.LIFECYCLE_STATE_FAILED and st.weight_version == version
    ok = ok and not st.dirty and not st.paused
    out: dict[str, Any] = {
        "ok": ok,
        "state": pb.LifecycleState.Name(st.state),
        "weight_version": st.weight_version,
        "dirty": st.dirty,
        "paused": st.paused,
        "seconds": synced[0]["seconds"] if synced else None,
    }
    if trainer.proc.returncode != 0:
        out["error"] = trainer.failure()
    return out


def case_detection(h: Harness, model: str, kills: int) -> dict[str, Any]:
    """One engine serving ``model``; per apply mode ``kills`` trainers SIGKILLed mid-broadcast, then a recovery."""
    _say(f"detection: starting one engine ({model})")
    engine = h.start_engines(model, 1)[0]
    channel = grpc.insecure_channel(engine.grpc)
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
    runs: dict[str, list[dict[str, Any]]] = {}
    recovery: dict[str, dict[str, Any]] = {}
    try:
        for mode in MODES:
            runs[mode] = []
            k = 0
            # Past ``kills``, more (up to twice as many) until MIN_WATCH_KILLS were noticed by the Watch window.
            while k < kills or (_by_watch(runs[mode]) < MIN_WATCH_KILLS and k < 2 * kills):
                version = f"detection-{mode}-{k}"
                trainer = Trainer(h.tmp, f"{mode}-{k}", engine.grpc, model, mode, version, seed=k + 1)
                try:
                    r = one_kill(stub, trainer, version, KILL_AT[k % len(KILL_AT)])
                except RuntimeError as exc:  # recorded: the report counts it as a kill not detected
                    r = {"error": str(exc)[:2000], "seconds": None, "engine_seconds": None, "reason": "",
                         "bytes_received": 0, "bytes_expected": 1, "polls": 0}  # fmt: skip
                finally:
                    trainer.end()
                runs[mode].append(r)
                shown = "not detected" if r["seconds"] is None else f"{r['seconds']:.3f} s"
                _say(
                    f"  {mode} kill {k + 1}: at {r['bytes_received'] / r['bytes_expected']:.0%} of the bytes, "
                    f"FAILED {r['reason']} after {shown} (engine's own time {r['engine_seconds'] or 0:.3f} s, "
                    f"{r['polls']} polls, noticed by {r['path'] or '-'})"
                )
                k += 1
            recovery[mode] = recover(stub, h.tmp, engine.grpc, model, mode, f"detection-{mode}-recovered")
            _say(f"  {mode} recovery sync: {'ok' if recovery[mode]['ok'] else 'FAILED'} {recovery[mode]}")
    finally:
        channel.close()
        h.stop([engine])
    return {
        "model": model,
        "kills": kills,
        "poll_seconds": POLL_S,
        "give_up_seconds": GIVE_UP_S,
        "reattach_seconds": watch.REATTACH_S,
        "gone_poll_seconds": watch.GONE_POLL_S,
        "kill_at": list(KILL_AT),
        "min_watch_kills": MIN_WATCH_KILLS,
        "runs": runs,
        "recovery": recovery,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
