"""Bucket planning, packing and specs (core.planning, core.packing, wire.convert): properties, bit-exact roundtrips."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.dtypes import dtype_name, element_size
from wsync_grpc.core.layout import Bucket, Layout, total_wire_bytes
from wsync_grpc.core.packing import bucket_bytes_view, pack_bucket, unpack_bucket, wire_tensor
from wsync_grpc.core.planning import DEFAULT_BUCKET_BYTES, plan_buckets
from wsync_grpc.wire.convert import batch_bucket_specs, bucket_spec

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
specs = st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=0, max_size=24)
alignments = st.sampled_from([1, 2, 3, 8, 12, 64, 256])
bucket_sizes = st.integers(1, 1024)


def make(spec: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.empty(shape, dtype=dtype)) for i, (dtype, shape) in enumerate(spec)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaN payloads, denormals, negative zero included); valid 0/1 for bool."""
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * element_size(dtype),), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_plan(
    buckets: list[Bucket],
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    alignment: int,
    wire: dict[str, torch.dtype] | None = None,
) -> None:
    """Every invariant a plan promises, for tensors without ties."""
    wire = wire or {}
    by_name = dict(named)
    flat = [t for b in buckets for t in b.tensors]
    assert [t.name for t in flat] == [n for n, _ in named], "order kept, every tensor exactly once"
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.tensors, "no empty bucket"
        ends = 0
        for t in b.tensors:
            src = by_name[t.name]
            dtype = wire.get(t.name, src.dtype)
            esize = element_size(dtype)
            assert t.dtype == dtype
            assert t.shape == tuple(src.shape)
            assert t.nbytes == src.numel() * esize
            assert t.offset % alignment == 0
            assert t.offset % esize == 0
            assert t.offset >= ends, "no overlap, in order"
            assert t.offset - ends < math.lcm(alignment, esize), "no more padding than alignment needs"
            ends = t.end
        assert b.tensors[0].offset == 0
        assert b.size_bytes == ends, "size is the end of the last tensor"
        assert b.payload_bytes == sum(t.nbytes for t in b.tensors)
        if b.size_bytes > bucket_bytes:
            assert len(b.tensors) == 1, "only a lone oversized tensor may exceed bucket_bytes"
            assert b.tensors[0].nbytes > bucket_bytes
    for prev, nxt in itertools.pairwise(buckets):
        first = nxt.tensors[0]
        step = math.lcm(alignment, element_size(first.dtype))
        start = -(-prev.size_bytes // step) * step
        oversized_prev = len(prev.tensors) == 1 and prev.size_bytes > bucket_bytes
        assert oversized_prev or start + first.nbytes > bucket_bytes, "greedy: it would not have fit"


@settings(max_examples=300, deadline=None)
@given(spec=specs, bucket_bytes=bucket_sizes, alignment=alignments)
def test_plan_properties(spec: list[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int, alignment: int) -> None:
    named = make(spec)
    buckets = plan_buckets(named, bucket_bytes=bucket_bytes, alignment=alignment)
    check_plan(buckets, named, bucket_bytes, alignment)
    assert total_wire_bytes(buckets) == sum(b.size_bytes for b in buckets)


@settings(max_examples=200, deadline=None)
@given(spec=specs, bucket_bytes=bucket_sizes, alignment=alignments)
def test_every_byte_covered_exactly_once(
    spec: list[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int, alignment: int
) -> None:
    named = make(spec)
    for b in plan_buckets(named, bucket_bytes=bucket_bytes, alignment=alignment):
        owner = [-1] * b.size_bytes
        for i, t in enumerate(b.tensors):
            for byte in range(t.offset, t.end):
                assert owner[byte] == -1, f"byte {byte} of bucket {b.index} claimed twice"
                owner[byte] = i
        for i, t in enumerate(b.tensors):
            assert owner.count(i) == t.nbytes


@settings(max_examples=150, deadline=None)
@given(
    spec=specs,
    bucket_bytes=bucket_sizes,
    alignment=alignments,
    seed=st.integers(0, 2**31 - 1),
    zero=st.booleans(),
)
def test_pack_unpack_roundtrip_bit_exact(
    spec: list[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int, alignment: int, seed: int, zero: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    named = [(f"t{i}", random_tensor(d, s, gen)) for i, (d, s) in enumerate(spec)]
    by_name = dict(named)
    for b in plan_buckets(named, bucket_bytes=bucket_bytes, alignment=alignment):
        out = torch.full((b.size_bytes,), 0xAB, dtype=torch.uint8)
        assert pack_bucket(b, by_name, out, zero_padding=zero) is out
        views = unpack_bucket(b, out)
        assert list(views) == [t.name for t in b.tensors]
        covered = torch.zeros(b.size_bytes, dtype=torch.bool)
        for t in b.tensors:
            got = views[t.name]
            assert got.dtype == t.dtype and tuple(got.shape) == t.shape
            assert as_bytes(got) == as_bytes(by_name[t.name])
            covered[t.offset : t.end] = True
        padding = out[~covered]
        expected = 0 if zero else 0xAB
        assert bool((padding == expected).all()), "padding zeroed on request, untouched otherwise"


def test_mixed_dtypes_roundtrip_with_non_contiguous_sources() -> None:
    gen = torch.Generator().manual_seed(7)
    named = [
        ("bf16", random_tensor(torch.bfloat16, (33, 17), gen)),
        ("fp32_t", random_tensor(torch.float32, (8, 5), gen).t()),  # non-contiguous
        ("i64", random_tensor(torch.int64, (3,), gen)),
        ("scalar", random_tensor(torch.float16, (), gen)),
        ("flag", random_tensor(torch.bool, (5,), gen)),
        ("fp8", random_tensor(torch.float8_e5m2, (9,), gen)),
        ("i8_strided", random_tensor(torch.int8, (20,), gen)[::3]),
    ]
    buckets = plan_buckets(named, bucket_bytes=512, alignment=256)
    check_plan(buckets, named, 512, 256)
    for b in buckets:
        out = torch.empty(b.size_bytes, dtype=torch.uint8)
        pack_bucket(b, dict(named), out)
        for name, got in unpack_bucket(b, out).items():
            assert as_bytes(got) == as_bytes(dict(named)[name]), name


def test_oversized_tensor_gets_its_own_bucket() -> None:
    named = [
        ("a", torch.zeros(10, dtype=torch.float32)),  # 40 bytes
        ("big", torch.zeros(100, dtype=torch.float32)),  # 400 bytes > 128
        ("b", torch.zeros(4, dtype=torch.float32)),
        ("c", torch.zeros(4, dtype=torch.float32)),
    ]
    buckets = plan_buckets(named, bucket_bytes=128, alignment=16)
    assert [[t.name for t in b.tensors] for b in buckets] == [["a"], ["big"], ["b", "c"]]
    assert buckets[1].size_bytes == 400
    assert buckets[2].tensors[1].offset == 16


def test_tied_tensors_are_sent_once_under_the_first_name() -> None:
    embed = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = embed.weight  # tied, as in models with tie_word_embeddings
    model = torch.nn.ModuleDict({"embed_tokens": embed, "norm": torch.nn.LayerNorm(8), "lm_head": head})
    state = list(model.state_dict().items())
    assert [n for n, _ in state].count("lm_head.weight") == 1  # state_dict lists both names
    buckets = plan_buckets(state, bucket_bytes=1 << 20)
    names = [t.name for b in buckets for t in b.tensors]
    assert names == ["embed_tokens.weight", "norm.weight", "norm.bias"]
    # The same tensor object twice, and a view with the same storage, offset and shape: deduplicated.
    w = torch.arange(12, dtype=torch.float32).view(3, 4)
    named = [("w", w), ("w_again", w), ("w_view", w.view(3, 4)), ("w_flat", w.view(12)), ("w_row", w[1])]
    names = [t.name for b in plan_buckets(named) for t in b.tensors]
    assert names == ["w", "w_flat", "w_row"], "other shapes or offsets of one storage are not ties"


def test_empty_tensors_are_never_mistaken_for_ties() -> None:
    named = [("e1", torch.empty(0)), ("e2", torch.empty(0)), ("e3", torch.empty(0, 3))]
    buckets = plan_buckets(named)
    assert [t.name for b in buckets for t in b.tensors] == ["e1", "e2", "e3"]
    assert buckets[0].size_bytes == 0


def test_meta_tensors_can_be_planned() -> None:
    named = [(f"m{i}", torch.empty(1024, 512, device="meta", dtype=torch.bfloat16)) for i in range(5)]
    buckets = plan_buckets(named, bucket_bytes=2 << 20)
    assert [len(b.tensors) for b in buckets] == [2, 2, 1], "meta tensors are never taken for ties"
    assert buckets[0].tensors[1].offset == 1 << 20


@settings(max_examples=100, deadline=None)
@given(spec=specs, bucket_bytes=bucket_sizes, seed=st.integers(0, 2**31 - 1))
def test_dtype_conversion(spec: list[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    named = [(f"t{i}", torch.randn(s, generator=gen).to(d)) for i, (d, s) in enumerate(spec)]
    wire = {n: (torch.bfloat16 if t.dtype.is_floating_point else t.dtype) for n, t in named}
    buckets = plan_buckets(named, bucket_bytes=bucket_bytes, alignment=8, dtype=torch.bfloat16)
    check_plan(buckets, named, bucket_bytes, 8, wire)
    by_name = dict(named)
    for b in buckets:
        out = torch.empty(b.size_bytes, dtype=torch.uint8)
        pack_bucket(b, by_name, out)
        for name, got in unpack_bucket(b, out).items():
            assert as_bytes(got) == as_bytes(by_name[name].to(wire[name])), name


def test_bucket_spec_messages_for_both_layouts() -> None:
    named = [
        ("a", torch.zeros(3, dtype=torch.bfloat16)),
        ("b", torch.zeros(2, 2, dtype=torch.float32)),
        ("s", torch.zeros((), dtype=torch.int64)),
    ]
    (b,) = plan_buckets(named, bucket_bytes=4096, alignment=256)
    flat = bucket_spec(b)
    assert flat == bucket_spec(b, Layout.FLATTENED)
    assert flat.index == 0 and flat.size_bytes == 512 + 8
    assert [(t.name, t.dtype, list(t.shape), t.offset_bytes) for t in flat.tensors] == [
        ("a", "bfloat16", [3], 0),
        ("b", "float32", [2, 2], 256),
        ("s", "int64", [], 512),
    ]
    ind = bucket_spec(b, Layout.INDIVIDUAL)
    assert ind.size_bytes == 6 + 16 + 8 == b.payload_bytes, "individual: sizes add up exactly"
    assert all(t.offset_bytes == 0 for t in ind.tensors)
    assert total_wire_bytes([b], Layout.INDIVIDUAL) == 30
    assert all(t.dtype == dtype_name(named[i][1].dtype) for i, t in enumerate(ind.tensors))


def test_wire_tensor_copies_only_when_needed() -> None:
    w = torch.randn(4, 6, requires_grad=True)
    (b,) = plan_buckets([("w", w)])
    same = wire_tensor(b.tensors[0], w)
    assert same.data_ptr() == w.data_ptr() and not same.requires_grad
    (bt,) = plan_buckets([("wt", w.t())])
    copied = wire_tensor(bt.tensors[0], w.t())
    assert copied.is_contiguous() and torch.equal(copied, w.detach().t())
    (bc,) = plan_buckets([("w", w)], dtype=torch.bfloat16)
    conv = wire_tensor(bc.tensors[0], w)
    assert conv.dtype == torch.bfloat16 and torch.equal(conv, w.detach().bfloat16())
    with pytest.raises(ValueError, match="shape"):
        wire_tensor(b.tensors[0], torch.zeros(3))


def test_errors() -> None:
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("t", t)], bucket_bytes=0)
    with pytest.raises(ValueError, match="alignment"):
        plan_buckets([("t", t)], alignment=0)
    with pytest.raises(ValueError, match="floating"):
        plan_buckets([("t", t)], dtype=torch.int32)
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([("t", t), ("t", torch.zeros(2))])
    with pytest.raises(ValueError, match="not supported"):
        plan_buckets([("c", torch.zeros(2, dtype=torch.complex64))])
    (b,) = plan_buckets([("t", t)])
    with pytest.raises(ValueError, match="needs"):
        pack_bucket(b, {"t": t}, torch.empty(b.size_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_bucket(b, {"t": t}, torch.empty(4))
    with pytest.raises(ValueError, match="shape"):
        pack_bucket(b, {"t": torch.zeros(5)}, torch.empty(b.size_bytes, dtype=torch.uint8))
    with pytest.raises(KeyError):
        pack_bucket(b, {}, torch.empty(b.size_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_bucket(b, torch.empty(3, dtype=torch.uint8))


def test_default_bucket_size_and_empty_plan() -> None:
    # Meta tensors: planned by size without allocating the default-sized buckets.
    n = int(DEFAULT_BUCKET_BYTES * 0.4) // 4
    small = [(f"t{i}", torch.empty(n, dtype=torch.float32, device="meta")) for i in range(2)]
    assert len(plan_buckets(small)) == 1  # two 40 % tensors share the default bucket
    n = int(DEFAULT_BUCKET_BYTES * 0.6) // 4
    large = [(f"t{i}", torch.empty(n, dtype=torch.float32, device="meta")) for i in range(2)]
    assert len(plan_buckets(large)) == 2
    assert plan_buckets([]) == []


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60),
    ndims=st.integers(0, 4),
    max_spec_bytes=st.integers(1, 4000),
)
def test_bucket_metadata_stays_under_its_bound(lengths: list[int], ndims: int, max_spec_bytes: int) -> None:
    shape = (2**15,) * ndims if ndims else ()
    named = [
        ("n" * n + str(i), torch.empty(shape, device="meta", dtype=torch.float8_e4m3fn)) for i, n in enumerate(lengths)
    ]
    buckets = plan_buckets(named, bucket_bytes=1 << 62, max_spec_bytes=max_spec_bytes)
    assert [t.name for b in buckets for t in b.tensors] == [n for n, _ in named]
    for b in buckets:
        spec = bucket_spec(b)
        spec.size_bytes = 1 << 62
        for t in spec.tensors:
            t.offset_bytes = 1 << 62  # the largest varints they could carry
        assert len(b.tensors) == 1 or spec.ByteSize() <= max_spec_bytes


def test_many_small_tensors_fit_default_grpc_message_limit() -> None:
    """100k tensors (a large MoE's metadata): every Prepare message stays under gRPC's 4 MiB default."""
    named = [
        (
            f"model.layers.{i // 4096}.block_sparse_moe.experts.{i % 4096}.w{i % 3}.weight",
            torch.empty(4, 8, device="meta"),
        )
        for i in range(100_000)
    ]
    buckets = plan_buckets(named)
    assert sum(len(b.tensors) for b in buckets) == 100_000
    assert len(buckets) > 1, "the metadata bound, not the byte size, splits these buckets"
    assert max(pb.PrepareRequest(bucket=bucket_spec(b)).ByteSize() for b in buckets) < 4 * 1024 * 1024


@settings(max_examples=200, deadline=None)
@given(
    spec=specs,
    bucket_bytes=bucket_sizes,
    alignment=alignments,
    solo_bytes=st.integers(1, 512),
    ramp=st.sampled_from([0, 16]),
)
def test_solo_tensors_travel_alone_and_the_rest_packs_in_order(
    spec: list[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int, alignment: int, solo_bytes: int, ramp: int
) -> None:
    named = make(spec)
    buckets = plan_buckets(named, bucket_bytes, alignment, solo_bytes=solo_bytes, ramp_bytes=ramp)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    planned = [t.name for b in buckets for t in b.tensors]
    assert sorted(planned) == sorted(n for n, _ in named), "every tensor exactly once"
    sizes = {n: t.numel() * t.element_size() for n, t in named}
    packed: list[str] = []
    for b in buckets:
        assert b.tensors
        solo = [t for t in b.tensors if t.nbytes >= solo_bytes]
        if solo:
            assert len(b.tensors) == 1, "a tensor of at least solo_bytes is alone"
            assert b.tensors[0].offset == 0 and b.size_bytes == b.tensors[0].nbytes
        else:
            packed += [t.name for t in b.tensors]
            assert all(t.offset % alignment == 0 for t in b.tensors)
            assert b.size_bytes <= bucket_bytes or len(b.tensors) == 1
    assert packed == [n for n, _ in named if sizes[n] < solo_bytes], "the others keep their order"
    lone = [b.tensors[0].nbytes >= solo_bytes for b in buckets]
    assert lone[-2:] != [True, False], "a last packed bucket does not follow a lone tensor: they trade places"


def test_solo_bucket_is_broadcast_from_the_tensor_itself() -> None:
    big = torch.arange(4096, dtype=torch.float32)
    named = [("a", torch.ones(8)), ("big", big), ("b", torch.ones(3, dtype=torch.bfloat16))]
    buckets = plan_buckets(named, 1 << 20, solo_bytes=1024)
    # The packed bucket comes first: the update ends on the lone tensor (nothing to unpack after it).
    assert [[t.name for t in b.tensors] for b in buckets] == [["a", "b"], ["big"]]
    assert [b.index for b in buckets] == [0, 1]
    view = bucket_bytes_view(buckets[1], dict(named), torch.device("cpu"))
    assert view is not None and view.dtype == torch.uint8 and view.numel() == big.numel() * 4
    assert view.data_ptr() == big.data_ptr(), "no copy"
    assert bucket_bytes_view(buckets[0], dict(named), torch.device("cpu")) is None, "two tensors: packed"
    strided = dict(named, big=torch.arange(8192, dtype=torch.float32)[::2])
    assert bucket_bytes_view(buckets[1], strided, torch.device("cpu")) is None, "not contiguous: packed"
    with pytest.raises(ValueError, match="solo_bytes"):
        plan_buckets(named, 1024, solo_bytes=-1)


@settings(max_examples=50, deadline=None)
@given(counts=st.lists(st.integers(1, 40), min_size=0, max_size=60), max_bytes=st.integers(1, 4000))
def test_bucket_specs_are_batched_in_order_under_the_bound(counts: list[int], max_bytes: int) -> None:
    specs = [
        pb.BucketSpec(
            index=i,
            size_bytes=4 * n,
            tensors=[pb.TensorSpec(name=f"layer.{i}.{j}", dtype="float32", shape=[1]) for j in range(n)],
        )
        for i, n in enumerate(counts)
    ]
    msgs = batch_bucket_specs(specs, max_bytes)
    got: list[pb.BucketSpec] = []
    for m in msgs:
        kind = m.WhichOneof("kind")
        batch = [m.bucket] if kind == "bucket" else list(m.buckets.buckets)
        assert kind in ("bucket", "buckets") and batch
        assert kind == "bucket" or len(batch) > 1
        assert len(batch) == 1 or sum(s.ByteSize() + 6 for s in batch) <= max_bytes
        got += batch
    assert got == specs


def test_a_pack_sharing_its_large_copies_with_a_helper_thread_writes_the_same_bytes() -> None:
    """``pack_bucket(..., helper=)`` copies the second half of each large tensor on the helper thread (the
    shared-memory ring's): the bucket's bytes, padding zeroed included, are those of a pack on one thread."""
    from concurrent.futures import ThreadPoolExecutor

    from wsync_grpc.core.packing import SPLIT_BYTES

    g = torch.Generator().manual_seed(3)
    named = [
        ("big", torch.randn(SPLIT_BYTES // 4 + 7, generator=g)),  # odd size: the halves split mid-element
        ("small", torch.randn(5, generator=g)),
        ("big2", torch.randint(-(2**15), 2**15, (SPLIT_BYTES // 2 + 3,), generator=g, dtype=torch.int16)),
    ]
    (bucket,) = plan_buckets(named, bucket_bytes=4 * SPLIT_BYTES, alignment=64)
    tensors = dict(named)
    alone = pack_bucket(bucket, tensors, torch.full((bucket.size_bytes,), 7, dtype=torch.uint8), zero_padding=True)
    with ThreadPoolExecutor(1) as helper:
        shared = pack_bucket(
            bucket, tensors, torch.full((bucket.size_bytes,), 9, dtype=torch.uint8), zero_padding=True, helper=helper
        )
    assert torch.equal(alone, shared)
    for t, (_, src) in zip(bucket.tensors, named, strict=True):
        assert torch.equal(shared[t.offset : t.end].view(src.dtype), src), t.name
