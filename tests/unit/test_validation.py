"""Update metadata validation (core.validation.UpdateValidator): the header, every bucket reason, all-or-none batches,
tied aliases, and the stream's final counts."""

from __future__ import annotations

import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import ParamSpec
from wsync_grpc.core.errors import InvalidArgument, Unimplemented
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.validation import PADDING_PER_TENSOR, UpdateValidator
from wsync_grpc.transports import transport_for

SPECS = {
    "w": ParamSpec("w", torch.float32, (2, 3)),  # 24 bytes
    "b": ParamSpec("b", torch.bfloat16, (4,)),  # 8 bytes
    "emb": ParamSpec("emb", torch.float16, (8,)),  # 16 bytes
    "steps": ParamSpec("steps", torch.int64, ()),  # 8 bytes
}
ALIASES = {"lm_head": "emb"}


def header(**kw: object) -> UpdateHeader:
    fields: dict[str, object] = dict(
        update_id="u1",
        weight_version="v1",
        layout=Layout.FLATTENED,
        apply_mode=ApplyMode.STAGED,
        bucket_count=1,
        total_bytes=24,
        incremental=False,
    )
    fields.update(kw)
    return UpdateHeader(**fields)  # type: ignore[arg-type]


def validator(**kw: object) -> UpdateValidator:
    v = UpdateValidator(SPECS, ALIASES)
    v.header_message(header(**kw))
    return v


def tensor(name: str, dtype: str, shape: list[int], offset: int = 0) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=shape, offset_bytes=offset)


def bucket(index: int, size: int, *tensors: pb.TensorSpec) -> pb.BucketSpec:
    return pb.BucketSpec(index=index, size_bytes=size, tensors=list(tensors))


W = tensor("w", "float32", [2, 3])
B = tensor("b", "bfloat16", [4])


def refused(v: UpdateValidator, *specs: pb.BucketSpec) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        v.bucket_messages(list(specs))
    return e.value


# ---------------------------------------------------------------------- header


def test_header_gets_a_fresh_update_id_when_none_is_given() -> None:
    v = UpdateValidator(SPECS, ALIASES)
    h = v.header_message(header(update_id=""))
    assert len(h.update_id) == 32 and int(h.update_id, 16) >= 0
    assert v.header == h
    assert UpdateValidator(SPECS, ALIASES).header_message(header()).update_id == "u1"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"weight_version": ""}, "MISSING_WEIGHT_VERSION"),
        ({"weight_version": "v" * (3 << 20)}, "VERSION_TOO_LONG"),  # a 3 MiB version
        ({"update_id": "u" * 257}, "UPDATE_ID_TOO_LONG"),
        ({"bucket_count": 0}, "EMPTY_UPDATE"),
        ({"bucket_count": len(SPECS) + len(ALIASES) + 1}, "TOO_MANY_BUCKETS"),
        ({"total_bytes": 10**12}, "TOO_MANY_BYTES"),
    ],
)
def test_header_refusals(fields: dict[str, object], reason: str) -> None:
    v = UpdateValidator(SPECS, ALIASES)
    with pytest.raises(InvalidArgument) as e:
        v.header_message(header(**fields))
    assert e.value.reason == reason
    assert v.header is None


def test_an_incremental_update_may_start_empty() -> None:
    h = UpdateValidator(SPECS, ALIASES).header_message(header(bucket_count=0, total_bytes=0, incremental=True))
    assert h.incremental and h.bucket_count == 0


def test_a_second_header_is_refused() -> None:
    v = validator()
    with pytest.raises(InvalidArgument) as e:
        v.header_message(header(update_id="u2"))
    assert e.value.reason == "DUPLICATE_HEADER"
    assert v.header is not None and v.header.update_id == "u1"


@pytest.mark.parametrize("transport", [Transport.CUDA_IPC, Transport.DISK])
def test_transports_not_offered_are_unimplemented(transport: Transport) -> None:
    """Without the registry a validator takes broadcasts only (the registry's parts check the others)."""
    with pytest.raises(Unimplemented) as e:
        UpdateValidator(SPECS, ALIASES).header_message(header(transport=transport))
    assert e.value.reason == "TRANSPORT_UNIMPLEMENTED"
    assert e.value.metadata == {"transport": f"TRANSPORT_{transport.name}"}
    assert UpdateValidator(SPECS, ALIASES).header_message(header()).transport is Transport.BROADCAST  # accepted


def test_the_registry_has_a_module_for_every_transport_of_the_contract() -> None:
    for kind in Transport:
        part = transport_for(kind)
        assert part.kind is kind
        assert (kind, part.needs_group, part.engine_builds_buckets) in {
            (Transport.BROADCAST, True, False),
            (Transport.DISK, False, True),
            (Transport.CUDA_IPC, False, False),
            (Transport.SHARED_MEMORY, False, False),
        }
    with pytest.raises(InvalidArgument) as ia:  # CUDA IPC is the colocated ring's: it needs the ring's handle
        transport_for(Transport.CUDA_IPC).check_header(header(transport=Transport.CUDA_IPC))
    assert ia.value.reason == "SHARED_MEMORY_HANDLE" and "TRANSPORT_CUDA_IPC" in ia.value.message
    with pytest.raises(InvalidArgument):
        UpdateValidator(SPECS, ALIASES, transports=transport_for).header_message(header(transport=Transport.CUDA_IPC))
    disk = UpdateValidator(SPECS, ALIASES, transports=transport_for).header_message(
        header(transport=Transport.DISK, checkpoint_path="ckpt", bucket_count=0, total_bytes=0)
    )
    assert (disk.transport, disk.layout) == (Transport.DISK, Layout.INDIVIDUAL)  # each tensor read on its own
    transport_for(Transport.BROADCAST).check_update()  # an incremental broadcast may declare more
    for kind in (Transport.DISK, Transport.CUDA_IPC):
        with pytest.raises(Unimplemented):
            transport_for(kind).check_update()


# --------------------------------------------------------------------- buckets


def test_a_valid_flattened_bucket_becomes_slots_at_their_offsets() -> None:
    v = validator(total_bytes=40)
    (got,) = v.bucket_messages([bucket(0, 40, W, tensor("b", "bfloat16", [4], 32))])
    assert (got.index, got.size_bytes) == (0, 40)
    w, b = got.tensors
    assert (w.name, w.dtype, w.shape, w.offset, w.nbytes, w.canonical, w.load) == (
        "w",
        torch.float32,
        (2, 3),
        0,
        24,
        "w",
        True,
    )
    assert (b.offset, b.nbytes, b.end) == (32, 8, 40)
    assert (v.buckets_declared, v.bytes_declared, v.tensors_declared) == (1, 40, 2)
    v.finish_stream()


def test_individual_layout_ignores_offsets_and_needs_exact_sizes() -> None:
    v = validator(layout=Layout.INDIVIDUAL, total_bytes=32)
    (got,) = v.bucket_messages([bucket(0, 32, tensor("w", "float32", [2, 3], 999), B)])
    assert [t.offset for t in got.tensors] == [0, 0]
    v2 = validator(layout=Layout.INDIVIDUAL)
    err = refused(v2, bucket(0, 40, W, B))
    assert err.reason == "BUCKET_SIZE_MISMATCH" and "add up exactly" in err.message


def test_a_served_dtype_may_arrive_as_another_float() -> None:
    v = validator()
    (got,) = v.bucket_messages([bucket(0, 12, tensor("w", "bfloat16", [2, 3]))])
    assert got.tensors[0].dtype == torch.bfloat16 and got.tensors[0].nbytes == 12


@pytest.mark.parametrize(
    ("spec", "reason", "tensor_meta"),
    [
        (bucket(1, 24, W), "BUCKET_OUT_OF_ORDER", None),
        (bucket(0, 0), "EMPTY_BUCKET", None),
        (bucket(0, 24, tensor("nope", "float32", [1])), "UNKNOWN_TENSOR", "nope"),
        (bucket(0, 48, W, tensor("w", "float32", [2, 3], 24)), "DUPLICATE_TENSOR", "w"),
        (bucket(0, 24, tensor("w", "complex64", [2, 3])), "UNSUPPORTED_DTYPE", "w"),
        (bucket(0, 24, tensor("w", "int32", [2, 3])), "DTYPE_MISMATCH", "w"),
        (bucket(0, 8, tensor("steps", "float64", [])), "DTYPE_MISMATCH", "steps"),
        (bucket(0, 24, tensor("w", "float32", [-2, -3])), "INVALID_SHAPE", "w"),
        (bucket(0, 24, tensor("w", "float32", [3, 2])), "SHAPE_MISMATCH", "w"),
        (bucket(0, 40, W, tensor("b", "bfloat16", [4], 25)), "MISALIGNED_OFFSET", "b"),
        (bucket(0, 30, W, tensor("b", "bfloat16", [4], 24)), "OFFSET_OUT_OF_BOUNDS", "b"),
        (bucket(0, 32, W, tensor("b", "bfloat16", [4], 16)), "OVERLAPPING_TENSORS", None),
        (bucket(0, 24 + PADDING_PER_TENSOR + 8, W), "BUCKET_SIZE_MISMATCH", None),
    ],
)
def test_each_bucket_refusal_names_its_bucket(spec: pb.BucketSpec, reason: str, tensor_meta: str | None) -> None:
    v = validator()
    err = refused(v, spec)
    assert err.reason == reason, err.message
    assert err.metadata["bucket"] == str(spec.index)
    if tensor_meta is not None:
        assert err.metadata["tensor"] == tensor_meta
    assert (v.buckets_declared, v.bytes_declared, v.tensors_declared) == (0, 0, 0)


def test_error_messages_shorten_huge_names() -> None:
    err = refused(validator(), bucket(0, 24, tensor("x" * 10_000, "float32", [1])))
    assert err.reason == "UNKNOWN_TENSOR"
    assert len(err.message) < 300 and len(err.metadata["tensor"]) == 120


# ----------------------------------------------------------- all-or-none batches


def test_a_refused_batch_leaves_the_validator_as_it_was() -> None:
    v = validator(bucket_count=3, total_bytes=40, incremental=True)
    v.bucket_messages([bucket(0, 24, W)])
    before = (v.buckets_declared, v.bytes_declared, v.tensors_declared)
    good = bucket(1, 8, B)
    bad = bucket(2, 8, tensor("nope", "float32", [1]))
    assert refused(v, good, bad).reason == "UNKNOWN_TENSOR"
    assert (v.buckets_declared, v.bytes_declared, v.tensors_declared) == before
    # Nothing of the refused batch counts: bucket 1 is expected again and "b" is not a duplicate.
    (again,) = v.bucket_messages([good])
    assert again.index == 1 and again.tensors[0].load
    # What was accepted before the refusal still counts.
    assert refused(v, bucket(2, 24, W)).reason == "DUPLICATE_TENSOR"


def test_a_duplicate_across_batches_is_refused() -> None:
    v = validator(bucket_count=2, incremental=True)
    v.bucket_messages([bucket(0, 24, W)])
    err = refused(v, bucket(1, 24, W))
    assert err.reason == "DUPLICATE_TENSOR" and "again in bucket 1" in err.message


# -------------------------------------------------------------------- aliases


def test_a_tied_alias_after_its_tensor_is_received_but_not_loaded() -> None:
    v = validator(total_bytes=32)
    (got,) = v.bucket_messages([bucket(0, 32, tensor("emb", "float16", [8]), tensor("lm_head", "float16", [8], 16))])
    emb, head = got.tensors
    assert (emb.canonical, emb.load) == ("emb", True)
    assert (head.name, head.canonical, head.load) == ("lm_head", "emb", False)


def test_the_first_name_of_a_tied_tensor_is_the_one_loaded() -> None:
    v = validator(bucket_count=2, incremental=True)
    (first,) = v.bucket_messages([bucket(0, 16, tensor("lm_head", "float16", [8]))])
    assert (first.tensors[0].canonical, first.tensors[0].load) == ("emb", True)
    (second,) = v.bucket_messages([bucket(1, 16, tensor("emb", "float16", [8]))])
    assert (second.tensors[0].name, second.tensors[0].load) == ("emb", False)


def test_an_alias_in_a_later_batch_is_not_loaded_but_the_tensor_again_is_a_duplicate() -> None:
    v = validator(bucket_count=1, incremental=True)
    v.bucket_messages([bucket(0, 16, tensor("emb", "float16", [8]))])
    (alias,) = v.bucket_messages([bucket(1, 16, tensor("lm_head", "float16", [8]))])
    assert not alias.tensors[0].load
    assert refused(v, bucket(2, 16, tensor("emb", "float16", [8]))).reason == "DUPLICATE_TENSOR"


def test_every_name_is_refused_the_second_time_alias_or_not() -> None:
    v = validator(bucket_count=1, incremental=True)
    v.bucket_messages([bucket(0, 32, tensor("emb", "float16", [8]), tensor("lm_head", "float16", [8], 16))])
    assert refused(v, bucket(1, 16, tensor("lm_head", "float16", [8]))).reason == "DUPLICATE_TENSOR"
    assert refused(v, bucket(1, 16, tensor("emb", "float16", [8]))).reason == "DUPLICATE_TENSOR"


# --------------------------------------------------------------- stream end


def test_the_stream_must_match_its_header() -> None:
    with pytest.raises(InvalidArgument) as e:
        UpdateValidator(SPECS, ALIASES).finish_stream()
    assert e.value.reason == "MISSING_HEADER"
    v = validator(bucket_count=2, total_bytes=32)
    v.bucket_messages([bucket(0, 24, W)])
    with pytest.raises(InvalidArgument) as e:
        v.finish_stream()
    assert e.value.reason == "BUCKET_COUNT_MISMATCH"
    v.bucket_messages([bucket(1, 16, B)])  # 24 + 16: two buckets, but not the 32 bytes announced
    with pytest.raises(InvalidArgument) as e:
        v.finish_stream()
    assert e.value.reason == "TOTAL_BYTES_MISMATCH"


def test_more_buckets_than_announced_are_refused_while_reading() -> None:
    v = validator(bucket_count=2)
    v.check_more_buckets(2)
    with pytest.raises(InvalidArgument) as e:
        v.check_more_buckets(3)
    assert e.value.reason == "BUCKET_COUNT_MISMATCH"


def test_adapter_specs_follow_the_targeted_linear_modules_and_the_engines_rank_limit() -> None:
    from wsync_grpc.core.lora import LinearShape, LoraSpec, adapter_param_specs

    linears = {"m.layers.0.q_proj": LinearShape(16, 32), "m.layers.0.o_proj": LinearShape(32, 16)}
    spec = LoraSpec("policy", 8, 16.0, ("q_proj",))
    specs = adapter_param_specs(linears, spec, max_rank=8)
    assert {n: s.shape for n, s in specs.items()} == {
        "base_model.model.m.layers.0.q_proj.lora_A.weight": (8, 16),
        "base_model.model.m.layers.0.q_proj.lora_B.weight": (32, 8),
    }
    with pytest.raises(InvalidArgument) as e:
        adapter_param_specs(linears, LoraSpec("policy", 16, 16.0, ("q_proj",)), max_rank=8)
    assert e.value.reason == "ADAPTER_RANK_TOO_LARGE" and "16" in e.value.message
    assert len(adapter_param_specs(linears, LoraSpec("policy", 64, 16.0, ("q_proj", "o_proj")))) == 4  # 0: any rank
