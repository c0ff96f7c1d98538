"""``GetWeightChecksums`` costs at most one pass over the model, whatever the request repeats.

A real server on a loopback port over a 0.25 GB synthetic model: a request naming the largest
tensor 100,000 times is answered with one digest, in about the time of hashing that tensor once;
asking again for every tensor reads nothing (the digests of the served weights are kept); once a
real sync applied new weights, the digests are those of the new weights.
"""

from __future__ import annotations

import time

import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import in_process_server
from wsync_grpc.trainer import TrainerClient

PRESET = "0.25gb"


@pytest.mark.timeout(300)
def test_repeated_names_cost_one_read_and_digests_are_kept_until_the_weights_change() -> None:
    weights = synthetic.build(PRESET, seed=0, dtype=torch.bfloat16)
    name, largest = max(weights.items(), key=lambda kv: kv[1].numel())
    t0 = time.monotonic()
    expected = tensor_sha256(largest)
    once = time.monotonic() - t0
    engine = TensorEngine(weights, aliases=synthetic.aliases(PRESET))
    with in_process_server(engine) as (srv, stub):
        t0 = time.monotonic()
        reply = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=[name] * 100_000), timeout=120)
        repeated = time.monotonic() - t0
        assert [(c.name, c.sha256) for c in reply.checksums] == [(name, expected)]
        assert repeated < 5 * once + 1.0, (repeated, once)  # one read, not 100,000

        t0 = time.monotonic()
        first = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=120)
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        again = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=120)
        warm = time.monotonic() - t0
        assert [(c.name, c.sha256) for c in again.checksums] == [(c.name, c.sha256) for c in first.checksums]
        assert warm < cold / 3, (warm, cold)  # kept: no tensor read again

        new = synthetic.build(PRESET, seed=1, dtype=torch.bfloat16)
        with TrainerClient([srv.address], rpc_timeout_s=60) as c:
            c.sync(new.items(), "v1")
        after = {
            x.name: x.sha256 for x in stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=120).checksums
        }
        assert after == {n: tensor_sha256(t) for n, t in new.items() if n in after}
        assert len(after) == len(first.checksums)
