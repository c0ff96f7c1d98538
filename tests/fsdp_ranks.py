"""Trainer ranks for the sharded-trainer tests: ``python -m wsync_grpc.tools.fsdp_rank`` processes, one per rank."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from support import ENV, free_port

LONG = 240.0
"""Bound, in seconds, of a whole rank run (loading and sharding SmolLM2 takes ~10 s per rank here)."""


class Rank:
    """One trainer rank's process and the JSON lines it printed so far (read by a thread)."""

    def __init__(self, rank: int, world: int, port: int, targets: Sequence[str], args: Sequence[str]) -> None:
        cmd = [
            sys.executable,
            "-m",
            "wsync_grpc.tools.fsdp_rank",
            f"--rank={rank}",
            f"--world={world}",
            f"--master-port={port}",
            f"--targets={','.join(targets)}",
            *args,
        ]
        self.rank = rank
        # stderr goes to a file (read at any time, never a full pipe that blocks the rank)
        with tempfile.NamedTemporaryFile(prefix=f"wsync-rank{rank}-", suffix=".log", delete=False) as f:
            self._stderr_path = Path(f.name)
        with self._stderr_path.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
        self.events: list[dict[str, Any]] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append({**json.loads(line), "at": time.monotonic()})

    def wait(self, timeout: float = LONG) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.stop()
        return rc

    def stop(self) -> None:
        """Kill the rank if it still runs and reap it; keep the end of its stderr in :attr:`stderr` (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr = self.stderr_tail()
        self._stderr_path.unlink(missing_ok=True)
        self._reader.join(10)

    def stderr_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters the rank wrote to stderr so far (what :meth:`stop` kept, once it ran)."""
        try:
            return self._stderr_path.read_text(errors="replace")[-chars:]
        except OSError:
            return self.stderr

    def first(self, event: str, **match: Any) -> dict[str, Any] | None:
        for e in self.events:
            if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    def wait_for(self, event: str, timeout: float = LONG, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.first(event, **match)
            if e is not None:
                return e
            if self.proc.poll() is not None:
                time.sleep(0.5)
                e = self.first(event, **match)
                if e is not None:
                    return e
                raise AssertionError(f"rank exited ({self.proc.returncode}) before {event} {match}: {self.events}")
            time.sleep(0.02)
        raise AssertionError(f"no {event} {match} within {timeout} s: {self.events}")


def start_ranks(targets: Sequence[str], *args: str, per_rank: Sequence[Sequence[str]] = ((), ())) -> list[Rank]:
    port = free_port()
    return [Rank(r, len(per_rank), port, targets, [*args, *extra]) for r, extra in enumerate(per_rank)]


@contextlib.contextmanager
def explained(ranks: Sequence[Rank]) -> Iterator[None]:
    """Add every rank's events and the end of its stderr to an assertion that fails inside the block; on the way
    out, however the block ends, stop every rank still running (:meth:`Rank.stop`: no rank outlives its test)."""
    try:
        yield
    except AssertionError as e:
        for r in ranks:
            r.stop()
        lines = [str(e)]
        for r in ranks:
            lines.append(f"--- rank {r.rank}: events {r.events}")
            lines.append(f"--- rank {r.rank}: stderr (end) {r.stderr}")
        raise AssertionError("\n".join(lines)) from e
    finally:
        for r in ranks:
            r.stop()
