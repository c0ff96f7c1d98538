"""A sharded FSDP2 trainer syncing into running engines: ``python -m wsync_grpc.tools.demo_fsdp`` (``make demo-fsdp``).

1. starts ``--engines`` reference engines (default 2) serving SmolLM2-135M-Instruct;
2. starts ``--ranks`` trainer processes (default 2), each one rank of an FSDP2 trainer over gloo
   (``python -m wsync_grpc.tools.fsdp_rank``): the model is sharded with ``fully_shard``, so every
   parameter is a ``DTensor`` and no rank holds the whole model;
3. each rank trains ``--steps`` real AdamW steps and after each one syncs collectively through
   :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient`, once per send mode;
4. after every sync trainer rank 0 gathers the weights and checks that every engine's SHA-256 of
   every tensor equals its own and that every engine's greedy answer equals the trainer's.

Prints each rank's events; exit status 0 only if every sync and check succeeded on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from wsync_grpc.group.process_group import free_port
from wsync_grpc.tools.demo import engines
from wsync_grpc.trainer.sharded.peers import SEND_MODES


def _relay(rank: int, proc: subprocess.Popen[str], failures: list[str]) -> None:
    """Print rank ``rank``'s events as they come; record the failures they report."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        kind = e.pop("event")
        if kind == "synced":
            loss = f"loss {e['loss']:.3f}, " if e.get("loss") is not None else ""
            print(
                f"rank {rank}: {e['version']}: {loss}{e['buckets']} buckets, {e['wire_bytes'] / 1e6:.1f} MB "
                f"in {e['seconds']:.2f} s",
                flush=True,
            )
        elif kind == "checked":
            ok = "checksums and greedy answers match on every engine" if not e["failures"] else e["failures"]
            print(f"rank {rank}: {e['version']}: {ok}; answer {e['answer']!r}", flush=True)
            failures += [f"{e['version']}: {f}" for f in e["failures"]]
        elif kind == "error":
            print(f"rank {rank}: {e['version']}: {e['kind']}: {e['message']}", flush=True)
            failures.append(f"rank {rank}: {e['message']}")
        elif kind == "ready":
            print(f"rank {rank}: sharded with FSDP2, client ready", flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo; return the exit status."""
    t0 = time.monotonic()
    failures: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="wsync-demo-fsdp-") as tmp,
        engines(args.engines, None, "float32", Path(tmp)) as targets,
    ):
        port = free_port()
        procs = []
        for r in range(args.ranks):
            cmd = [
                sys.executable,
                "-m",
                "wsync_grpc.tools.fsdp_rank",
                f"--rank={r}",
                f"--world={args.ranks}",
                f"--master-port={port}",
                f"--targets={','.join(targets)}",
                f"--steps={args.steps}",
                f"--modes={args.modes}",
                "--train",
                "--check=all",
            ]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy()))
        relays = [threading.Thread(target=_relay, args=(r, p, failures), daemon=True) for r, p in enumerate(procs)]
        for t in relays:
            t.start()
        codes = [p.wait() for p in procs]
        for t in relays:
            t.join(10)
    failures += [f"rank {r} exited with {c}" for r, c in enumerate(codes) if c]
    print(f"total {time.monotonic() - t0:.1f} s", flush=True)
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print(
        f"all checks passed: {args.ranks} FSDP2 ranks, {args.steps} steps, modes {args.modes}, "
        f"{args.engines} engines, bit-exact",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m wsync_grpc.tools.demo_fsdp``."""
    p = argparse.ArgumentParser(prog="python -m wsync_grpc.tools.demo_fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="training steps, each followed by one sync per mode")
    p.add_argument("--ranks", type=int, default=2, help="FSDP2 trainer ranks (processes)")
    p.add_argument("--engines", type=int, default=2, help="engine processes to start")
    p.add_argument("--modes", default=",".join(SEND_MODES), help="send modes, comma-separated")
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: engines shut down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
