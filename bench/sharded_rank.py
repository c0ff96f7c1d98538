"""One trainer rank of the sharded benchmark: ``python -m bench.sharded_rank`` (driven by :mod:`bench.sharded_case`).

Loads SmolLM2-135M, shards it with FSDP2 over gloo (``--world`` ranks on this host) and, per
repetition, measures each way of getting the trainer's weights into the engine, back to back:

- ``ceiling`` (2 ranks or more): a raw gloo broadcast of the same bytes from rank 0 to the other
  ranks over a group of their own (no engine, no wsync): what the wire on this host can do;
- ``gather``: :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient` ``sync(mode="gather")``;
- ``direct``: ``sync(mode="direct")``;
- ``gather_all``: the way users do it today: every parameter's ``full_tensor()`` first (the whole
  model on every rank), then one sync of the whole tensors (rank 0 sends).

Per run and rank it prints one JSON line: the wall time (seconds), the peak memory above the
rank's resident memory before the run (bytes; ``VmHWM`` after resetting it) and the bytes this
rank sent (bytes, from the plan). The client keeps no pack buffers between syncs, so every run
pays for its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.common import proc_memory, reset_peak_memory


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _measured(fn: Any) -> tuple[float, int, Any]:
    """Run ``fn`` after a barrier; its wall time (s), peak memory above the start (bytes), result."""
    dist.barrier()
    base = reset_peak_memory()
    t0 = time.monotonic()
    out = fn()
    wall = time.monotonic() - t0
    peak = max(0, proc_memory()[1] - base)
    return wall, peak, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sharded_rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int, default=32 << 20)
    args = p.parse_args(argv)

    from wsync_grpc.engines.models import load_causal_lm
    from wsync_grpc.tools.fsdp_rank import _shard, perturb
    from wsync_grpc.trainer.sharded import ShardedTrainerClient
    from wsync_grpc.trainer.sharded.source import DirectSource, ShardedTensors, full

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.master_port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    model = load_causal_lm(None)[0]
    _shard(model)
    raw = dist.new_group(backend="gloo") if args.world > 1 else None
    options = {"rpc_timeout_s": 300.0, "group_timeout_s": 300.0, "bucket_bytes": args.bucket_bytes}
    # digests off, as in the other sections: the digests case times what they add
    with ShardedTrainerClient([args.target], keep_buffers=False, digests=False, **options) as c:
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        ways = (["ceiling"] if raw is not None else []) + ["gather", "direct", "gather_all"]
        version = 0
        for rep in range(args.reps + 1):  # the first is a warm-up
            perturb(model, seed=rep + 1)
            for way in ways:
                version += 1
                name = f"bench-{way}-{version}"
                sent = 0
                if way == "ceiling":

                    def run() -> None:
                        buf = torch.empty(model_bytes, dtype=torch.uint8)
                        dist.broadcast(buf, src=0, group=raw)

                    sent = model_bytes if c.rank == 0 else 0
                elif way == "gather_all":

                    def run(name: str = name) -> Any:
                        whole = [(n, full(t).detach()) for n, t in model.named_parameters()]
                        return c.sync(whole, name, mode="gather")

                    sent = model_bytes if c.rank == 0 else 0
                else:

                    def run(name: str = name, way: str = way) -> Any:
                        return c.sync(model.named_parameters(), name, mode=way)  # type: ignore[arg-type]

                    if way == "gather":
                        sent = model_bytes if c.rank == 0 else 0
                    else:
                        pieces = DirectSource(ShardedTensors(model.named_parameters()), c._ranks).metadata()
                        sent = sum(math.prod(m.shape) * m.dtype.itemsize for m in pieces if m.src == c.rank)
                wall, peak, result = _measured(run)
                if rep > 0:
                    emit(
                        way=way, ranks=args.world, rank=c.rank, rep=rep, seconds=wall, peak_extra_bytes=peak,
                        sent_bytes=sent, model_bytes=model_bytes, largest_tensor_bytes=largest,
                        bucket_bytes=args.bucket_bytes,
                        buckets=getattr(result, "bucket_count", 0),
                    )  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
