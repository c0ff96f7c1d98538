"""The calls and attributes the pages name in prose and tables exist on the class the page means.

``test_docs_site.py`` checks the code blocks; this checks the backticked ``Class.member`` and
``variable.member(...)`` references outside them (``client.status()`` in a table, ``result.attempts`` in a
sentence), on every written page:

- ``Class.member``: ``Class`` is a public class a ``wsync_grpc`` module defines (found in the source) or a
  message of the ``wsync.v1`` contract; ``member`` must be one of its methods, properties, attributes or
  fields (a message's field, nested type or enum value). A name that is neither (torch's, TRL's, a file
  name) is not ours and is skipped.
- ``variable.member``: ``DEFAULT_VARIABLES``, overridden per page by ``VARIABLES``, says which class a variable
  stands for (``client`` is a ``TrainerClient``, except on the sharded-trainer page, where it is a
  ``ShardedTrainerClient``; ``owner`` is the status's ``OwnerInfo``); ``OUT_OF_SCOPE`` lists, per page,
  the lower-case qualifiers that are not our objects (modules, files, other projects' objects). Any other
  lower-case qualifier fails the test, so a new variable has to be mapped or declared foreign.
- A chain (``client.client.pause()``) is followed through the members' annotated types.
- The "call" tables (first header cell ``call``) name bare methods (``close()``): each must be a method of
  the class the page's ``client`` stands for.

Members are looked up on the imported class, except for the modules in ``READ_FROM_SOURCE`` (importing TRL or
vLLM takes seconds), whose classes are read from their source.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.descriptor import Descriptor, EnumDescriptor
from wsync.v1 import generation_pb2, weight_sync_pb2

from wsync_grpc.trainer import SyncResult, TrainerClient
from wsync_grpc.trainer.sharded import ShardedTrainerClient

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGE = ROOT / "wsync_grpc"

READ_FROM_SOURCE = ("wsync_grpc.trainer.grpo", "wsync_grpc.engines.vllm")
"""Modules (and packages) whose classes are checked from their source: importing them imports TRL or vLLM."""


@dataclasses.dataclass(frozen=True)
class SourceClass:
    """A class read from its source: the module and the name it is defined under."""

    module: str
    name: str


Target = type | Descriptor | SourceClass
"""What a qualifier stands for: an imported class, a contract message, or a class read from source."""


def _status_field(name: str) -> Descriptor:
    """The message type of a field of an engine's status (``GetStatusResponse``)."""
    message = weight_sync_pb2.GetStatusResponse.DESCRIPTOR.fields_by_name[name].message_type
    assert message is not None, name
    return message


DEFAULT_VARIABLES: dict[str, Target] = {
    "client": TrainerClient,
    "c": TrainerClient,
    "result": SyncResult,
    "trainer": SourceClass("wsync_grpc.trainer.grpo", "WsyncGRPOTrainer"),
    # The fields of an engine's status (GetStatus, `wsync status`), as the failure tables name them.
    "owner": _status_field("owner"),
    "last_error": _status_field("last_error"),
    "group": _status_field("group"),
    "header": weight_sync_pb2.PrepareHeader.DESCRIPTOR,
}
"""Which class the variables of the pages stand for, unless the page says otherwise (``VARIABLES``)."""

VARIABLES: dict[str, dict[str, Target]] = {
    "docs/sharded-trainers.md": {"client": ShardedTrainerClient},
}
"""Per page (path from the repository root), the variables that stand for another class than by default."""

FILE_SUFFIXES = {"py", "md", "yml", "yaml", "txt", "json", "pem", "key", "safetensors", "bin", "proto", "toml"}
"""``name.py``, ``model.safetensors``...: file names, not members."""

OUT_OF_SCOPE: dict[str, set[str]] = {
    "*": {"wsync", "wsync_grpc", "google", "grpc", "torch", "model", "vllm", "peft", "prometheus_client"},
    "docs/architecture.md": {
        "checkpoint",
        "convert",
        "engine",
        "errors",
        "host",
        "lease",
        "lifecycle",
        "lora",
        "packing",
        "planning",
        "registry",
        "secrets",
        "site",
        "status",
        "transfer",
        "transports",
        "update",
        "validation",
        "worker",
    },
    "docs/development.md": {"pytest", "shared_engines"},
    "docs/guides/ray.md": {"ray"},
    "docs/reference/cli.md": {"cli"},
    "docs/reference/errors.md": {"broadcast", "disk"},
    "docs/sharded-trainers.md": {"deepspeed", "param"},
}
"""Per page, lower-case qualifiers that are not objects of ours: modules (checked by the architecture
tests), other projects' objects, the engine-side ``site`` of a receive. ``"*"``: on every page."""


def _without_fences(text: str) -> str:
    """The page without its fenced blocks (checked by ``test_docs_site.py``), line numbers kept."""
    return re.sub(r"^\s*```.*?^\s*```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)


def spans(page: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every inline code span of ``page`` outside its fenced blocks."""
    for number, line in enumerate(_without_fences(page.read_text()).splitlines(), 1):
        for m in re.finditer(r"`([^`]+)`", line):
            yield number, m[1]


CHAIN = re.compile(r"(?<![\w./-])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(\()?")
"""``a.b.c(``: a dotted chain not itself part of a path or of a longer dotted name."""


@functools.cache
def our_classes() -> dict[str, tuple[str, ...]]:
    """Every public class a ``wsync_grpc`` module defines at its top level: name -> the modules defining it."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(module)
    return {name: tuple(modules) for name, modules in found.items()}


@functools.cache
def messages() -> dict[str, Descriptor]:
    """Every message of the contract, nested ones included, by its short name."""
    found: dict[str, Descriptor] = {}

    def walk(descriptors: typing.Iterable[Descriptor]) -> None:
        for d in descriptors:
            found[d.name] = d
            walk(d.nested_types)

    for module in (weight_sync_pb2, generation_pb2):
        walk(module.DESCRIPTOR.message_types_by_name.values())
    return found


def _read_from_source(module: str) -> bool:
    return any(module == m or module.startswith(f"{m}.") for m in READ_FROM_SOURCE)


def targets_of(name: str) -> list[Target]:
    """Whatever a capitalised qualifier may stand for: our classes of that name, the message of that name."""
    found: list[Target] = []
    for module in our_classes().get(name, ()):
        found.append(
            SourceClass(module, name) if _read_from_source(module) else getattr(importlib.import_module(module), name)
        )
    if name in messages():
        found.append(messages()[name])
    return found


def _class_node(target: SourceClass) -> ast.ClassDef:
    spec = importlib.util.find_spec(target.module)
    assert spec is not None and spec.origin is not None, target.module
    tree = ast.parse(Path(spec.origin).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == target.name)


def _self_attributes(node: ast.ClassDef) -> set[str]:
    """The ``self.x = ...`` (or ``self.x: T = ...``) attributes the class's methods assign."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


INHERITED_FROM_OTHERS: dict[str, set[str]] = {
    "WsyncGRPOTrainer": {"state", "train"},  # transformers' Trainer
}
"""Per class read from source, the members the pages name that it inherits from another project's class."""


def _source_members(target: SourceClass) -> set[str]:
    """What a class read from source defines, or inherits from ours or (``INHERITED_FROM_OTHERS``) others'."""
    node = _class_node(target)
    names = _self_attributes(node) | INHERITED_FROM_OTHERS.get(target.name, set())
    for base in node.bases:
        if isinstance(base, ast.Name):
            for t in targets_of(base.id):
                if isinstance(t, SourceClass):
                    names |= _source_members(t)
                elif isinstance(t, type):
                    names |= set(dir(t)) | _instance_attributes(t)
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    return names


def _instance_attributes(cls: type) -> set[str]:
    """What instances of ``cls`` have beyond its class attributes: annotated fields, ``self.x`` assignments."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names |= set(vars(klass).get("__annotations__", {}))
        names |= set(vars(klass).get("__slots__", ()))
        if klass.__module__.startswith("wsync_grpc"):
            source = inspect.getsource(klass)
            names |= _self_attributes(typing.cast(ast.ClassDef, ast.parse(textwrap.dedent(source)).body[0]))
    return names


def member(target: Target, name: str) -> tuple[bool, Target | None]:
    """Whether ``target`` has ``name``, and what that member stands for when its type is known (to follow a chain)."""
    if isinstance(target, Descriptor):
        field = target.fields_by_name.get(name)
        if field is not None:
            return True, field.message_type
        nested: Descriptor | EnumDescriptor | None = target.nested_types_by_name.get(name)
        nested = nested or target.enum_types_by_name.get(name)
        return nested is not None or name in target.enum_values_by_name, None
    if isinstance(target, SourceClass):
        return name in _source_members(target), None
    if not (hasattr(target, name) or name in _instance_attributes(target)):
        return False, None
    attr = inspect.getattr_static(target, name, None)
    hint: object = None
    try:
        if isinstance(attr, property) and attr.fget is not None:
            hint = typing.get_type_hints(attr.fget).get("return")
        elif attr is None:
            hint = typing.get_type_hints(target).get(name)
    except (NameError, TypeError):  # an annotation that does not evaluate at run time: stop following
        hint = None
    return True, hint if isinstance(hint, type) else None


def _page_key(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def variables_of(page: Path) -> dict[str, Target]:
    """Which class each variable of ``page`` stands for."""
    return {**DEFAULT_VARIABLES, **VARIABLES.get(_page_key(page), {})}


def _label(target: Target) -> str:
    if isinstance(target, Descriptor):
        return f"message {target.name}"
    return target.name if isinstance(target, SourceClass) else target.__name__


def check_page(page: Path) -> tuple[list[str], int]:
    """The references of ``page`` that do not resolve, and how many resolved."""
    variables, foreign = variables_of(page), OUT_OF_SCOPE["*"] | OUT_OF_SCOPE.get(_page_key(page), set())
    wrong: list[str] = []
    checked = 0
    for line, text in spans(page):
        for m in CHAIN.finditer(text):
            head, parts = m[1], m[2].split(".")[1:]
            if parts[-1] in FILE_SUFFIXES:
                continue
            where = f"{_page_key(page)}:{line}: `{m[0]}`"
            if head in variables:
                candidates = [variables[head]]
            elif head[0].isupper():
                candidates = targets_of(head)
                if not candidates:
                    continue  # not ours (torch's, TRL's)
            elif head in foreign:
                continue
            else:
                wrong.append(f"{where}: unknown variable {head!r} (map it in VARIABLES or declare it OUT_OF_SCOPE)")
                continue
            for name in parts:
                found = [(ok, nxt, c) for c in candidates for ok, nxt in [member(c, name)] if ok]
                if not found:
                    labels = " or ".join(_label(c) for c in candidates)
                    wrong.append(f"{where}: {labels} has no {name!r}")
                    break
                checked += 1
                candidates = [nxt for _, nxt, _ in found if nxt is not None]
                if not candidates:
                    break  # the member's type is not known: the rest of the chain is not checked
    return wrong, checked


def _call_tables(page: Path) -> Iterator[tuple[int, str]]:
    """(line, first cell) of every row of the tables whose first header cell is ``call``."""
    lines = _without_fences(page.read_text()).splitlines()
    inside = False
    for number, line in enumerate(lines, 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            inside = False
        elif cells[0] == "call":
            inside = True
        elif inside and not set(cells[0]) <= set("-: "):
            yield number, cells[0]


def test_every_call_and_attribute_the_pages_name_exists_where_the_page_says() -> None:
    wrong: list[str] = []
    checked = 0
    for page in PAGES:
        page_wrong, page_checked = check_page(page)
        wrong += page_wrong
        checked += page_checked
    assert not wrong, "\n".join(wrong)
    assert checked >= 40  # the pages do name calls: a broken pattern would check nothing


def test_the_bare_calls_of_the_call_tables_are_methods_of_the_pages_client() -> None:
    wrong: list[str] = []
    rows = 0
    for page in PAGES:
        client = variables_of(page)["client"]
        for line, cell in _call_tables(page):
            rows += 1
            for text in re.findall(r"`([^`]+)`", cell):
                for name in re.findall(r"^([a-z_]\w*)\(", text):
                    if not callable(getattr(client, name, None)):
                        wrong.append(f"{_page_key(page)}:{line}: `{text}`: {_label(client)} has no method {name!r}")
    assert rows >= 4
    assert not wrong, "\n".join(wrong)


def test_the_variable_map_is_used_and_checks_the_pages_it_names() -> None:
    """Every page-specific variable occurs on its page; every mapped variable occurs on some page."""
    text = {page: _without_fences(page.read_text()) for page in PAGES}
    for key, mapped in VARIABLES.items():
        page = ROOT / key
        assert page in text, key
        for name in mapped:
            assert re.search(rf"`[^`]*(?<![\w.]){name}\.\w", text[page]), f"{key} never uses `{name}.`"
    for name in DEFAULT_VARIABLES:
        assert any(re.search(rf"`[^`]*(?<![\w.]){name}\.\w", t) for t in text.values()), name


def test_the_check_catches_a_call_the_class_lacks() -> None:
    """The pattern finds the forms the pages use, and a call missing from the class fails."""
    assert [m[0] for m in CHAIN.finditer("client.status(), `Fleet.gather`, a/b.c, x.y.z(")] == [
        "client.status(",
        "Fleet.gather",
        "x.y.z(",
    ]
    assert member(ShardedTrainerClient, "sync") == (True, None)
    assert member(ShardedTrainerClient, "client") == (True, TrainerClient)
    assert member(TrainerClient, "no_such_call") == (False, None)
    assert member(messages()["OwnerInfo"], "generation")[0]
    assert not member(messages()["OwnerInfo"], "no_such_field")[0]
