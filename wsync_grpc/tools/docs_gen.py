"""Generated documentation pages: the contract reference, the error reasons and the lifecycle diagram.

Each page is computed from the source of truth it documents, so it cannot drift from it:

- ``docs/reference/*-proto.md`` from ``proto/wsync/v1/*.proto`` and their comments (:mod:`.proto_docs`);
- ``docs/reference/errors.md`` from the code: every ``google.rpc.ErrorInfo`` reason an engine can send
  (the first argument of every :class:`~wsync_grpc.core.errors.WsyncError` raised in ``wsync_grpc``, with
  its status code) and every reason the trainer client reports of its own;
- ``docs/reference/cli.md`` from the ``wsync`` CLI's own argument parser;
- ``docs/reference/lifecycle.md`` from :mod:`wsync_grpc.core.lifecycle` (``TRANSITIONS``,
  ``WITHOUT_GROUP``, ``ALLOWED``, ``BUSY``), as a Mermaid state diagram and tables.

``python -m wsync_grpc.tools.docs_gen`` writes them; ``--check`` exits 1 naming the stale ones.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from wsync_grpc.core import lifecycle as lc
from wsync_grpc.tools import proto_docs
from wsync_grpc.wire.status import STATUS_CODES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "wsync_grpc"
PROTO_ROOT = ROOT / "proto"
REFERENCE = ROOT / "docs" / "reference"

_REASON = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")
_CODES = {cls.__name__: code.name for cls, code in STATUS_CODES.items()}
"""The categories of :mod:`wsync_grpc.core.errors` -> the gRPC status code the wire edge sends (its own table)."""

_TRAINER_FAILURE = "EngineFailure"
"""The trainer client's record of a failure; its ``reason`` argument is the 4th."""


_Found = tuple[str, str, ast.expr | None, str]
"""(reason, status code or "trainer", the message argument, the callee) of one reason found in the code."""


@dataclass
class Reason:
    """One error reason: the codes it is sent with, where it is raised, and an example message."""

    name: str
    codes: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)
    message: str = ""


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _message(node: ast.expr | None) -> str:
    """A message argument as text: constants kept, f-string holes shown as ``…``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message(node.left) + _message(node.right)
    return ""


def _error_classes(trees: dict[Path, ast.Module]) -> dict[str, str]:
    """Every subclass of ``WsyncError`` in the package -> its status code."""
    codes = dict(_CODES)
    changed = True
    while changed:
        changed = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in codes:
                    for base in node.bases:
                        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                        if name in codes:
                            codes[node.name] = codes[name]
                            changed = True
    return codes


def _reason_args(tree: ast.Module, classes: dict[str, str]) -> Iterator[_Found]:
    """(reason, code or "trainer", message node, callee) for every reason given to an error in ``tree``."""
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [None]:
        body = cls.body if cls is not None else tree.body
        for stmt in body:
            if cls is None and isinstance(stmt, ast.ClassDef):
                continue
            for node in ast.walk(stmt):
                if not isinstance(node, ast.Call):
                    continue
                name = _callee(node)
                if name == "__init__" and cls is not None and cls.name in classes:
                    name = cls.name
                if name in classes and node.args:
                    first, msg = node.args[0], node.args[1] if len(node.args) > 1 else None
                    yield from _constants(first, classes[name], msg, name)
                elif name == _TRAINER_FAILURE and len(node.args) > 4:
                    yield from _constants(node.args[3], "trainer", node.args[4], name)
                elif name == "read_all" and len(node.args) > 1:  # a capped read names its reason
                    yield from _constants(node.args[1], "INVALID_ARGUMENT", None, name)


def _constants(node: ast.expr, code: str, msg: ast.expr | None, callee: str) -> Iterator[_Found]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _REASON.match(node.value):
        yield node.value, code, msg, callee
    elif isinstance(node, ast.IfExp):
        yield from _constants(node.body, code, msg, callee)
        yield from _constants(node.orelse, code, msg, callee)


def error_reasons(package: Path = PACKAGE) -> tuple[dict[str, Reason], dict[str, Reason]]:
    """The reasons the code can report: (sent by engines, reported by the trainer client itself).

    Read from the source: an engine's reasons are the first argument of every ``WsyncError`` (or
    subclass) constructed in the package, and the reason a capped read (``read_all``) fails with; the
    trainer's own are the reasons of the ``EngineFailure`` records it makes without an engine's reply.
    """
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(package.rglob("*.py"))}
    classes = _error_classes(trees)
    engine: dict[str, Reason] = {}
    trainer: dict[str, Reason] = {}
    for path, tree in trees.items():
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        for name, code, msg, _ in _reason_args(tree, classes):
            table = trainer if code == "trainer" else engine
            r = table.setdefault(name, Reason(name))
            if code != "trainer":
                r.codes.add(code)
            r.modules.add(module)
            text = " ".join(_message(msg).split()) or "—"
            if not r.message or (text != "—" and len(text) > len(r.message)):
                r.message = text
    return engine, trainer


def errors_page() -> str:
    """``docs/reference/errors.md``: every error reason, with its codes and where it comes from."""
    engine, trainer = error_reasons()
    out = [
        "# Error reasons\n",
        "Generated from the code by `python -m wsync_grpc.tools.docs_gen`; do not edit. Every failing `wsync.v1`",
        "call carries a `google.rpc.ErrorInfo` (domain `wsync.v1`) whose `reason` is one of the names below; the",
        "trainer client shows it as `EngineFailure.reason`. The message is an example of the text that comes",
        "with it (`…` where the engine fills in names or numbers). Which code means what:",
        "[the contract's header](weight_sync-proto.md); what an engine does in each case:",
        "[failure semantics](../failure-semantics.md).\n",
        f"## Sent by engines ({len(engine)} reasons)\n",
        "| Reason | Status code | Example message | Raised in |",
        "|---|---|---|---|",
    ]
    for name in sorted(engine):
        r = engine[name]
        msg = r.message.replace("|", "\\|").replace("`", "'")[:200]
        modules = ", ".join(f"`{m}`" for m in sorted(r.modules))
        out.append(f"| `{name}` | {', '.join(f'`{c}`' for c in sorted(r.codes))} | {msg} | {modules} |")
    out += [
        "",
        f"## Reported by the trainer client ({len(trainer)} reasons)\n",
        "Failures the trainer finds itself, with no engine's reply (`EngineFailure.code` is `None`; the target",
        "is `trainer` when the trainer's own step failed).\n",
        "| Reason | Example message | Raised in |",
        "|---|---|---|",
    ]
    for name in sorted(trainer):
        r = trainer[name]
        msg = r.message.replace("|", "\\|").replace("`", "'")[:200]
        out.append(f"| `{name}` | {msg} | {', '.join(f'`{m}`' for m in sorted(r.modules))} |")
    return "\n".join(out) + "\n"


def _event_comments() -> dict[str, str]:
    """Event member -> the comment written beside it in :mod:`wsync_grpc.core.lifecycle`."""
    source = Path(lc.__file__).read_text()
    body = source.split("class Event(enum.Enum):", 1)[1].split("\nclass ", 1)[0]
    return {m[2]: m[3].strip() for m in re.finditer(r"^\s+(\w+) = \"(\w+)\"\s+#\s*(.*)$", body, re.M)}


def lifecycle_mermaid() -> str:
    """The lifecycle state machine (``TRANSITIONS``) as a Mermaid ``stateDiagram-v2``."""
    lines = ["stateDiagram-v2", "    [*] --> UNINITIALIZED"]
    for (src, event), dst in lc.TRANSITIONS.items():
        lines.append(f"    {src.name} --> {dst.name}: {event.value}")
    return "\n".join(lines)


def lifecycle_page() -> str:
    """``docs/reference/lifecycle.md``: the diagram and the tables of :mod:`wsync_grpc.core.lifecycle`."""
    comments = _event_comments()
    out = [
        "# Lifecycle state machine\n",
        "Generated from `wsync_grpc/core/lifecycle.py` by `python -m wsync_grpc.tools.docs_gen`; do not edit.",
        "One state machine per engine; paused/serving is a separate flag. An RPC not allowed in the current",
        "state fails with `FAILED_PRECONDITION` `WRONG_STATE` naming the state (a second update while one is",
        "in flight: `ABORTED` `UPDATE_IN_PROGRESS`); neither changes the state.\n",
        "```mermaid",
        lifecycle_mermaid(),
        "```\n",
        "## Transitions (`TRANSITIONS`)\n",
        "| From | Event | To | The event |",
        "|---|---|---|---|",
    ]
    for (src, event), dst in lc.TRANSITIONS.items():
        out.append(f"| `{src.name}` | `{event.value}` | `{dst.name}` | {comments.get(event.value, '')} |")
    out += [
        "",
        "## Updates without a group (`WITHOUT_GROUP`)\n",
        "An update that started without a group (a disk update, from `UNINITIALIZED` or `FAILED`) ends",
        "without one; where that differs from the table above:\n",
        "| From | Event | Started from | To |",
        "|---|---|---|---|",
    ]
    for (src, event, origin), dst in lc.WITHOUT_GROUP.items():
        out.append(f"| `{src.name}` | `{event.value}` | `{origin.name}` | `{dst.name}` |")
    states = list(lc.State)
    out += [
        "",
        "## Which RPC is allowed in which state (`ALLOWED`, `BUSY`)\n",
        "✓ allowed; ✗ `FAILED_PRECONDITION` `WRONG_STATE`; **busy** `ABORTED` `UPDATE_IN_PROGRESS`.\n",
        "| RPC | " + " | ".join(s.name for s in states) + " |",
        "|---|" + "---|" * len(states),
    ]
    for rpc, allowed in lc.ALLOWED.items():
        busy = lc.BUSY.get(rpc, frozenset())
        cells = ["✓" if s in allowed else "**busy**" if s in busy else "✗" for s in states]
        out.append(f"| `{rpc.value}` | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def cli_page() -> str:
    """``docs/reference/cli.md``: ``wsync --help`` and every sub-command's ``--help``, from the real parser."""
    from wsync_grpc.tools import cli

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: fix it
    try:
        parser = cli.build_parser()
        out = [
            "# The `wsync` command\n",
            "Generated from the CLI's own parser (`wsync_grpc.tools.cli.build_parser`) by",
            "`python -m wsync_grpc.tools.docs_gen`; do not edit. Every `wsync` command in these pages is parsed by",
            "that parser in the tests.\n",
            "A command line that cannot work is refused before anything loads, in one line on stderr that names",
            "the option, with exit status 2: a value of the wrong type or out of range (a port above 65535, a",
            "duration that is not above 0), a file or directory that does not exist, an unknown choice, engine or",
            "preset, and, for `wsync serve`, an address this host cannot bind now (a port in use, an address that",
            "is not this host's) or an option of another engine. `--vllm-args` is checked for its quoting only;",
            "the rest is vLLM's own parser's. A failure after loading (a sync refused, an engine that does not",
            "answer) exits with status 1.\n",
            "```text",
            parser.format_help().rstrip(),
            "```\n",
        ]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, command in sub.choices.items():
            out += [f"## `wsync {name}`\n", "```text", command.format_help().rstrip(), "```\n"]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(out)


def pages() -> dict[Path, str]:
    """Every generated page -> its content."""
    files = sorted((PROTO_ROOT / "wsync" / "v1").glob("*.proto"))
    fds = proto_docs.descriptor_set(PROTO_ROOT, files)
    out = {REFERENCE / f"{Path(f.name).stem}-proto.md": proto_docs.file_reference(f) for f in fds.file}
    out[REFERENCE / "errors.md"] = errors_page()
    out[REFERENCE / "lifecycle.md"] = lifecycle_page()
    out[REFERENCE / "cli.md"] = cli_page()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wsync_grpc.tools.docs_gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
