"""The ``wsync.v1`` contract reference, generated from ``proto/wsync/v1/*.proto`` and their comments.

``protoc`` (grpcio-tools, the ``dev`` extra) compiles the proto files into a descriptor set with source
info; every service, RPC, message, field, enum and enum value is written out with the comment above it,
so the reference says exactly what the ``.proto`` files say (``make docs`` regenerates it, a test keeps
it fresh).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2 as d

_LABELS = {d.FieldDescriptorProto.LABEL_REPEATED: "repeated "}
_SCALARS = {
    d.FieldDescriptorProto.TYPE_DOUBLE: "double",
    d.FieldDescriptorProto.TYPE_FLOAT: "float",
    d.FieldDescriptorProto.TYPE_INT64: "int64",
    d.FieldDescriptorProto.TYPE_UINT64: "uint64",
    d.FieldDescriptorProto.TYPE_INT32: "int32",
    d.FieldDescriptorProto.TYPE_FIXED64: "fixed64",
    d.FieldDescriptorProto.TYPE_FIXED32: "fixed32",
    d.FieldDescriptorProto.TYPE_BOOL: "bool",
    d.FieldDescriptorProto.TYPE_STRING: "string",
    d.FieldDescriptorProto.TYPE_BYTES: "bytes",
    d.FieldDescriptorProto.TYPE_UINT32: "uint32",
    d.FieldDescriptorProto.TYPE_SFIXED32: "sfixed32",
    d.FieldDescriptorProto.TYPE_SFIXED64: "sfixed64",
    d.FieldDescriptorProto.TYPE_SINT32: "sint32",
    d.FieldDescriptorProto.TYPE_SINT64: "sint64",
}


def descriptor_set(proto_root: Path, files: Sequence[Path]) -> d.FileDescriptorSet:
    """Compile ``files`` (under ``proto_root``) with ``grpc_tools.protoc``, keeping their comments."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_root}", "--include_source_info"]
        cmd += [f"--descriptor_set_out={out}", *(str(f.relative_to(proto_root)) for f in files)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        fds = d.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
        return fds


class _Comments:
    """Source path -> the comment above it (leading, else trailing) of one file."""

    def __init__(self, f: d.FileDescriptorProto) -> None:
        self.by_path: dict[tuple[int, ...], str] = {}
        self.detached: dict[tuple[int, ...], list[str]] = {}
        for loc in f.source_code_info.location:
            text = loc.leading_comments or loc.trailing_comments
            if text:
                self.by_path[tuple(loc.path)] = text
            if loc.leading_detached_comments:
                self.detached[tuple(loc.path)] = list(loc.leading_detached_comments)

    def __call__(self, *path: int) -> str:
        return _dedent(self.by_path.get(path, ""))


def _dedent(comment: str) -> str:
    lines = [line[1:] if line.startswith(" ") else line for line in comment.rstrip().splitlines()]
    return "\n".join(lines).strip("\n")


def _cell(comment: str) -> str:
    """A comment as one table cell: paragraphs kept apart, pipes escaped."""
    paragraphs = [" ".join(p.split()) for p in comment.split("\n\n")]
    return "<br><br>".join(p for p in paragraphs if p).replace("|", "\\|") or "—"


def _block(comment: str) -> str:
    """A comment as a preformatted-free paragraph block (its own line breaks inside paragraphs joined)."""
    out: list[str] = []
    for paragraph in comment.split("\n\n"):
        lines = paragraph.splitlines()
        if any(line.startswith("  ") for line in lines[1:]):  # a listing: keep its layout
            out.append("```text\n" + paragraph + "\n```")
        else:
            out.append(" ".join(paragraph.split()))
    return "\n\n".join(p for p in out if p)


def _anchor(full_name: str) -> str:
    return full_name.lower().replace(".", "")


def _type_name(field: d.FieldDescriptorProto, package: str) -> str:
    if field.type_name:
        name = field.type_name.lstrip(".")
        short = name.removeprefix(package + ".")
        if name.startswith(package + "."):
            return f"[`{short}`](#{_anchor(name)})"
        return f"`{short}`"
    return f"`{_SCALARS.get(field.type, str(field.type))}`"


def _messages(
    messages: Sequence[d.DescriptorProto], prefix: str, path: tuple[int, ...], comments: _Comments, package: str
) -> Iterator[str]:
    for i, m in enumerate(messages):
        full = f"{prefix}.{m.name}"
        here = (*path, i)
        yield f"### {full.removeprefix(package + '.')} {{#{_anchor(full)}}}\n"
        if doc := comments(*here):
            yield _block(doc) + "\n"
        if m.field:
            yield "| Field | Type | Description |\n|---|---|---|"
            for j, f in enumerate(m.field):
                oneof = ""
                if f.HasField("oneof_index") and not f.proto3_optional:
                    oneof = f" (oneof `{m.oneof_decl[f.oneof_index].name}`)"
                kind = _LABELS.get(f.label, "optional " if f.proto3_optional else "")
                typ = f"{kind}{_type_name(f, package)}"
                yield f"| `{f.name}` = {f.number}{oneof} | {typ} | {_cell(comments(*here, 2, j))} |"
            yield ""
        else:
            yield "*No fields.*\n"
        yield from _enums(m.enum_type, full, (*here, 4), comments, package)
        yield from _messages(m.nested_type, full, (*here, 3), comments, package)


def _enums(
    enums: Sequence[d.EnumDescriptorProto], prefix: str, path: tuple[int, ...], comments: _Comments, package: str
) -> Iterator[str]:
    for i, e in enumerate(enums):
        full = f"{prefix}.{e.name}"
        here = (*path, i)
        yield f"### {full.removeprefix(package + '.')} {{#{_anchor(full)}}}\n"
        if doc := comments(*here):
            yield _block(doc) + "\n"
        yield "| Value | Number | Description |\n|---|---|---|"
        for j, v in enumerate(e.value):
            yield f"| `{v.name}` | {v.number} | {_cell(comments(*here, 2, j))} |"
        yield ""


def _services(f: d.FileDescriptorProto, comments: _Comments) -> Iterator[str]:
    for i, s in enumerate(f.service):
        full = f"{f.package}.{s.name}"
        yield f"## Service {s.name} {{#{_anchor(full)}}}\n"
        if doc := comments(6, i):
            yield _block(doc) + "\n"
        yield "| RPC | Request | Response |\n|---|---|---|"
        for m in s.method:
            req = ("stream " if m.client_streaming else "") + f"[`{m.input_type.rsplit('.', 1)[-1]}`]"
            resp = ("stream " if m.server_streaming else "") + f"[`{m.output_type.rsplit('.', 1)[-1]}`]"
            req += f"(#{_anchor(m.input_type.lstrip('.'))})"
            resp += f"(#{_anchor(m.output_type.lstrip('.'))})"
            yield f"| [`{m.name}`](#{_anchor(full + '.' + m.name)}) | {req} | {resp} |"
        yield ""
        for j, m in enumerate(s.method):
            yield f"### {s.name}.{m.name} {{#{_anchor(full + '.' + m.name)}}}\n"
            shape = {(False, False): "unary", (True, False): "client-streaming"}.get(
                (m.client_streaming, m.server_streaming), "server-streaming" if not m.client_streaming else "bidi"
            )
            yield f"`rpc {m.name}({m.input_type.lstrip('.')}) returns ({m.output_type.lstrip('.')})`: {shape}\n"
            if doc := comments(6, i, 2, j):
                yield _block(doc) + "\n"


def file_reference(f: d.FileDescriptorProto) -> str:
    """One proto file's reference page, in Markdown."""
    comments = _Comments(f)
    parts = [f"# `{f.name}`\n", f"Package `{f.package}`. Generated from the proto file; do not edit.\n"]
    header = comments.detached.get((12,), []) or ([comments(12)] if comments(12) else [])
    parts += [_block(_dedent(h)) + "\n" for h in header]
    parts += list(_services(f, comments))
    if f.message_type:
        parts.append("## Messages\n")
        parts += list(_messages(f.message_type, f.package, (4,), comments, f.package))
    if f.enum_type:
        parts.append("## Enums\n")
        parts += list(_enums(f.enum_type, f.package, (5,), comments, f.package))
    return "\n".join(parts).rstrip() + "\n"


def all_names(fds: d.FileDescriptorSet) -> set[str]:
    """Every RPC, message, field, enum and enum value the descriptor set declares, as ``pkg.Name[.member]``."""
    names: set[str] = set()

    def walk(ms: Sequence[d.DescriptorProto], prefix: str) -> None:
        for m in ms:
            names.add(f"{prefix}.{m.name}")
            names.update(f"{prefix}.{m.name}.{f.name}" for f in m.field)
            for e in m.enum_type:
                names.add(f"{prefix}.{m.name}.{e.name}")
                names.update(v.name for v in e.value)
            walk(m.nested_type, f"{prefix}.{m.name}")

    for f in fds.file:
        walk(f.message_type, f.package)
        for e in f.enum_type:
            names.add(f"{f.package}.{e.name}")
            names.update(v.name for v in e.value)
        for s in f.service:
            names.update(f"{f.package}.{s.name}.{m.name}" for m in s.method)
    return names
