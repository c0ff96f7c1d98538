"""The wsync.v1 contract: the promised RPCs and shapes, message round-trips, runtime versions."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from wsync.v1 import generation_pb2, weight_sync_pb2, weight_sync_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

# RPC -> (client streams, server streams)
PROMISED = {
    "Init": (False, False),
    "Prepare": (True, False),
    "Update": (False, False),
    "Complete": (False, False),
    "Pause": (False, False),
    "Resume": (False, False),
    "GetStatus": (False, False),
    "Cancel": (False, False),
    "Leave": (False, False),
    "GetWeightChecksums": (False, False),
    "Watch": (False, True),
    "KeepAlive": (False, True),
    "ListAdapters": (False, False),
    "UnloadAdapter": (False, False),
}


def test_service_has_the_promised_rpcs_and_shapes() -> None:
    svc = weight_sync_pb2.DESCRIPTOR.services_by_name["WeightSyncService"]
    assert svc.full_name == "wsync.v1.WeightSyncService"
    got = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
    assert got == PROMISED
    for m in svc.methods:  # every RPC its own Request/Response pair
        assert m.input_type.name == f"{m.name}Request"
        assert m.output_type.name == f"{m.name}Response"
    assert len({m.input_type.name for m in svc.methods}) == len(svc.methods)


def test_prepare_stream_is_header_bucket_or_batch() -> None:
    d = weight_sync_pb2.PrepareRequest.DESCRIPTOR
    assert [f.name for f in d.oneofs_by_name["kind"].fields] == ["header", "bucket", "buckets"]


def test_enums_start_unspecified() -> None:
    for fd in (weight_sync_pb2.DESCRIPTOR, generation_pb2.DESCRIPTOR):
        for name, enum in fd.enum_types_by_name.items():
            snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
            assert enum.values_by_number[0].name == f"{snake}_UNSPECIFIED", name


def _all_messages() -> list[descriptor.Descriptor]:
    out = []
    for fd in (weight_sync_pb2.DESCRIPTOR, generation_pb2.DESCRIPTOR):
        out += list(fd.message_types_by_name.values())
    return out


def _fill(msg: Message, depth: int = 0) -> None:
    """Set every field of ``msg`` to a non-default value (one branch of each oneof)."""
    d = msg.DESCRIPTOR
    for f in d.fields:
        if f.containing_oneof is not None and f.containing_oneof.fields[0] is not f:
            continue
        repeated = f.is_repeated
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            sub = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
            if f.message_type.full_name == "google.protobuf.Duration":
                sub.FromMilliseconds(1500)
            else:
                _fill(sub, depth + 1)
                if not repeated and not sub.ListFields():
                    sub.SetInParent()
            continue
        if f.type == FieldDescriptor.TYPE_ENUM:
            value: object = f.enum_type.values[-1].number
        elif f.type == FieldDescriptor.TYPE_STRING:
            value = f"{f.name}-välue-✓"
        elif f.type == FieldDescriptor.TYPE_BYTES:
            value = b"\x00\xff"
        elif f.type == FieldDescriptor.TYPE_BOOL:
            value = True
        elif f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            value = 2.5
        elif f.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_INT32):
            value = -7
        else:
            value = 2**31 + 7 if f.type == FieldDescriptor.TYPE_UINT64 else 4096
        if repeated:
            getattr(msg, f.name).extend([value, value])
        else:
            setattr(msg, f.name, value)


@pytest.mark.parametrize("desc", _all_messages(), ids=lambda d: d.name)
def test_every_message_round_trips(desc: descriptor.Descriptor) -> None:
    cls = message_factory.GetMessageClass(desc)
    msg = cls()
    _fill(msg)
    wire = msg.SerializeToString()
    back = cls.FromString(wire)
    assert back == msg
    for f in desc.fields:  # nothing was left at its default, except the other oneof branches
        if f.containing_oneof is None or f.containing_oneof.fields[0] is f:
            if f.is_repeated:
                assert len(getattr(back, f.name)) >= 1, f.name
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                assert back.HasField(f.name), f.name
            else:
                assert getattr(back, f.name) != f.default_value, f.name


def _generated_protobuf_version() -> tuple[int, int, int]:
    text = (ROOT / "generated" / "wsync" / "v1" / "weight_sync_pb2.py").read_text()
    m = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
        text,
    )
    assert m, "generated code carries no protobuf version check"
    return int(m[1]), int(m[2]), int(m[3])


def _declared_minimum(package: str) -> tuple[int, ...]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{re.escape(package)}>=([0-9.]+)', text)
    assert m, f"pyproject.toml declares no minimum for {package}"
    return tuple(int(x) for x in m[1].split("."))


def test_declared_protobuf_minimum_covers_generated_code() -> None:
    assert _declared_minimum("protobuf") >= _generated_protobuf_version()


def test_declared_grpcio_minimum_covers_generated_stubs() -> None:
    text = (ROOT / "generated" / "wsync" / "v1" / "weight_sync_pb2_grpc.py").read_text()
    m = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", text)
    assert m
    assert _declared_minimum("grpcio") >= tuple(int(x) for x in m[1].split("."))


def test_generated_stub_is_usable() -> None:
    channel = grpc.insecure_channel("127.0.0.1:1")
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
    for name in PROMISED:
        assert callable(getattr(stub, name))
    channel.close()


def test_every_rpc_and_field_is_commented() -> None:
    for proto in (ROOT / "proto" / "wsync" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if re.match(r"(rpc |message |enum |[a-z].* = \d+;|[A-Z_]+ = \d+;)", s):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1}: {s}"
