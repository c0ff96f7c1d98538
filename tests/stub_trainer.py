"""A trainer written with nothing but the generated stub and torch.distributed.

Run as a separate process by the servicer tests: it joins the weight-sync
group as rank 0, streams Prepare, broadcasts the buckets of a synthetic model
(seeded) and calls Complete, then prints one JSON line with the outcome.
``--die-after-buckets N`` SIGKILLs itself after N buckets (fault injection);
``--no-broadcast`` prepares and then never broadcasts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import grpc
import torch
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.engines import synthetic
from wsync_grpc.group.process_group import join_group
from wsync_grpc.group.waits import wait_work
from wsync_grpc.wire.lease import lease_channel

ALIGN = 256


def plan(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, int]]]:
    buckets: list[list[tuple[str, int]]] = [[]]
    off = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if buckets[-1] and off + n > bucket_bytes:
            buckets.append([])
            off = 0
        buckets[-1].append((name, off))
        off = -(-(off + n) // ALIGN) * ALIGN
    return buckets


def bucket_size(tensors: dict[str, torch.Tensor], b: list[tuple[str, int]]) -> int:
    name, off = b[-1]
    t = tensors[name]
    return off + t.numel() * t.element_size()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", choices=["flattened", "individual"], default="flattened")
    p.add_argument("--apply", choices=["staged", "streaming"], default="staged")
    p.add_argument("--bucket-bytes", type=int, default=64 << 10)
    p.add_argument("--version", default="v1")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--die-after-buckets", type=int, default=-1)
    p.add_argument("--no-broadcast", action="store_true")
    p.add_argument("--skip-init", action="store_true")
    a = p.parse_args()

    tensors = synthetic.build(a.preset, dtype=getattr(torch, a.dtype), seed=a.seed)
    # One caller: the channel keeps the lease credential Init (or Prepare) issues and presents it.
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(lease_channel(grpc.insecure_channel(a.target))[0])
    out: dict[str, object] = {}
    if not a.skip_init:
        # A new trainer forms a new group: whatever group the engine had is gone.
        stub.Leave(pb.LeaveRequest(), timeout=a.timeout)
        init = pb.InitRequest(master_address="127.0.0.1", master_port=a.port, rank_offset=1, world_size=2)
        init.timeout.FromMilliseconds(int(a.timeout * 1000))
        fut = stub.Init.future(init, timeout=a.timeout + 10)  # ask the engine before blocking in the join
        group = join_group(master_address="127.0.0.1", master_port=a.port, rank=0, world_size=2, timeout_s=a.timeout)
        fut.result()
        # Hold the lease as a trainer does: this process's death ends the call and frees the engine at once.
        keepalive = stub.KeepAlive(pb.KeepAliveRequest())
        threading.Thread(target=lambda: [None for _ in keepalive], daemon=True).start()
    buckets = plan(tensors, a.bucket_bytes)
    layout = pb.BUCKET_LAYOUT_FLATTENED if a.layout == "flattened" else pb.BUCKET_LAYOUT_INDIVIDUAL
    specs = []
    for i, b in enumerate(buckets):
        spec = pb.BucketSpec(index=i)
        for name, off in b:
            t = tensors[name]
            spec.tensors.add(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), offset_bytes=off)
        if a.layout == "flattened":
            spec.size_bytes = bucket_size(tensors, b)
        else:
            spec.size_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n, _ in b)
        specs.append(spec)
    header = pb.PrepareHeader(
        weight_version=a.version,
        layout=layout,
        apply_mode=pb.APPLY_MODE_STAGED if a.apply == "staged" else pb.APPLY_MODE_STREAMING,
        bucket_count=len(specs),
        total_bytes=sum(s.size_bytes for s in specs),
    )

    def stream():  # type: ignore[no-untyped-def]
        yield pb.PrepareRequest(header=header)
        for s in specs:
            yield pb.PrepareRequest(bucket=s)

    t0 = time.monotonic()
    prep = stub.Prepare(stream(), timeout=a.timeout)
    out["prepare_seconds"] = time.monotonic() - t0
    out["update_id"] = prep.update_id
    if a.no_broadcast:
        print(json.dumps(out), flush=True)
        return 0
    for i, (b, spec) in enumerate(zip(buckets, specs, strict=True)):
        if i == a.die_after_buckets:
            print(json.dumps({"dying_after": i}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if a.layout == "flattened":
            flat = torch.zeros(spec.size_bytes, dtype=torch.uint8)
            for name, off in b:
                t = tensors[name]
                flat[off : off + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8)
            wait_work(group.broadcast(flat), time.monotonic() + a.timeout)
        else:
            for name, _ in b:
                wait_work(group.broadcast(tensors[name].contiguous()), time.monotonic() + a.timeout)
    try:
        done = stub.Complete(pb.CompleteRequest(update_id=prep.update_id, flush_cache=True), timeout=a.timeout)
        out.update(ok=True, weight_version=done.weight_version, tensors=done.tensor_count, bytes=done.bytes_received)
    except grpc.RpcError as e:
        out.update(ok=False, code=e.code().name, details=e.details())  # type: ignore[attr-defined]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
