"""Pieces of sharded tensors (``wsync.v1.TensorShard``): the engine's tiling checks, the worker's assembly,
the trainer's plan of a direct send, and their wire and worker-message forms."""

from __future__ import annotations

import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import ParamSpec
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Layout, Piece, TensorSlot
from wsync_grpc.core.messages import bucket_from_msg, bucket_to_msg
from wsync_grpc.core.packing import pack_bucket
from wsync_grpc.core.pieces import PieceAssembler
from wsync_grpc.core.planning import PieceMeta, plan_pieces
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.wire.convert import bucket_spec

SPECS = {
    "w": ParamSpec("w", torch.float32, (4, 3)),  # 48 bytes
    "m": ParamSpec("m", torch.float32, (4, 4)),  # 64 bytes
}


def validator(trainer_ranks: int = 2, incremental: bool = False, count: int = 2) -> UpdateValidator:
    v = UpdateValidator(SPECS, {}, trainer_ranks=trainer_ranks)
    v.header_message(
        UpdateHeader(
            update_id="u",
            weight_version="v",
            layout=Layout.FLATTENED,
            apply_mode=ApplyMode.STAGED,
            bucket_count=count,
            total_bytes=0,
            incremental=incremental,
        )
    )
    return v


def piece(name: str, shape: list[int], offsets: list[int], whole: list[int], dtype: str = "float32") -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=shape, shard=pb.TensorShard(global_shape=whole, offsets=offsets))


def bucket(index: int, src: int, *tensors: pb.TensorSpec) -> pb.BucketSpec:
    size = sum(4 * int(torch.Size(t.shape).numel()) for t in tensors)
    offset = 0
    for t in tensors:
        t.offset_bytes = offset
        offset += 4 * int(torch.Size(t.shape).numel())
    return pb.BucketSpec(index=index, size_bytes=size, tensors=list(tensors), src_rank=src)


def reason(v: UpdateValidator, *specs: pb.BucketSpec) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        v.bucket_messages(list(specs))
        v.check_whole()
    return e.value


def test_rows_from_two_ranks_tile_a_tensor_and_become_pieces_of_their_sender() -> None:
    v = validator()
    got = v.bucket_messages(
        [bucket(0, 0, piece("w", [2, 3], [0, 0], [4, 3])), bucket(1, 1, piece("w", [2, 3], [2, 0], [4, 3]))]
    )
    v.check_whole()
    assert [b.src for b in got] == [0, 1]
    slot = got[1].tensors[0]
    assert slot.shape == (2, 3) and slot.nbytes == 24 and slot.piece == Piece((4, 3), (2, 0)) and slot.load


def test_two_dimensional_blocks_tile_a_tensor() -> None:
    v = validator(count=4)
    blocks = [([2, 2], [r, c]) for r in (0, 2) for c in (0, 2)]
    v.bucket_messages([bucket(i, i % 2, piece("m", s, o, [4, 4])) for i, (s, o) in enumerate(blocks)])
    v.check_whole()


@pytest.mark.parametrize(
    ("specs", "why"),
    [
        ([bucket(0, 0, piece("w", [3, 3], [0, 0], [4, 3])), bucket(1, 1, piece("w", [2, 3], [2, 0], [4, 3]))],
         "OVERLAPPING_PIECES"),
        ([bucket(0, 0, piece("m", [2, 3], [0, 0], [4, 4])), bucket(1, 1, piece("m", [3, 2], [1, 2], [4, 4]))],
         "OVERLAPPING_PIECES"),
        ([bucket(0, 0, piece("w", [2, 3], [0, 0], [4, 3]))], "INCOMPLETE_TENSOR"),
        ([bucket(0, 0, piece("w", [2, 3], [3, 0], [4, 3]))], "PIECE_OUT_OF_BOUNDS"),
        ([bucket(0, 0, piece("w", [2, 3], [0, 0], [5, 3]))], "SHAPE_MISMATCH"),
        ([bucket(0, 0, piece("w", [2], [0, 0], [4, 3]))], "INVALID_SHARD"),
        ([bucket(0, 0, piece("w", [0, 3], [0, 0], [4, 3]))], "INVALID_SHARD"),
        ([bucket(0, 2, piece("w", [2, 3], [0, 0], [4, 3]))], "INVALID_SRC_RANK"),
        ([bucket(0, 0, piece("w", [2, 3], [0, 0], [4, 3])),
          bucket(1, 1, piece("w", [2, 3], [2, 0], [4, 3], dtype="bfloat16"))], "DTYPE_MISMATCH"),
        ([bucket(0, 0, pb.TensorSpec(name="w", dtype="float32", shape=[4, 3])),
          bucket(1, 1, piece("w", [2, 3], [2, 0], [4, 3]))], "DUPLICATE_TENSOR"),
    ],
)  # fmt: skip
def test_pieces_that_do_not_tile_their_tensor_are_refused_naming_it(specs: list[pb.BucketSpec], why: str) -> None:
    e = reason(validator(), *specs)
    assert e.reason == why, e
    if why == "INVALID_SRC_RANK":  # a bucket's sender, not a tensor
        assert e.metadata == {"bucket": "0"} and "src_rank 2" in str(e)
    else:
        assert e.metadata.get("tensor") in ("w", "m"), e.metadata
        assert "'w'" in str(e) or "'m'" in str(e)


def test_a_gap_in_an_incremental_update_is_refused_only_once_every_bucket_is_declared() -> None:
    v = validator(incremental=True, count=1)
    v.bucket_messages([bucket(0, 0, piece("w", [2, 3], [0, 0], [4, 3]))])
    with pytest.raises(InvalidArgument) as e:
        v.check_whole()
    assert e.value.reason == "INCOMPLETE_TENSOR" and "6 of its 12 elements" in str(e.value)
    v.bucket_messages([bucket(1, 1, piece("w", [2, 3], [2, 0], [4, 3]))])
    v.check_whole()


def test_a_refused_batch_forgets_its_pieces() -> None:
    v = validator(incremental=True, count=0)
    bad = bucket(1, 1, piece("w", [2, 3], [3, 0], [4, 3]))  # out of bounds: the whole batch is refused
    assert reason(v, bucket(0, 0, piece("w", [2, 3], [2, 0], [4, 3])), bad).reason == "PIECE_OUT_OF_BOUNDS"
    v.bucket_messages([bucket(0, 0, piece("w", [2, 3], [2, 0], [4, 3]))])  # the same piece again: not an overlap


def test_a_worker_assembles_pieces_into_the_whole_tensor_once_the_last_arrived() -> None:
    whole = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    a = PieceAssembler(torch.device("cpu"))
    slots = [
        TensorSlot("m", torch.float32, (2, 2), 0, 16, "m", True, Piece((4, 4), (r, c))) for r in (0, 2) for c in (0, 2)
    ]
    outs = [
        a.add(s, whole[r : r + 2, c : c + 2].clone())
        for s, (r, c) in zip(slots, [(0, 0), (0, 2), (2, 0), (2, 2)], strict=True)
    ]
    assert outs[:3] == [None, None, None] and a.open_bytes == 0
    assert outs[3] is not None and outs[3][0] == "m" and torch.equal(outs[3][1], whole)


def test_a_direct_plan_gives_each_rank_its_own_buckets_in_turn() -> None:
    pieces = [
        PieceMeta(n, torch.float32, (2, 3), r, Piece((4, 3), (2 * r, 0))) for n in ("a", "b", "c") for r in (0, 1)
    ]
    buckets = plan_pieces(pieces, bucket_bytes=48, alignment=1)
    assert [b.src for b in buckets] == [0, 1, 0, 1]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    assert [[t.name for t in b.tensors] for b in buckets] == [["a", "b"], ["a", "b"], ["c"], ["c"]]
    assert all(t.piece == Piece((4, 3), (2 * b.src, 0)) for b in buckets for t in b.tensors)
    # The contract's form and the worker message's keep the sender and the places.
    spec = bucket_spec(buckets[1])
    assert spec.src_rank == 1 and list(spec.tensors[0].shard.offsets) == [2, 0]
    assert list(spec.tensors[0].shard.global_shape) == [4, 3] and list(spec.tensors[0].shape) == [2, 3]
    assert bucket_from_msg(bucket_to_msg(buckets[1])) == buckets[1]


def test_pieces_packed_by_the_trainer_come_out_whole_on_the_engine() -> None:
    """Pack each rank's shards, validate their specs, receive them as bytes, assemble: the whole tensors."""
    whole = {"w": torch.randn(4, 3), "m": torch.randn(4, 4)}
    pieces = [
        PieceMeta(n, torch.float32, (2, t.shape[1]), r, Piece(tuple(t.shape), (2 * r, 0)))
        for n, t in whole.items()
        for r in (0, 1)
    ]
    buckets = plan_pieces(pieces, bucket_bytes=1 << 20, alignment=256)
    v = validator(count=len(buckets))
    received = v.bucket_messages([bucket_spec(b) for b in buckets])
    v.check_whole()
    a = PieceAssembler(torch.device("cpu"))
    out: dict[str, torch.Tensor] = {}
    for sent, got in zip(buckets, received, strict=True):
        shards = {t.name: whole[t.name][2 * sent.src : 2 * sent.src + 2] for t in sent.tensors}
        flat = torch.empty(sent.size_bytes, dtype=torch.uint8)
        pack_bucket(sent, shards, flat, zero_padding=True)
        for t in got.tensors:
            done = a.add(t, flat[t.offset : t.end].view(t.dtype).view(t.shape))
            if done is not None:
                out[done[0]] = done[1]
    assert out.keys() == whole.keys() and all(torch.equal(out[n], whole[n]) for n in whole)
