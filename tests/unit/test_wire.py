"""Proto <-> domain conversion (wire.convert, and the engine's Init parameters in service.membership)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from google.protobuf import duration_pb2
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.digests import Digest, DigestAlgorithm
from wsync_grpc.core.engine import PauseMode
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Bucket, Layout, TensorSlot, Transport
from wsync_grpc.core.lifecycle import State
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S
from wsync_grpc.group.process_group import DEFAULT_GROUP_NAME
from wsync_grpc.service.membership import group_info, init_params
from wsync_grpc.wire.convert import (
    APPLY_MODES,
    BACKENDS,
    DIGEST_ALGORITHMS,
    LAYOUTS,
    PAUSE_MODES,
    TRANSPORTS,
    backend_from_proto,
    backend_to_proto,
    bucket_spec,
    declared_digests,
    digest_from_proto,
    digest_to_proto,
    duration,
    from_proto,
    header_from_proto,
    header_to_proto,
    seconds,
    state_to_proto,
    transport_from_proto,
)

# (map, its domain enum or None for backend names, its proto enum, what UNSPECIFIED means)
MAPS: list[tuple[Mapping[Any, int], type[enum.Enum] | None, Any, object]] = [
    (LAYOUTS, Layout, pb.BucketLayout, Layout.FLATTENED),
    (APPLY_MODES, ApplyMode, pb.ApplyMode, ApplyMode.STAGED),
    (TRANSPORTS, Transport, pb.Transport, Transport.BROADCAST),
    (PAUSE_MODES, PauseMode, pb.PauseMode, PauseMode.ABORT),
    (BACKENDS, None, pb.Backend, ""),
    (DIGEST_ALGORITHMS, DigestAlgorithm, pb.DigestAlgorithm, DigestAlgorithm.XXH3_128),
]
IDS = ["layout", "apply_mode", "transport", "pause_mode", "backend", "digest_algorithm"]


@pytest.mark.parametrize(("table", "domain", "proto", "default"), MAPS, ids=IDS)
def test_each_map_is_one_to_one_and_covers_both_enums(
    table: Mapping[Any, int], domain: type[enum.Enum] | None, proto: Any, default: object
) -> None:
    defined = {v for v in proto.values() if v != 0}
    assert set(table.values()) == defined, "every defined proto value has one domain value"
    assert len(set(table.values())) == len(table)
    if domain is not None:
        assert set(table) == set(domain)
    for value, number in table.items():
        assert from_proto(table, number, default, "x") == value
        # The domain value's name is the proto value's suffix (PAUSE_MODE_KEEP <-> PauseMode.KEEP, "gloo" <-> GLOO).
        name = value.name if isinstance(value, enum.Enum) else str(value).upper()
        assert proto.Name(number).endswith("_" + name)
    assert from_proto(table, 0, default, "x") == default


@pytest.mark.parametrize(("table", "domain", "proto", "default"), MAPS, ids=IDS)
def test_undefined_numbers_are_refused(
    table: Mapping[Any, int], domain: type[enum.Enum] | None, proto: Any, default: object
) -> None:
    with pytest.raises(InvalidArgument) as e:
        from_proto(table, 99, default, "some_field")
    assert e.value.reason == "UNKNOWN_ENUM_VALUE"
    assert e.value.message == "some_field value 99 is not defined in wsync.v1"


def test_backends_both_ways() -> None:
    assert backend_from_proto(pb.BACKEND_UNSPECIFIED) == ""
    assert backend_from_proto(pb.BACKEND_GLOO) == "gloo"
    assert backend_from_proto(pb.BACKEND_NCCL) == "nccl"
    assert backend_to_proto("nccl") == pb.BACKEND_NCCL
    assert backend_to_proto("") == pb.BACKEND_UNSPECIFIED
    assert backend_to_proto("mpi") == pb.BACKEND_UNSPECIFIED
    with pytest.raises(InvalidArgument, match="backend value 7"):
        backend_from_proto(7)


def test_transport_defaults_to_broadcast() -> None:
    assert transport_from_proto(pb.TRANSPORT_UNSPECIFIED) is Transport.BROADCAST
    assert transport_from_proto(pb.TRANSPORT_DISK) is Transport.DISK
    with pytest.raises(InvalidArgument, match="transport value 42"):
        transport_from_proto(42)


@pytest.mark.parametrize("state", list(State))
def test_states_are_the_lifecycle_state_numbers(state: State) -> None:
    assert pb.LifecycleState.Name(state_to_proto(state)) == f"LIFECYCLE_STATE_{state.name}"


# ------------------------------------------------------------------ durations


@pytest.mark.parametrize("s", [0.001, 1.5, 30.0, 120.0, 3600.25])
def test_durations_round_trip(s: float) -> None:
    assert seconds(duration(s), default=-1.0) == pytest.approx(s, abs=1e-9)


def test_an_unset_or_zero_duration_means_the_default() -> None:
    assert seconds(duration_pb2.Duration(), 7.0) == 7.0
    assert seconds(duration(0), 7.0) == 7.0
    assert seconds(duration_pb2.Duration(nanos=250_000_000), 7.0) == 0.25


def test_a_negative_duration_is_refused() -> None:
    with pytest.raises(InvalidArgument) as e:
        seconds(duration_pb2.Duration(seconds=-1), 7.0)
    assert e.value.reason == "NEGATIVE_TIMEOUT"


# --------------------------------------------------------------------- header


def test_an_empty_header_takes_the_contract_defaults() -> None:
    h = header_from_proto(pb.PrepareHeader())
    assert (h.transport, h.layout, h.apply_mode) == (Transport.BROADCAST, Layout.FLATTENED, ApplyMode.STAGED)
    assert (h.update_id, h.weight_version, h.bucket_count, h.total_bytes, h.incremental) == ("", "", 0, 0, False)
    assert h.flattened and not h.streaming


def test_a_header_keeps_its_fields() -> None:
    h = header_from_proto(
        pb.PrepareHeader(
            update_id="u",
            weight_version="v7",
            layout=pb.BUCKET_LAYOUT_INDIVIDUAL,
            apply_mode=pb.APPLY_MODE_STREAMING,
            transport=pb.TRANSPORT_BROADCAST,
            bucket_count=3,
            total_bytes=1 << 40,
            incremental=True,
        )
    )
    assert (h.update_id, h.weight_version, h.bucket_count, h.total_bytes) == ("u", "v7", 3, 1 << 40)
    assert h.layout is Layout.INDIVIDUAL and h.apply_mode is ApplyMode.STREAMING and h.incremental
    assert not h.flattened and h.streaming


@pytest.mark.parametrize(
    "header",
    [
        UpdateHeader("u", "v1", Layout.FLATTENED, ApplyMode.STAGED, 3, 4096, False),
        UpdateHeader("u2", "v2", Layout.INDIVIDUAL, ApplyMode.STREAMING, 1 << 20, 1 << 40, True),
        UpdateHeader(
            "u3",
            "v3",
            Layout.INDIVIDUAL,
            ApplyMode.STAGED,
            0,
            0,
            False,
            transport=Transport.DISK,
            checkpoint_path="ckpt/step-3",
            adapter=LoraSpec("sql", 0, 0.0),
        ),
        UpdateHeader(
            "u4",
            "v4",
            Layout.FLATTENED,
            ApplyMode.STAGED,
            2,
            512,
            False,
            adapter=LoraSpec("math", 8, 16.0, ("q_proj", "v_proj")),
        ),
        UpdateHeader("u5", "v5", Layout.FLATTENED, ApplyMode.STREAMING, 4, 4096, False, digests_follow=True),
    ],
    ids=["flattened", "individual-streaming", "disk-adapter", "broadcast-adapter", "digests-follow"],
)
def test_a_header_round_trips_through_its_proto(header: UpdateHeader) -> None:
    msg = header_to_proto(header, owner="trainer-1")
    assert msg.owner == "trainer-1"
    assert msg.layout != 0 and msg.apply_mode != 0 and msg.transport != 0, "every enum written explicitly"
    assert header_from_proto(msg) == header
    assert header_to_proto(header_from_proto(msg), owner="trainer-1") == msg


@pytest.mark.parametrize("field", ["layout", "apply_mode", "transport"])
def test_a_header_with_an_undefined_enum_is_refused(field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        fields: dict[str, Any] = {field: 9}
        header_from_proto(pb.PrepareHeader(weight_version="v", **fields))
    assert e.value.reason == "UNKNOWN_ENUM_VALUE" and e.value.message.startswith(f"{field} value 9")


# --------------------------------------------------------------------- digests

DIGEST = Digest(DigestAlgorithm.XXH3_128, bytes(range(16)))


def test_a_digest_round_trips_and_travels_in_its_bucket_spec() -> None:
    assert digest_from_proto(digest_to_proto(DIGEST), 0) == DIGEST
    assert digest_from_proto(pb.BucketDigest(), 0) is None  # unset: no digest
    slot = TensorSlot("w", torch.float32, (4,), 0, 16, "w")
    spec = bucket_spec(Bucket(3, 16, (slot,), digest=DIGEST))
    assert spec.HasField("digest") and digest_from_proto(spec.digest, 3) == DIGEST
    assert not bucket_spec(Bucket(3, 16, (slot,))).HasField("digest")


@pytest.mark.parametrize(
    ("digest", "reason"),
    [
        (pb.BucketDigest(value=bytes(16)), "INVALID_DIGEST"),  # a value without an algorithm
        (pb.BucketDigest(algorithm=pb.DIGEST_ALGORITHM_XXH3_128, value=bytes(8)), "INVALID_DIGEST"),
        (pb.BucketDigest(algorithm=pb.DIGEST_ALGORITHM_XXH3_128), "INVALID_DIGEST"),
        (pb.BucketDigest(algorithm=7, value=bytes(16)), "UNKNOWN_ENUM_VALUE"),
    ],
    ids=["no-algorithm", "short", "empty", "unknown-algorithm"],
)
def test_a_malformed_digest_is_refused_naming_its_bucket(digest: pb.BucketDigest, reason: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        digest_from_proto(digest, 5)
    assert e.value.reason == reason
    assert reason == "UNKNOWN_ENUM_VALUE" or e.value.metadata["bucket"] == "5"


def test_declared_digests_name_their_buckets_once_each() -> None:
    d = digest_to_proto(DIGEST)
    assert declared_digests([pb.DeclaredDigest(bucket_index=2, digest=d)] * 2) == {2: DIGEST}
    other = pb.BucketDigest(algorithm=pb.DIGEST_ALGORITHM_XXH3_128, value=bytes(16))
    with pytest.raises(InvalidArgument, match="two different digests"):
        declared_digests([pb.DeclaredDigest(bucket_index=2, digest=d), pb.DeclaredDigest(bucket_index=2, digest=other)])
    with pytest.raises(InvalidArgument, match="is empty"):
        declared_digests([pb.DeclaredDigest(bucket_index=1)])


# ----------------------------------------------------------- Init parameters

CPU = [torch.device("cpu")]


def init(**kw: Any) -> pb.InitRequest:
    fields: dict[str, Any] = dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2)
    fields.update(kw)
    return pb.InitRequest(**fields)


def test_init_defaults() -> None:
    p = init_params(init(), CPU)
    assert p == GroupParams("127.0.0.1", 29500, 1, 2, DEFAULT_GROUP_NAME, "gloo", DEFAULT_GROUP_TIMEOUT_S)
    assert init_params(init(), CPU) == p, "equal requests give equal parameters (Init is idempotent)"
    q = init_params(init(group_name="g", backend=pb.BACKEND_GLOO, timeout=duration(2.5)), CPU)
    assert (q.group_name, q.backend, q.timeout_s) == ("g", "gloo", 2.5)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"master_address": ""}, "MISSING_MASTER_ADDRESS"),
        ({"master_port": 0}, "INVALID_PORT"),
        ({"master_port": 65536}, "INVALID_PORT"),
        ({"rank_offset": 0}, "INVALID_RANK_OFFSET"),
        ({"world_size": 1}, "INVALID_WORLD_SIZE"),
        ({"backend": 5}, "UNKNOWN_ENUM_VALUE"),
        ({"backend": pb.BACKEND_NCCL}, "INVALID_BACKEND"),
        ({"timeout": duration_pb2.Duration(seconds=-3)}, "NEGATIVE_TIMEOUT"),
    ],
)
def test_init_refusals(fields: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        init_params(init(**fields), CPU)
    assert e.value.reason == reason, e.value.message


def test_the_world_must_hold_every_worker() -> None:
    two = [torch.device("cpu"), torch.device("cpu")]
    with pytest.raises(InvalidArgument) as e:
        init_params(init(rank_offset=2, world_size=3), two)
    assert e.value.message == "world_size 3 cannot hold ranks 2..3 of this engine's 2 worker(s)"
    assert init_params(init(rank_offset=2, world_size=4), two).world_size == 4


def test_group_info_of_a_joined_group() -> None:
    p = GroupParams("10.0.0.1", 1234, 3, 8, "g", "nccl", 90.5)
    info = group_info(p, ["cuda:0", "cuda:1"])
    assert list(info.ranks) == [3, 4] and list(info.devices) == ["cuda:0", "cuda:1"]
    assert info.backend == pb.BACKEND_NCCL and (info.group_name, info.world_size) == ("g", 8)
    assert (info.master_address, info.master_port) == ("10.0.0.1", 1234)
    assert seconds(info.timeout, 0.0) == 90.5
    assert group_info(None, ["cpu"]) == pb.GroupInfo()
