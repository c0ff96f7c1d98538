"""Delta updates (``wsync.v1.TensorDelta``): the codec (core.delta), the validator's and the header's checks, planning
and packing delta entries, the worker's expansion into whole tensors, and the wire form of a delta slot.

Tensors are compared by their bit patterns throughout: a delta must rebuild ``-0.0`` and NaN payloads exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.delta import (
    DENSE_SHARE,
    GAP_LIMIT,
    POSITIONS_ALIGNMENT,
    POSITIONS_BY_NUMBER,
    DeltaCoding,
    Positions,
    apply_delta,
    bitmap_bytes,
    changed_positions,
    decode_positions,
    encode,
)
from wsync_grpc.core.digests import BucketHasher, digest_of
from wsync_grpc.core.engine import ParamSpec
from wsync_grpc.core.errors import FailedPrecondition, InvalidArgument
from wsync_grpc.core.header import UpdateHeader, check_delta_header
from wsync_grpc.core.layout import ApplyMode, Bucket, Layout, TensorSlot, Transport, total_wire_bytes
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.core.packing import pack_bucket
from wsync_grpc.core.planning import TensorMeta, plan_metadata
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports import transport_for
from wsync_grpc.wire.convert import DELTA_POSITIONS, bucket_spec, header_from_proto, header_to_proto
from wsync_grpc.worker.delta import expand

DENSITIES = [0.0, 1e-3, 1e-2, 0.1, 0.5]
SHAPES = [(), (1,), (1, 1), (257,), (31, 67), (3, 5, 129)]
"""A scalar, one element, a scalar-like matrix, and tensors of a few hundred to a few thousand elements."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, as same-size integers (a view when ``t`` is contiguous): its bit patterns."""
    return t.contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A reproducible random tensor."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def perturbed(base: torch.Tensor, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``base`` with ``k`` random elements' bits flipped (each one differs), and their sorted flat positions."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(base.numel(), generator=g)[:k].sort().values
    new = base.clone()
    view = bits(new)
    top = 2 ** (8 * base.element_size() - 1) - 1
    view[pos] ^= torch.randint(1, top, (k,), generator=g, dtype=torch.int64).to(view.dtype)
    return new, pos


def count_for(numel: int, density: float) -> int:
    """Elements to change for ``density``: none at 0, else at least one."""
    return 0 if density == 0 else min(numel, max(1, round(density * numel)))


def at(numel: int, positions: list[int], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A base of ``numel`` zeros and a tensor with ones at ``positions``."""
    base = torch.zeros(numel, dtype=dtype)
    new = base.clone()
    new[positions] = 1.0
    return new, base


def entry_of(coding: DeltaCoding, esize: int, raw_positions: bytes) -> torch.Tensor:
    """An entry's bytes for ``coding``: zero values, zero padding, then ``raw_positions``."""
    values = -(-coding.changed * esize // POSITIONS_ALIGNMENT) * POSITIONS_ALIGNMENT
    return torch.tensor(list(bytes(values) + raw_positions), dtype=torch.uint8)


# ------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("positions", [*Positions, None], ids=[*(p.name for p in Positions), "auto"])
def test_a_delta_round_trips_bit_exact(dtype: torch.dtype, density: float, positions: Positions | None) -> None:
    """Every encoding at every density rebuilds the new tensor bit for bit, for every shape, 1 element included."""
    for seed, shape in enumerate(SHAPES):
        base = random_tensor(shape, dtype, seed)
        new, changed = perturbed(base, count_for(base.numel(), density), seed)
        enc = encode(new, base, positions)
        esize, numel = base.element_size(), base.numel()
        if enc is None:  # only the automatic choice sends a tensor whole, and only when a delta saves too little
            assert positions is None and changed.numel() > 0
            smallest = min(encode(new, base, p).coding.nbytes(esize) for p in Positions)  # type: ignore[union-attr]
            assert smallest >= DENSE_SHARE * numel * esize
            continue
        c = enc.coding
        assert positions is None or c.positions is positions
        assert enc.changed_elements == changed.numel()
        assert enc.payload.dtype == torch.uint8 and enc.payload.shape == (c.nbytes(esize),)
        assert c.positions_bytes == c.expected_positions_bytes(numel)
        whole = apply_delta(enc.payload, c, base, "w")
        assert same_bits(whole, new), (shape, c)
        decoded = decode_positions(c, enc.payload[-c.positions_bytes or len(enc.payload) :], numel, "w")
        if c.positions is Positions.GAPS:
            assert set(changed.tolist()) <= set(decoded.tolist()) and len(decoded) == c.changed
        else:
            assert torch.equal(decoded, changed)


def test_the_entry_layout_is_values_then_padding_then_positions_as_the_contract_writes_them() -> None:
    """Values in position order, zero padding to 8 bytes, then little-endian uint32 indices, uint8 gaps or an
    LSB-first bitmap (numpy's packbits with bitorder="little")."""
    base = random_tensor((1000,), torch.bfloat16)
    new, changed = perturbed(base, 3)
    want_values = bits(new)[changed].numpy().tobytes()
    for p in Positions:
        enc = encode(new, base, p)
        assert enc is not None
        raw = enc.payload.numpy().tobytes()
        vbytes = enc.coding.values_bytes(2)
        start = -(-vbytes // POSITIONS_ALIGNMENT) * POSITIONS_ALIGNMENT
        positions = raw[start:]
        if p is Positions.GAPS:  # a gap of 256 or more is bridged: check the entries it names instead
            entries = np.cumsum(np.frombuffer(positions, dtype=np.uint8).astype(np.int64)) - 1
            assert set(changed.tolist()) <= set(entries.tolist())
            assert raw[:vbytes] == bits(new)[torch.from_numpy(entries)].numpy().tobytes()
        else:
            assert raw[:vbytes] == want_values
        assert raw[vbytes:start] == bytes(start - vbytes)
        assert p is Positions.GAPS or start - vbytes == 2  # 3 bf16 values: 2 bytes of padding
        if p is Positions.INDICES:
            assert np.frombuffer(positions, dtype="<u4").tolist() == changed.tolist()
        elif p is Positions.BITMAP:
            mask = np.zeros(1000, dtype=bool)
            mask[changed.numpy()] = True
            assert positions == np.packbits(mask, bitorder="little").tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_signed_zeros_and_nan_payloads_are_compared_and_rebuilt_by_bits(dtype: torch.dtype) -> None:
    """-0.0 differs from 0.0, a NaN equals the same NaN but not another payload; all rebuilt bit for bit."""
    nan = 0x7FC0 if dtype == torch.bfloat16 else 0x7FC00000
    int_dtype = _INT_OF_SIZE[torch.tensor([], dtype=dtype).element_size()]
    base = torch.tensor([0, -(2 ** (8 * int_dtype.itemsize - 1)), nan | 1, nan | 2, 0], dtype=torch.int64)
    new = base.clone()
    new[0] = -(2 ** (8 * int_dtype.itemsize - 1))  # 0.0 -> -0.0
    new[1] = 0  # -0.0 -> 0.0
    new[3] = nan | 3  # another NaN payload
    base_t, new_t = base.to(int_dtype).view(dtype), new.to(int_dtype).view(dtype)
    assert torch.equal(changed_positions(new_t, base_t), torch.tensor([0, 1, 3]))
    for p in Positions:
        enc = encode(new_t, base_t, p)
        assert enc is not None and enc.changed_elements == 3
        assert same_bits(apply_delta(enc.payload, enc.coding, base_t), new_t)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64], ids=["bf16", "fp32", "u8", "fp64"]
)
@pytest.mark.parametrize("numel", [1, 7, 8, 1001, 4099])
@pytest.mark.parametrize("density", [0.0, 1e-3, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_changed_positions_word_by_word_and_element_by_element_agree(
    dtype: torch.dtype, numel: int, density: float, offset: int
) -> None:
    """Whatever the dtype, length (a tail shorter than an 8-byte word included), density (either side of
    SPARSE_WORDS) and alignment of the tensors' start, the positions and the entries are those of an element by
    element comparison, and rebuild the new tensor bit for bit."""
    gen = torch.Generator().manual_seed(numel + offset)
    storage = (torch.rand(numel + offset, generator=gen) * 100).to(dtype)
    base = storage[offset:]
    new = base.clone()
    hit = torch.rand(numel, generator=gen) < density
    bits(new)[hit] = bits(new)[hit] + 1
    expected = torch.nonzero(bits(new) != bits(base)).squeeze(1)
    assert torch.equal(changed_positions(new, base), expected)
    for p in (None, *Positions):
        enc = encode(new, base, p)
        if enc is None:  # too dense to save anything: travels whole
            assert p is None
            continue
        assert enc.changed_elements == expected.numel()
        assert same_bits(apply_delta(enc.payload, enc.coding, base), new)


def test_a_non_contiguous_new_tensor_round_trips() -> None:
    """A transposed view is diffed and encoded in C order of its shape."""
    base = random_tensor((40, 30), torch.float32).t().contiguous()
    new = base.clone()
    new[3, 7], new[29, 39] = 5.0, -5.0
    view = new.t().contiguous().t()  # same values, transposed strides
    assert not view.is_contiguous()
    enc = encode(view, base, Positions.INDICES)
    assert enc is not None and enc.changed_elements == 2
    assert same_bits(apply_delta(enc.payload, enc.coding, base), new)


def test_tensors_of_other_dtypes_or_shapes_cannot_be_diffed() -> None:
    """A delta is between two tensors of one dtype and shape."""
    base = torch.zeros(4)
    for other in (torch.zeros(4, dtype=torch.float16), torch.zeros(2, 2)):
        with pytest.raises(ValueError, match="cannot diff"):
            encode(other, base)


# -------------------------------------------------------------------- gaps


def test_a_long_gap_is_bridged_by_entries_at_unchanged_positions() -> None:
    """Two changes 1000 elements apart: the gap is bridged (more entries than changes) and rebuilt exactly."""
    base = random_tensor((2000,), torch.bfloat16)
    new = base.clone()
    bits(new)[[10, 1010]] ^= 1
    enc = encode(new, base, Positions.GAPS)
    assert enc is not None
    assert enc.changed_elements == 2 and enc.coding.changed > enc.changed_elements
    assert enc.coding.changed == 1 + math.ceil(1000 / GAP_LIMIT)
    gaps = enc.payload[-enc.coding.positions_bytes :]
    assert int(gaps.min()) >= 1 and int(gaps.max()) <= GAP_LIMIT
    assert same_bits(apply_delta(enc.payload, enc.coding, base), new)


@pytest.mark.parametrize("gap", [1, 254, 255, 256, 509, 510, 511, 766, 1999])
def test_each_gap_takes_as_many_entries_as_255_byte_steps(gap: int) -> None:
    """A gap of g elements takes ceil(g / 255) entries, around every multiple of 255."""
    new, base = at(2000, [gap - 1])  # the first entry's gap is from -1
    enc = encode(new, base, Positions.GAPS)
    assert enc is not None
    assert enc.coding.changed == enc.coding.positions_bytes == math.ceil(gap / GAP_LIMIT)
    assert same_bits(apply_delta(enc.payload, enc.coding, base), new)


# ----------------------------------------------------------- automatic choice


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, Positions.INDICES), (50, Positions.GAPS16), (1000, Positions.GAPS), (30_000, Positions.BITMAP)],
    ids=["one", "0.05%", "1%", "30%"],
)
def test_the_automatic_choice_follows_the_density(k: int, expected: Positions) -> None:
    """INDICES for one change, GAPS16 at very low density, GAPS around 1%, BITMAP around 30% of a 100k-element bf16
    tensor."""
    base = random_tensor((100_000,), torch.bfloat16)
    new, _ = perturbed(base, k)
    enc = encode(new, base)
    assert enc is not None and enc.coding.positions is expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_tensor_changed_everywhere_travels_whole(dtype: torch.dtype) -> None:
    """At 100% no delta is worth it: ``encode`` says to send the tensor whole."""
    base = random_tensor((10_000,), dtype)
    new, _ = perturbed(base, 10_000)
    assert encode(new, base) is None
    assert encode(new, base, Positions.BITMAP) is not None  # an encoding asked for is always given


@pytest.mark.parametrize("density", [0.0, 1e-4, 3e-3, 1e-2, 0.05, 0.2, 0.6, 0.8])
def test_the_automatic_choice_is_the_smallest_entry(density: float) -> None:
    """The encoding picked takes no more bytes than any other; ``None`` only when even the smallest is too big."""
    base = random_tensor((20_000,), torch.bfloat16)
    new, _ = perturbed(base, count_for(base.numel(), density))
    sizes = {p: encode(new, base, p).coding.nbytes(2) for p in Positions}  # type: ignore[union-attr]
    enc = encode(new, base)
    if enc is None:
        assert min(sizes.values()) >= DENSE_SHARE * base.numel() * 2
    else:
        assert enc.coding.nbytes(2) == min(sizes.values())
        assert enc.coding.nbytes(2) < DENSE_SHARE * base.numel() * 2


@pytest.mark.parametrize("density", [0.01, 0.02, 0.03])
def test_positions_take_no_more_than_the_values_at_one_to_three_percent(density: float) -> None:
    """On a 1M-element bf16 tensor with 1-3% of it changed, the positions take at most as many bytes as the values."""
    base = random_tensor((1 << 20,), torch.bfloat16)
    new, _ = perturbed(base, count_for(base.numel(), density))
    enc = encode(new, base)
    assert enc is not None
    assert enc.coding.positions_bytes <= enc.coding.values_bytes(2)


def test_an_unchanged_tensor_is_an_empty_entry() -> None:
    """No change: zero bytes of INDICES, which rebuild the base."""
    base = random_tensor((300,), torch.bfloat16)
    enc = encode(base.clone(), base)
    assert enc is not None and enc.coding == DeltaCoding(Positions.INDICES, 0, 0) and enc.payload.numel() == 0
    assert same_bits(apply_delta(enc.payload, enc.coding, base), base)


# ------------------------------------------------------------------ applying


@pytest.mark.parametrize("positions", list(Positions), ids=[p.name for p in Positions])
def test_applying_a_delta_twice_gives_the_same_tensor(positions: Positions) -> None:
    """The values overwrite: applying again, to the result or in place, changes nothing."""
    base = random_tensor((64, 48), torch.bfloat16)
    new, _ = perturbed(base, 40)
    enc = encode(new, base, positions)
    assert enc is not None
    once = apply_delta(enc.payload, enc.coding, base)
    twice = apply_delta(enc.payload, enc.coding, once)
    assert same_bits(once, new) and same_bits(twice, new)
    served = base.clone()
    for _ in range(2):
        assert apply_delta(enc.payload, enc.coding, served, out=served) is served
        assert same_bits(served, new)


def test_apply_never_writes_the_base_without_out() -> None:
    """Without ``out`` the result is a new tensor and the base keeps every bit; with ``out`` it is written there."""
    base = random_tensor((33, 17), torch.float32)
    kept = base.clone()
    new, _ = perturbed(base, 100)
    enc = encode(new, base, Positions.BITMAP)
    assert enc is not None
    whole = apply_delta(enc.payload, enc.coding, base)
    assert whole.data_ptr() != base.data_ptr() and whole.is_contiguous()
    assert same_bits(base, kept) and same_bits(whole, new)
    out = torch.full_like(base, 7.0)
    assert apply_delta(enc.payload, enc.coding, base, out=out) is out
    assert same_bits(out, new) and same_bits(base, kept)


def test_an_entry_at_an_odd_byte_offset_of_a_bucket_is_applied() -> None:
    """Values not aligned to the element size in memory (a slice of a larger buffer) are read all the same."""
    base = random_tensor((500,), torch.float32)
    new, _ = perturbed(base, 9)
    enc = encode(new, base, Positions.INDICES)
    assert enc is not None
    buffer = torch.zeros(enc.payload.numel() + 3, dtype=torch.uint8)
    buffer[3:] = enc.payload
    assert same_bits(apply_delta(buffer[3:], enc.coding, base), new)


def _indices(*idx: int) -> tuple[DeltaCoding, bytes]:
    return DeltaCoding(Positions.INDICES, len(idx), 4 * len(idx)), np.array(idx, dtype="<u4").tobytes()


def _gaps(*gaps: int) -> tuple[DeltaCoding, bytes]:
    return DeltaCoding(Positions.GAPS, len(gaps), len(gaps)), bytes(gaps)


def _bitmap(changed: int, *set_bits: int) -> tuple[DeltaCoding, bytes]:
    mask = np.zeros(bitmap_bytes(20) * 8, dtype=bool)
    mask[list(set_bits)] = True
    return DeltaCoding(Positions.BITMAP, changed, bitmap_bytes(20)), np.packbits(mask, bitorder="little").tobytes()


CORRUPT: dict[str, tuple[DeltaCoding, bytes]] = {
    "indices-decreasing": _indices(5, 3),
    "indices-repeated": _indices(4, 4),
    "index-past-the-end": _indices(3, 20),
    "index-with-the-top-bit": _indices(0, 2**32 - 1),
    "zero-gap": _gaps(3, 0),
    "gaps-past-the-end": _gaps(10, 11),
    "bitmap-more-bits-than-declared": _bitmap(2, 1, 5, 9),
    "bitmap-fewer-bits-than-declared": _bitmap(2, 1),
    "bitmap-bits-past-numel": _bitmap(1, 21),
}
"""Entries of a 20-element float32 tensor that decoding must refuse."""


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_positions_are_refused_before_anything_is_written(case: str) -> None:
    """Out-of-order, repeated or out-of-range positions and miscounted bitmaps: DELTA_CORRUPT, the target untouched."""
    coding, raw = CORRUPT[case]
    entry = entry_of(coding, 4, raw)
    served = torch.arange(20, dtype=torch.float32)
    kept = served.clone()
    with pytest.raises(InvalidArgument) as e:
        apply_delta(entry, coding, served, "layer.w", out=served)
    assert e.value.reason == "DELTA_CORRUPT" and e.value.metadata == {"tensor": "layer.w"}
    assert same_bits(served, kept)


@pytest.mark.parametrize("extra", [-1, 1])
def test_an_entry_of_the_wrong_length_is_refused(extra: int) -> None:
    """An entry one byte shorter or longer than its coding says: DELTA_CORRUPT."""
    base = random_tensor((20,), torch.float32)
    new, _ = perturbed(base, 2)
    enc = encode(new, base, Positions.INDICES)
    assert enc is not None
    entry = torch.zeros(enc.payload.numel() + extra, dtype=torch.uint8)
    with pytest.raises(InvalidArgument) as e:
        apply_delta(entry, enc.coding, base, "w")
    assert e.value.reason == "DELTA_CORRUPT"


def test_positions_of_another_length_than_declared_are_refused() -> None:
    """``decode_positions`` checks the bytes it is given against ``positions_bytes``."""
    coding, raw = _indices(1, 2)
    with pytest.raises(InvalidArgument) as e:
        decode_positions(coding, torch.tensor(list(raw[:-1]), dtype=torch.uint8), 20, "w")
    assert e.value.reason == "DELTA_CORRUPT"


# ------------------------------------------------------------------- header

SPECS = {
    "w": ParamSpec("w", torch.float32, (4, 8)),  # 32 elements
    "b": ParamSpec("b", torch.bfloat16, (20,)),
    "emb": ParamSpec("emb", torch.bfloat16, (16,)),
}
ALIASES = {"lm_head": "emb"}
INDICES, BITMAP, GAPS = pb.DELTA_POSITIONS_INDICES, pb.DELTA_POSITIONS_BITMAP, pb.DELTA_POSITIONS_GAPS


def delta_header(**kw: object) -> UpdateHeader:
    fields: dict[str, object] = dict(
        update_id="u1",
        weight_version="v1",
        layout=Layout.FLATTENED,
        apply_mode=ApplyMode.STAGED,
        bucket_count=1,
        total_bytes=20,
        incremental=False,
        base_weight_version="v0",
        base_weight_identity="id-0",
    )
    fields.update(kw)
    return UpdateHeader(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"base_weight_identity": ""}, "MISSING_BASE_IDENTITY"),
        ({"base_weight_version": ""}, "UNEXPECTED_BASE_IDENTITY"),
        ({"transport": Transport.DISK, "checkpoint_path": "ckpt"}, "DELTA_UNSUPPORTED"),
        ({"transport": Transport.CUDA_IPC}, "DELTA_UNSUPPORTED"),
        ({"layout": Layout.INDIVIDUAL}, "DELTA_UNSUPPORTED"),
        ({"adapter": LoraSpec("sql", 8, 16.0, ("q_proj",))}, "DELTA_UNSUPPORTED"),
    ],
    ids=["no-identity", "identity-without-base", "disk", "cuda-ipc", "individual", "adapter"],
)
def test_delta_header_refusals(fields: dict[str, object], reason: str) -> None:
    """A delta names its base's identity and travels flattened, by broadcast or shared memory, with base weights."""
    with pytest.raises(InvalidArgument) as e:
        check_delta_header(delta_header(**fields))
    assert e.value.reason == reason


@pytest.mark.parametrize("transport", [Transport.BROADCAST, Transport.SHARED_MEMORY])
def test_a_delta_header_is_accepted_by_broadcast_and_shared_memory(transport: Transport) -> None:
    """A flattened delta of base weights by a transport the trainer packs passes; so does a whole update."""
    check_delta_header(delta_header(transport=transport))
    check_delta_header(delta_header(transport=transport, base_weight_version="", base_weight_identity=""))
    assert delta_header().delta and not delta_header(base_weight_version="").delta


def test_the_validator_checks_the_delta_header() -> None:
    """``header_message`` refuses a delta without identity, and a delta by disk once the transport set the layout."""
    with pytest.raises(InvalidArgument) as e:
        UpdateValidator(SPECS, {}).header_message(delta_header(base_weight_identity=""))
    assert e.value.reason == "MISSING_BASE_IDENTITY"
    disk = delta_header(transport=Transport.DISK, checkpoint_path="ckpt", bucket_count=0, total_bytes=0)
    with pytest.raises(InvalidArgument) as e:
        UpdateValidator(SPECS, {}, transports=transport_for).header_message(disk)
    assert e.value.reason == "DELTA_UNSUPPORTED"
    assert UpdateValidator(SPECS, {}).header_message(delta_header()).delta


def test_the_base_fields_round_trip_through_the_header_proto() -> None:
    """``base_weight_version`` and ``base_weight_identity`` travel in ``PrepareHeader``."""
    h = header_from_proto(pb.PrepareHeader(weight_version="v1", base_weight_version="v0", base_weight_identity="id"))
    assert (h.base_weight_version, h.base_weight_identity, h.delta) == ("v0", "id", True)
    assert header_from_proto(header_to_proto(delta_header())) == delta_header()
    assert not header_from_proto(pb.PrepareHeader(weight_version="v1")).delta


# ---------------------------------------------------------------- validation


def validator(delta: bool = True, trainer_ranks: int = 1) -> UpdateValidator:
    v = UpdateValidator(SPECS, ALIASES, trainer_ranks=trainer_ranks)
    v.header_message(delta_header() if delta else delta_header(base_weight_version="", base_weight_identity=""))
    return v


def spec(
    name: str, dtype: str, shape: list[int], positions: int, changed: int, positions_bytes: int, offset: int = 0
) -> pb.TensorSpec:
    d = pb.TensorDelta(positions=positions, changed_elements=changed, positions_bytes=positions_bytes)  # type: ignore[arg-type]
    return pb.TensorSpec(name=name, dtype=dtype, shape=shape, offset_bytes=offset, delta=d)


def refused(v: UpdateValidator, *tensors: pb.TensorSpec, size: int = 4096) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        v.bucket_messages([pb.BucketSpec(index=0, size_bytes=size, tensors=list(tensors))])
    return e.value


@pytest.mark.parametrize(
    ("delta", "coding", "wire", "esize"),
    [
        ((INDICES, 3, 12), DeltaCoding(Positions.INDICES, 3, 12), "bfloat16", 2),
        ((GAPS, 5, 5), DeltaCoding(Positions.GAPS, 5, 5), "float32", 4),
        ((BITMAP, 7, 4), DeltaCoding(Positions.BITMAP, 7, 4), "float32", 4),
        ((BITMAP, 0, 4), DeltaCoding(Positions.BITMAP, 0, 4), "bfloat16", 2),
        ((INDICES, 0, 0), DeltaCoding(Positions.INDICES, 0, 0), "float32", 4),
        ((GAPS, 32, 32), DeltaCoding(Positions.GAPS, 32, 32), "float32", 4),
    ],
    ids=["indices-bf16", "gaps", "bitmap", "bitmap-unchanged", "indices-unchanged", "gaps-every-element"],
)
def test_a_well_formed_delta_spec_becomes_a_delta_slot(
    delta: tuple[int, int, int], coding: DeltaCoding, wire: str, esize: int
) -> None:
    """The slot keeps the tensor's shape, carries the coding and spans the entry's bytes in the wire dtype."""
    v = validator()
    (b,) = v.bucket_messages(
        [pb.BucketSpec(index=0, size_bytes=coding.nbytes(esize), tensors=[spec("w", wire, [4, 8], *delta)])]
    )
    (slot,) = b.tensors
    assert slot.delta == coding and slot.shape == (4, 8)
    assert slot.nbytes == coding.nbytes(esize) and b.has_delta and b.lone is None


@pytest.mark.parametrize(
    ("delta", "reason"),
    [
        ((0, 3, 12), "DELTA_ENCODING"),
        ((9, 3, 12), "DELTA_ENCODING"),
        ((0, 0, 4), "DELTA_ENCODING"),
        ((INDICES, 3, 11), "DELTA_SIZE_MISMATCH"),
        ((INDICES, 3, 0), "DELTA_SIZE_MISMATCH"),
        ((GAPS, 3, 4), "DELTA_SIZE_MISMATCH"),
        ((BITMAP, 3, 3), "DELTA_SIZE_MISMATCH"),
        ((BITMAP, 3, 5), "DELTA_SIZE_MISMATCH"),
        ((INDICES, 33, 132), "DELTA_SIZE_MISMATCH"),
        ((GAPS, 33, 33), "DELTA_SIZE_MISMATCH"),
        ((BITMAP, 33, 4), "DELTA_SIZE_MISMATCH"),
    ],
    ids=[
        "unspecified",
        "unknown",
        "unspecified-no-values",
        "indices-short",
        "indices-none",
        "gaps-short",
        "bitmap-short",
        "bitmap-long",
        "indices-more-than-numel",
        "gaps-more-than-numel",
        "bitmap-more-than-numel",
    ],
)
def test_a_malformed_delta_spec_is_refused(delta: tuple[int, int, int], reason: str) -> None:
    """Positions unspecified or unknown, or sizes that do not fit the encoding and the tensor's 32 elements."""
    e = refused(validator(), spec("w", "float32", [4, 8], *delta))
    assert e.reason == reason and e.metadata == {"bucket": "0", "tensor": "w"}


def test_a_delta_in_a_whole_update_is_refused() -> None:
    """A tensor with a delta in an update that names no base: UNEXPECTED_DELTA."""
    e = refused(validator(delta=False), spec("w", "float32", [4, 8], INDICES, 1, 4))
    assert e.reason == "UNEXPECTED_DELTA" and e.metadata == {"bucket": "0", "tensor": "w"}
    v = validator(delta=False)  # the same tensor whole is fine
    v.bucket_messages(
        [pb.BucketSpec(index=0, size_bytes=128, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[4, 8])])]
    )


def test_a_piece_of_a_tensor_carries_a_delta_sized_as_the_piece() -> None:
    """A shard of a sharded trainer's direct send with a delta: its entry is sized against the piece's elements
    (a bitmap of 16 elements is 2 bytes), and a bitmap sized for the whole tensor is refused."""
    piece = spec("w", "float32", [2, 8], BITMAP, 3, 2)
    piece.shard.CopyFrom(pb.TensorShard(global_shape=[4, 8], offsets=[0, 0]))
    (b,) = validator(trainer_ranks=2).bucket_messages([pb.BucketSpec(index=0, size_bytes=4096, tensors=[piece])])
    (slot,) = b.tensors
    assert slot.piece is not None and slot.delta == DeltaCoding(Positions.BITMAP, 3, 2)
    assert slot.nbytes == slot.delta.nbytes(4) and slot.shape == (2, 8)
    whole_sized = spec("w", "float32", [2, 8], BITMAP, 3, 4)
    whole_sized.shard.CopyFrom(pb.TensorShard(global_shape=[4, 8], offsets=[0, 0]))
    assert refused(validator(trainer_ranks=2), whole_sized).reason == "DELTA_SIZE_MISMATCH"


def test_a_delta_entry_must_fit_its_bucket() -> None:
    """The bounds check uses the entry's bytes: one byte short of them is OFFSET_OUT_OF_BOUNDS."""
    coding = DeltaCoding(Positions.GAPS, 5, 5)
    e = refused(validator(), spec("w", "float32", [4, 8], GAPS, 5, 5), size=coding.nbytes(4) - 1)
    assert e.reason == "OFFSET_OUT_OF_BOUNDS"


# ------------------------------------------------------------------ planning


def metas_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def test_planning_sizes_and_marks_delta_entries() -> None:
    """A delta tensor is planned at its entry's size in the wire dtype and marked; the others stay whole."""
    codings = {"a": DeltaCoding(Positions.GAPS, 30, 30), "c": DeltaCoding(Positions.INDICES, 0, 0)}
    metas = [
        TensorMeta("a", torch.float32, (64, 64)),
        TensorMeta("b", torch.float32, (100,)),
        TensorMeta("c", torch.float32, (10,)),
    ]
    (bucket,) = plan_metadata(metas, 1 << 20, 256, torch.bfloat16, deltas=codings)
    a, b, c = bucket.tensors
    assert (a.delta, b.delta, c.delta) == (codings["a"], None, codings["c"])
    assert (a.nbytes, b.nbytes, c.nbytes) == (codings["a"].nbytes(2), 200, 0)  # bf16 on the wire
    assert a.shape == (64, 64) and all(t.dtype == torch.bfloat16 for t in bucket.tensors)
    assert (a.offset, b.offset, c.offset) == (0, 256, 512) and bucket.size_bytes == 512
    assert bucket.has_delta and bucket.lone is None
    (whole,) = plan_metadata(metas, 1 << 20, 256, torch.bfloat16)
    assert not whole.has_delta and all(t.delta is None for t in whole.tensors)


def test_a_lone_delta_entry_is_not_sent_as_a_lone_tensor() -> None:
    """A delta entry alone in its bucket still needs expanding: ``Bucket.lone`` is None for it, not for a whole one."""
    metas = [TensorMeta("a", torch.float32, (1000,)), TensorMeta("b", torch.float32, (1000,))]
    coding = DeltaCoding(Positions.BITMAP, 300, bitmap_bytes(1000))
    buckets = plan_metadata(metas, 1 << 20, 256, solo_bytes=1000, deltas={"a": coding})
    by_name = {b.tensors[0].name: b for b in buckets}
    assert [len(b.tensors) for b in buckets] == [1, 1]
    assert by_name["a"].size_bytes == coding.nbytes(4) and by_name["a"].lone is None and by_name["a"].has_delta
    assert by_name["b"].lone is by_name["b"].tensors[0] and not by_name["b"].has_delta


def test_a_bucket_of_unchanged_tensors_is_zero_bytes_and_validates() -> None:
    """When nothing changed every entry is empty: one bucket of 0 bytes, which the engine accepts."""
    unchanged = DeltaCoding(Positions.INDICES, 0, 0)
    metas = [TensorMeta("w", torch.float32, (4, 8)), TensorMeta("b", torch.bfloat16, (20,))]
    buckets = plan_metadata(metas, 1 << 20, 256, deltas={"w": unchanged, "b": unchanged})
    assert [b.size_bytes for b in buckets] == [0]
    assert all(t.nbytes == 0 and t.delta == unchanged for t in buckets[0].tensors)
    v = UpdateValidator(SPECS, ALIASES)
    v.header_message(delta_header(total_bytes=0))
    assert v.bucket_messages([bucket_spec(buckets[0])]) == buckets
    v.finish_stream()


# ------------------------------------------------------- packing and expanding


class Served:
    """An engine's served weights by name: what a receive site's ``WeightTarget.get_weight`` reads."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = dict(weights)

    def get_weight(self, name: str) -> torch.Tensor:
        return self.weights[name]


def delta_update(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], bucket_bytes: int = 8192
) -> tuple[list[Bucket], list[torch.Tensor]]:
    """The planned buckets of the delta of ``new`` against ``base`` (in the wire dtype), each packed."""
    encoded = {n: encode(new[n], base[n]) for n in new}
    deltas = {n: e.coding for n, e in encoded.items() if e is not None}
    buckets = plan_metadata(metas_of(new), bucket_bytes, 256, deltas=deltas)
    payloads = {n: new[n] if e is None else e.payload for n, e in encoded.items()}
    flats = [pack_bucket(b, payloads, torch.full((b.size_bytes,), 0xAB, dtype=torch.uint8)) for b in buckets]
    return buckets, flats


def model(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shapes = {"a": (64, 64), "b": (100,), "c": (3000,), "d": (10,), "e": ()}
    return {n: random_tensor(s, dtype, i) for i, (n, s) in enumerate(shapes.items())}


def changed(base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``a`` at 1%, ``b`` everywhere (whole), ``c`` every 40 elements then after a long gap (bridged gaps), ``d``
    and ``e`` unchanged."""
    new = {n: t.clone() for n, t in base.items()}
    new["a"], _ = perturbed(base["a"], 41)
    new["b"], _ = perturbed(base["b"], 100)
    bits(new["c"])[[*range(0, 1000, 40), 2500]] ^= 1
    return new


def test_a_packed_delta_update_expands_into_the_new_tensors() -> None:
    """Pack then expand against the served weights: every tensor bit for bit, the served weights untouched, and
    each bucket's digest that of its whole tensors."""
    served = model(torch.bfloat16)
    kept = {n: t.clone() for n, t in served.items()}
    new = changed(served)
    buckets, flats = delta_update(served, new)
    slots = [t for b in buckets for t in b.tensors]
    assert {t.name: (t.delta is not None) for t in slots} == {"a": True, "b": False, "c": True, "d": True, "e": True}
    c = next(t.delta for t in slots if t.name == "c")
    assert c is not None and c.positions is Positions.GAPS and c.changed > 26  # bridged
    given: list[torch.Tensor] = []

    def buffer_for(t: TensorSlot) -> torch.Tensor | None:  # a receiver's pool: every other tensor in a given buffer
        if len(given) % 2:
            given.append(torch.empty(0, dtype=torch.uint8))
            return None
        given.append(torch.full((math.prod(t.shape) * t.dtype.itemsize,), 0xAB, dtype=torch.uint8))
        return given[-1]

    for b, flat in zip(buckets, flats, strict=True):
        hasher = BucketHasher()
        wholes = expand(flat, b, Served(served), buffer_for, hasher)
        assert [t.name for t, _ in wholes] == [t.name for t in b.tensors]
        for t, w in wholes:
            assert same_bits(w, new[t.name]), t.name
        assert hasher.digest() == digest_of(w for _t, w in wholes) == digest_of(new[t.name] for t in b.tensors)
    rebuilt_in_given = [w for _t, w in wholes if any(w.data_ptr() == g.data_ptr() for g in given if g.numel())]
    assert rebuilt_in_given, "no delta entry was rebuilt in the buffer it was given"
    assert all(same_bits(served[n], kept[n]) for n in served)


def test_a_corrupt_entry_among_others_fails_the_bucket_and_leaves_the_served_weights() -> None:
    """The entries of a bucket are rebuilt on lanes: one corrupt entry (a zero gap) fails the whole bucket with
    DELTA_CORRUPT once the entries rebuilt beside it ended, and the served weights are untouched."""
    served = model(torch.bfloat16)
    kept = {n: t.clone() for n, t in served.items()}
    new = changed(served)
    (bucket,), (flat,) = delta_update(served, new, bucket_bytes=1 << 20)
    c = next(t for t in bucket.tensors if t.name == "c")
    assert c.delta is not None and sum(t.delta is not None for t in bucket.tensors) >= 3
    flat[c.end - 1] = 0  # the last gap
    with pytest.raises(InvalidArgument) as e:
        expand(flat, bucket, Served(served), hasher=BucketHasher())
    assert e.value.reason == "DELTA_CORRUPT" and "'c'" in str(e.value)
    assert all(same_bits(served[n], kept[n]) for n in served)


def test_a_delta_applies_to_weights_served_in_another_dtype() -> None:
    """Served fp32 weights are read in the bf16 wire dtype, the delta applied to that copy, fp32 left untouched."""
    served = model(torch.float32)
    kept = {n: t.clone() for n, t in served.items()}
    base = {n: t.to(torch.bfloat16) for n, t in served.items()}
    new = changed(base)
    buckets, flats = delta_update(base, new)
    for b, flat in zip(buckets, flats, strict=True):
        for t, w in expand(flat, b, Served(served)):
            assert same_bits(w, new[t.name]), t.name
    assert all(same_bits(served[n], kept[n]) for n in served)


def test_a_delta_applies_to_non_contiguous_weights_served_in_another_dtype() -> None:
    """A served fp32 tensor with transposed strides, converted to the bf16 wire dtype: the delta still lands."""
    served = random_tensor((8, 4), torch.float32).t()  # (4, 8), non-contiguous
    base = served.to(torch.bfloat16).contiguous()
    new, _ = perturbed(base, 3)
    enc = encode(new, base, Positions.INDICES)
    assert enc is not None
    slot = TensorSlot("w", torch.bfloat16, (4, 8), 0, enc.coding.nbytes(2), "w", delta=enc.coding)
    ((_, whole),) = expand(enc.payload, Bucket(0, slot.nbytes, (slot,)), Served({"w": served}))
    assert same_bits(whole, new)


def test_a_delta_for_a_tied_alias_reads_the_canonical_served_tensor() -> None:
    """A delta declared under an alias applies to the tensor the engine serves under its canonical name."""
    emb = random_tensor((16,), torch.bfloat16)
    new, _ = perturbed(emb, 2)
    enc = encode(new, emb, Positions.INDICES)
    assert enc is not None
    v = validator()
    d = DELTA_POSITIONS[enc.coding.positions]
    (b,) = v.bucket_messages(
        [
            pb.BucketSpec(
                index=0,
                size_bytes=enc.coding.nbytes(2),
                tensors=[spec("lm_head", "bfloat16", [16], d, enc.coding.changed, enc.coding.positions_bytes)],
            )
        ]
    )
    ((slot, whole),) = expand(enc.payload, b, Served({"emb": emb}))
    assert slot.canonical == "emb" and same_bits(whole, new)


def test_a_served_tensor_the_workers_cannot_read_fails_the_precondition() -> None:
    """A target without the tensor a delta applies to: FAILED_PRECONDITION DELTA_BASE_UNREADABLE."""
    served = model(torch.bfloat16)
    buckets, flats = delta_update(served, changed(served))
    with pytest.raises(FailedPrecondition) as e:
        expand(flats[0], buckets[0], Served({}))
    assert e.value.reason == "DELTA_BASE_UNREADABLE"


@pytest.mark.parametrize(
    "payload",
    [lambda p: p[:-1], lambda p: torch.cat([p, p[:1]]), lambda p: p.to(torch.int16)],
    ids=["short", "long", "not-bytes"],
)
def test_packing_refuses_a_delta_payload_that_is_not_the_planned_bytes(
    payload: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """``pack_bucket`` copies a delta entry's bytes as they are: exactly ``nbytes`` of ``uint8``, or ValueError."""
    base = random_tensor((500,), torch.float32)
    new, _ = perturbed(base, 10)
    enc = encode(new, base)
    assert enc is not None
    (b,) = plan_metadata([TensorMeta("w", torch.float32, (500,))], deltas={"w": enc.coding})
    out = torch.zeros(b.size_bytes, dtype=torch.uint8)
    assert torch.equal(pack_bucket(b, {"w": enc.payload}, out), enc.payload)
    with pytest.raises(ValueError, match="delta entry"):
        pack_bucket(b, {"w": payload(enc.payload)}, out)


# ---------------------------------------------------------------------- wire


def test_the_wire_enum_agrees_with_the_codec() -> None:
    """``wire.convert.DELTA_POSITIONS`` and ``core.delta.POSITIONS_BY_NUMBER`` are both ``wsync.v1.DeltaPositions``."""
    assert {n: p for p, n in DELTA_POSITIONS.items()} == POSITIONS_BY_NUMBER
    assert set(pb.DeltaPositions.values()) == {pb.DELTA_POSITIONS_UNSPECIFIED, *POSITIONS_BY_NUMBER}
    for number, p in POSITIONS_BY_NUMBER.items():
        assert pb.DeltaPositions.Name(number) == f"DELTA_POSITIONS_{p.name}"


def test_bucket_specs_with_deltas_round_trip_through_the_validator() -> None:
    """A planned delta update's specs validate back into the very buckets planned, delta codings included."""
    served = model(torch.bfloat16)
    buckets, _ = delta_update(served, changed(served), bucket_bytes=256)
    assert len(buckets) > 1
    specs = [bucket_spec(b) for b in buckets]
    for b, s in zip(buckets, specs, strict=True):
        for t, ts in zip(b.tensors, s.tensors, strict=True):
            assert ts.HasField("delta") == (t.delta is not None)
            if t.delta is not None:
                assert POSITIONS_BY_NUMBER[ts.delta.positions] is t.delta.positions
                assert (ts.delta.changed_elements, ts.delta.positions_bytes) == (
                    t.delta.changed,
                    t.delta.positions_bytes,
                )
    specs_model = {n: ParamSpec(n, t.dtype, tuple(t.shape)) for n, t in served.items()}
    v = UpdateValidator(specs_model, {})
    v.header_message(delta_header(bucket_count=len(buckets), total_bytes=total_wire_bytes(buckets)))
    assert v.bucket_messages(specs) == buckets
    v.finish_stream()


def test_gaps16_bridges_a_gap_longer_than_65535() -> None:
    """Two changes 70,000 elements apart in 2-byte gaps: one bridging entry at an unchanged position between them,
    4 bytes of positions for 3 entries' 6 bytes of values, and the round trip is exact."""
    base = random_tensor((100_000,), torch.bfloat16)
    new = base.clone()
    new[10] += 1
    new[70_010] += 1
    enc = encode(new, base, Positions.GAPS16)
    assert enc is not None and enc.changed_elements == 2
    assert enc.coding == DeltaCoding(Positions.GAPS16, 3, 6)
    assert same_bits(apply_delta(enc.payload, enc.coding, base), new)
