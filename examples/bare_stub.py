"""The wsync protocol driven with nothing but the generated stub and torch.distributed.

    python examples/bare_stub.py ENGINE_HOST:PORT

For people writing their own sender (or porting it to another language): Init,
a streaming Prepare (header, then one message per bucket), one broadcast per
bucket on the weight-sync group, Complete. Here the "model" is the engine's own
tensors with every value set to 0.5, sent in one flattened bucket. Init's reply
carries the caller's lease credential: every later call of the owner sends it
back as the "wsync-lease" metadata header.
"""

import sys
import time

import grpc
import torch
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.group.process_group import free_port, join_group
from wsync_grpc.group.waits import wait_work

stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(sys.argv[1]))

# 1. Which tensors does the engine take? (names, dtypes, shapes)
names = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=60).checksums

# 2. Init: ask the engine to join *before* joining ourselves as rank 0 (or both sides wait forever).
port = free_port()
stub.Leave(pb.LeaveRequest(), timeout=30)  # forget any group of an earlier trainer
init = stub.Init.future(pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2))
group = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2)
lease = [("wsync-lease", init.result(timeout=120).lease_credential)]  # proves the ownership from now on

# 3. Prepare: one flattened bucket holding every tensor at 256-byte aligned offsets.
bucket = pb.BucketSpec(index=0)
offset = 0
for t in names:
    bucket.tensors.add(name=t.name, dtype=t.dtype, shape=t.shape, offset_bytes=offset)
    nbytes = torch.empty(list(t.shape), dtype=getattr(torch, t.dtype)).nbytes
    offset = (offset + nbytes + 255) // 256 * 256
bucket.size_bytes = offset
header = pb.PrepareHeader(weight_version="all-halves", bucket_count=1, total_bytes=offset)
stream = iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=bucket)])
prepared = stub.Prepare(stream, timeout=60, metadata=lease)

# 4. Broadcast the bucket's bytes (the engine's receive is already posted), then Complete.
flat = torch.zeros(offset, dtype=torch.uint8)
for t in bucket.tensors:
    dtype = getattr(torch, t.dtype)
    view = flat[t.offset_bytes :].view(dtype)[: torch.Size(t.shape).numel()]
    view.fill_(0.5)
wait_work(group.broadcast(flat), time.monotonic() + 120)
done = stub.Complete(pb.CompleteRequest(update_id=prepared.update_id), timeout=120, metadata=lease)
print(f"engine serves {done.weight_version}: {done.tensor_count} tensors, {done.bytes_received} bytes")
