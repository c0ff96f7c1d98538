"""A trainer written with nothing but the generated stub and torch.distributed.

Run as a separate process by the servicer tests: it joins the weight-sync
group as rank 0, streams Prepare, broadcasts the buckets of a synthetic model
(seeded) and calls Complete, then prints one JSON line with the outcome.
``--die-after-buckets N`` SIGKILLs itself after N buckets (fault injection);
``--no-broadcast`` prepares and then never broadcasts. ``--digests spec`` puts each
bucket's XXH3-128 digest (hashed here with ``xxhash``, not with wsync's code) in its
spec, ``--digests follow`` declares it with an Update once the bucket is on the wire;
``--flip-bucket N`` flips one byte of bucket N after hashing it, ``--skip-digest N``
never declares bucket N's digest (N = -1: the last bucket); ``--verify-only`` calls ``Complete(verify_only)`` first.
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
import xxhash
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.engines import synthetic
from wsync_grpc.group.process_group import join_group
from wsync_grpc.group.waits import wait_work
from wsync_grpc.wire.lease import lease_channel
from wsync_grpc.wire.status import error_info

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
    p.add_argument("--digests", choices=["none", "spec", "follow"], default="none")
    p.add_argument("--flip-bucket", type=int, default=None)
    p.add_argument("--skip-digest", type=int, default=None)
    p.add_argument("--verify-only", action="store_true")
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
    wires: list[list[torch.Tensor]] = []  # per bucket: what goes on the wire (one flat buffer, or each tensor)
    digests: list[pb.BucketDigest] = []  # per bucket: the digest of its bytes as hashed before any flip
    for i, b in enumerate(buckets):
        spec = pb.BucketSpec(index=i)
        for name, off in b:
            t = tensors[name]
            spec.tensors.add(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), offset_bytes=off)
        if a.layout == "flattened":
            spec.size_bytes = bucket_size(tensors, b)
            flat = torch.zeros(spec.size_bytes, dtype=torch.uint8)
            for name, off in b:
                t = tensors[name]
                flat[off : off + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8)
            wires.append([flat])
        else:
            spec.size_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n, _ in b)
            wires.append([tensors[n].contiguous() for n, _ in b])
        h = xxhash.xxh3_128()
        for w in wires[-1]:
            h.update(w.reshape(-1).view(torch.uint8).numpy().tobytes())
        digest = pb.BucketDigest(algorithm=pb.DIGEST_ALGORITHM_XXH3_128, value=h.digest())
        digests.append(digest)
        if a.digests == "spec":
            spec.digest.CopyFrom(digest)
        specs.append(spec)
        if a.flip_bucket is not None and a.flip_bucket % len(buckets) == i:  # corrupted after it was hashed
            first = wires[-1][0].reshape(-1).view(torch.uint8)
            first[0] ^= 0xFF
    header = pb.PrepareHeader(
        weight_version=a.version,
        layout=layout,
        apply_mode=pb.APPLY_MODE_STAGED if a.apply == "staged" else pb.APPLY_MODE_STREAMING,
        bucket_count=len(specs),
        total_bytes=sum(s.size_bytes for s in specs),
        digests_follow=a.digests == "follow",
    )

    def stream():  # type: ignore[no-untyped-def]
        yield pb.PrepareRequest(header=header)
        for s in specs:
            yield pb.PrepareRequest(bucket=s)

    t0 = time.monotonic()
    prep = stub.Prepare(stream(), timeout=a.timeout)
    out["prepare_seconds"] = time.monotonic() - t0
    out["buckets"] = len(specs)
    out["update_id"] = prep.update_id
    if a.no_broadcast:
        print(json.dumps(out), flush=True)
        return 0
    for i, wire in enumerate(wires):
        if i == a.die_after_buckets:
            print(json.dumps({"dying_after": i}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        works = [group.broadcast(w) for w in wire]
        if a.digests == "follow" and a.skip_digest not in (i, i - len(wires)):
            declared = pb.DeclaredDigest(bucket_index=i, digest=digests[i])
            stub.Update(pb.UpdateRequest(update_id=prep.update_id, digests=[declared]), timeout=a.timeout)
        for w in works:
            wait_work(w, time.monotonic() + a.timeout)
    try:
        if a.verify_only:
            req = pb.CompleteRequest(update_id=prep.update_id, verify_only=True)
            out["buckets_verified"] = stub.Complete(req, timeout=a.timeout).buckets_verified
        done = stub.Complete(pb.CompleteRequest(update_id=prep.update_id, flush_cache=True), timeout=a.timeout)
        out.update(ok=True, weight_version=done.weight_version, tensors=done.tensor_count, bytes=done.bytes_received)
        out["buckets_verified"] = done.buckets_verified
    except grpc.RpcError as e:
        reason, metadata = error_info(e)
        out.update(ok=False, code=e.code().name, details=e.details(), reason=reason, metadata=metadata)  # type: ignore[attr-defined]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
