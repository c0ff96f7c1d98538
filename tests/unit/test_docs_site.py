"""The docs cannot lie: their commands parse, their code compiles against the real API, their references are fresh.

- every generated page (contract, error reasons, lifecycle, CLI) is what the generator writes now;
- every ``wsync`` command in a ``bash`` block parses with the CLI's own parser; every ``make`` target,
  example script, package extra and ``grpcurl`` method named there exists;
- every ``python`` block compiles, its ``wsync_grpc`` imports resolve, every keyword it passes to
  the trainer client's methods or to an imported callable is one of their parameters, and mypy (the
  project's configuration) accepts it;
- every error reason the pages name (outside the generated reference) is one the code can return, and
  the reference lists exactly the reasons the code can return.

The ``python`` blocks marked to run are run against real engines in
``tests/integration/test_docs_snippets.py``.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mypy import api as mypy_api

from wsync_grpc.tools import cli, docs_gen, proto_docs
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.trainer.sharded import ShardedTrainerClient

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"cli.md", "errors.md", "lifecycle.md", "weight_sync-proto.md", "generation-proto.md"}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WRITTEN = [p for p in PAGES if p.name not in GENERATED]
"""The pages people write (the generated ones are checked by regenerating them)."""


@functools.cache
def proto_names() -> frozenset[str]:
    """Every RPC, message, field, enum and enum value of the contract (``protoc`` runs once)."""
    files = sorted((ROOT / "proto" / "wsync" / "v1").glob("*.proto"))
    return frozenset(proto_docs.all_names(proto_docs.descriptor_set(ROOT / "proto", files)))


@functools.cache
def code_constants() -> frozenset[str]:
    """The module-level and class-level upper-case names the package defines (constants, enum members)."""
    names: set[str] = set()
    for path in (ROOT / "wsync_grpc").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return frozenset(names)


def fenced(lang: str, pages: list[Path] = WRITTEN) -> Iterator[tuple[Path, int, str]]:
    """(page, line, text) of every fenced block of ``lang`` in ``pages``."""
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == f"```{lang}":
                start, body = i + 1, []
                i += 1
                while lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                yield page, start, "\n".join(body)
            i += 1


def commands(block: str) -> Iterator[list[str]]:
    """Each simple command of a shell block as words (continuations joined, comments dropped, split on ``&&|;``)."""
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word and set(word) <= set("&|;()"):
                if words:
                    yield words
                words = []
            else:
                words.append(word)
        if words:
            yield words


def _id(item: tuple[Path, int, str]) -> str:
    return f"{item[0].relative_to(ROOT)}:{item[1]}"


BASH = list(fenced("bash"))
PYTHON = list(fenced("python"))


def test_the_pages_have_blocks_to_check() -> None:
    assert len(BASH) >= 10 and len(PYTHON) >= 8
    assert {"dev", "engine", "vllm", "trl", "docs"} <= _extras()
    assert any("wsync serve" in b for _, _, b in BASH)


def test_the_generated_pages_are_fresh() -> None:
    stale = [p.name for p, text in docs_gen.pages().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `make docs-gen` (python -m wsync_grpc.tools.docs_gen): stale {stale}"
    assert {p.name for p in docs_gen.pages()} == GENERATED


def test_the_lifecycle_diagram_has_every_transition() -> None:
    from wsync_grpc.core.lifecycle import TRANSITIONS

    page = (ROOT / "docs" / "reference" / "lifecycle.md").read_text()
    edges = set(re.findall(r"^    (\w+) --> (\w+): (\w+)$", page, re.M))
    assert edges == {(s.name, d.name, e.value) for (s, e), d in TRANSITIONS.items()}


def test_the_contract_reference_names_every_rpc_message_field_and_enum_value() -> None:
    files = sorted((ROOT / "proto" / "wsync" / "v1").glob("*.proto"))
    names = proto_names()
    text = "".join((ROOT / "docs" / "reference" / f"{f.stem}-proto.md").read_text() for f in files)
    for name in names:
        assert f"`{name.rsplit('.', 1)[-1]}`" in text or f"{name.rsplit('.', 1)[-1]} {{#" in text, name
    assert "rpc Prepare(wsync.v1.PrepareRequest)" in text and "client-streaming" in text


def _parse_wsync(argv: list[str]) -> argparse.Namespace:
    try:
        return cli.parse_args(argv)  # what the `wsync` console script parses, pass-through values included
    except SystemExit as e:  # argparse reports the error on stderr and exits 2
        raise AssertionError(f"`wsync {shlex.join(argv)}` does not parse") from e


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([a-z][a-z0-9-]*) = \[", text, re.M))


@pytest.mark.parametrize("item", BASH, ids=_id)
def test_every_command_of_the_shell_blocks_is_real(item: tuple[Path, int, str]) -> None:
    methods = proto_names() | {"grpc.health.v1.Health.Check"}
    for words in commands(item[2]):
        words = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # VAR=value prefixes
        if not words:
            continue
        tool = Path(words[0]).name
        if tool == "wsync":
            _parse_wsync(words[1:])
        elif tool == "make":
            assert set(words[1:]) <= _makefile_targets(), words
        elif tool in ("python", "python3") and words[1].startswith("examples/"):
            assert (ROOT / words[1]).is_file(), words
        elif tool == "pip" and words[1] == "install":
            for spec in words[2:]:
                if extras := re.match(r"wsync-grpc\[([a-z,]+)\]", spec):
                    assert set(extras[1].split(",")) <= _extras(), spec
        elif tool == "grpcurl":
            method = next((w for w in words if re.match(r"^[a-z0-9.]+\.[A-Z]\w+/\w+$", w)), None)
            if method:
                assert method.replace("/", ".") in methods, method
                if "-d" in words:  # the request body parses as the method's request message
                    _parse_request(method, words[words.index("-d") + 1])
            if "describe" in words:
                assert words[-1] in {n.rsplit(".", 1)[0] for n in methods}, words


def _parse_request(method: str, body: str) -> None:
    from google.protobuf import json_format
    from wsync.v1 import generation_pb2, weight_sync_pb2

    service, rpc = method.rsplit("/", 1)
    for module in (weight_sync_pb2, generation_pb2):
        desc = module.DESCRIPTOR.services_by_name.get(service.rsplit(".", 1)[-1])
        if desc is not None:
            request = getattr(module, desc.methods_by_name[rpc].input_type.name)()
            json_format.Parse(body, request)  # raises on an unknown field or a bad value
            return
    raise AssertionError(f"no service {service}")


def test_the_vllm_guide_passes_a_dash_value_through_to_vllm() -> None:
    """``--vllm-args "--enforce-eager"`` (a value that begins with a dash) is read as the value, as written."""
    block = next(b for p, _, b in BASH if p.name == "vllm.md" and "--engine vllm" in b)
    serve = next(w for w in commands(block) if "serve" in w)
    args = _parse_wsync(serve[serve.index("wsync") + 1 :])
    assert args.vllm_args == "--enforce-eager" and args.engine == "vllm"


IMPORTED_STATICALLY = {"wsync_grpc.trainer.grpo"}
"""Modules checked from their source (importing TRL and vLLM takes seconds); their callables take ``**kwargs``."""


def _signature_names(obj: Callable[..., Any]) -> tuple[set[str], bool]:
    params = inspect.signature(obj).parameters.values()
    return {p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params)


@pytest.mark.parametrize("item", PYTHON, ids=_id)
def test_every_python_block_compiles_against_the_real_api(item: tuple[Path, int, str]) -> None:
    tree = ast.parse(item[2], _id(item))
    imported: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in IMPORTED_STATICALLY:
            spec = importlib.util.find_spec(node.module)
            assert spec is not None and spec.origin is not None, node.module
            defined = {n.name for n in ast.parse(Path(spec.origin).read_text()).body if hasattr(n, "name")}
            assert {a.name for a in node.names} <= defined, f"{node.module} lacks {[a.name for a in node.names]}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wsync_grpc"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    clients: dict[str, type] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            call = node.context_expr
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                cls = {"TrainerClient": TrainerClient, "ShardedTrainerClient": ShardedTrainerClient}.get(call.func.id)
                if cls is not None:
                    clients[node.optional_vars.id] = cls
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target: Callable[..., Any] | None = None
        f = node.func
        if isinstance(f, ast.Name) and f.id in imported:
            target = imported[f.id]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id in clients:
                assert hasattr(clients[f.value.id], f.attr), f"{clients[f.value.id].__name__} has no {f.attr}"
                target = getattr(clients[f.value.id], f.attr)
            elif f.value.id in imported:
                owner = imported[f.value.id]
                assert hasattr(owner, f.attr), f"{f.value.id} has no {f.attr}"
                target = getattr(owner, f.attr)
        if target is None or not callable(target):
            continue
        names, any_keyword = _signature_names(target)
        for kw in node.keywords:
            assert kw.arg is None or any_keyword or kw.arg in names, f"{ast.unparse(node)[:80]}: no parameter {kw.arg}"


REASON_WORD = re.compile(r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)`|\b([A-Z][A-Z0-9]+(?:_[A-Z0-9]+)+)\b")
STATUS_CODES = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
    "NOT_SERVING",
}
NOT_REASONS = STATUS_CODES | {
    "DEMO_ARGS",
    "SO_PEERCRED",
    "SCM_RIGHTS",
    "O_EXCL",
    "F_SEAL_SHRINK",
    "F_SEAL_GROW",
    "HF_HUB_OFFLINE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "CUDA_VISIBLE_DEVICES",
    "UPPER_SNAKE_CASE",
}
"""Upper-case words of the pages that are not error reasons: status codes, environment variables."""


def _not_reasons() -> set[str]:
    enum_values = {n for n in proto_names() if "." not in n}
    env = {w for w in re.findall(r"\b(?:WSYNC|VLLM)_[A-Z0-9_]+\b", "".join(p.read_text() for p in PAGES))}
    from wsync_grpc.core.lifecycle import State

    return NOT_REASONS | enum_values | env | {s.name for s in State} | code_constants()


def test_every_reason_the_pages_name_is_one_the_code_returns() -> None:
    engine, trainer = docs_gen.error_reasons()
    known = set(engine) | set(trainer)
    skip = _not_reasons()
    wrong: list[str] = []
    for page in WRITTEN:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for m in REASON_WORD.finditer(text):
            word = m[1] or m[2]
            if word not in skip and word not in known:
                wrong.append(f"{page.relative_to(ROOT)}: {word}")
    assert not wrong, wrong


def test_the_reference_lists_exactly_the_reasons_the_code_returns() -> None:
    engine, trainer = docs_gen.error_reasons()
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()
    listed = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", page, re.M))
    assert listed == set(engine) | set(trainer)
    # The reasons the engine's core paths are known to return are found in the code.
    assert {"WRONG_STATE", "UPDATE_IN_PROGRESS", "NOT_OWNER", "PEER_LOST", "RECEIVE_TIMEOUT"} <= set(engine)
    assert {"ROLE_NOT_ALLOWED", "TOO_MANY_CALLS", "PATH_OUTSIDE_ROOTS", "SHAPE_MISMATCH"} <= set(engine)
    assert engine["NOT_OWNER"].codes == {"FAILED_PRECONDITION"}
    assert engine["ROLE_NOT_ALLOWED"].codes == {"PERMISSION_DENIED"}


def test_the_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    assert "make demo" in readme and "make test" in readme and "```mermaid" in readme
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_every_metric_the_pages_name_is_one_the_code_exports() -> None:
    """A backticked ``wsync_...`` metric name (labels aside) is declared by the engine's or the trainer's metrics."""
    declared: set[str] = set()
    for module in ("service/metrics.py", "trainer/metrics.py"):
        for node in ast.walk(ast.parse((ROOT / "wsync_grpc" / module).read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("wsync_"):
                declared |= {node.value, f"{node.value}_total", f"{node.value}_info"}
    named = {
        m[1]
        for page in WRITTEN
        for m in re.finditer(r"`(wsync_[a-z_]+)(?:\{[^}]*\})?`", page.read_text())
        if m[1] not in {"wsync_grpc", "wsync_targets"}
    }
    assert len(named) >= 10
    assert named <= declared, sorted(named - declared)


def test_the_readme_and_the_home_page_show_the_same_comparison() -> None:
    def rows(text: str) -> list[str]:
        return [line for line in text.split("## Why", 1)[1].split("\n## ", 1)[0].splitlines() if line.startswith("| ")]

    readme, home = (ROOT / "README.md").read_text(), (ROOT / "docs" / "index.md").read_text()
    assert len(rows(readme)) >= 8 and rows(readme) == rows(home)


CONTEXT_IMPORTS = {
    "TrainerClient": "from wsync_grpc.trainer import TrainerClient",
    "ShardedTrainerClient": "from wsync_grpc.trainer.sharded import ShardedTrainerClient",
    "FleetPolicy": "from wsync_grpc.trainer import FleetPolicy",
    "pb": "from wsync.v1 import weight_sync_pb2 as pb",
    "join_group": "from wsync_grpc.group.process_group import join_group",
    "wait_work": "from wsync_grpc.group.waits import wait_work",
    "time": "import time",
}
"""Names a block uses as the page around it introduces them: typed as the real thing, not as ``Any``."""


def _free_names(tree: ast.Module) -> set[str]:
    bound = set(dir(builtins))
    for n in ast.walk(tree):
        if isinstance(n, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.ClassDef):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


@pytest.mark.timeout(300)
def test_every_python_block_type_checks(tmp_path: Path) -> None:
    """mypy, with the project's configuration, over every block; names the reader supplies (``model``) are ``Any``.

    A cold mypy cache makes this take about 20 s once; warm, under a second.
    """
    files = []
    for i, (page, line, code) in enumerate(PYTHON):
        free = sorted(_free_names(ast.parse(code)))
        prelude = ["from typing import Any"]
        prelude += [CONTEXT_IMPORTS.get(name, f"{name}: Any = None") for name in free]
        path = tmp_path / f"block_{i}_{page.stem.replace('-', '_')}_{line}.py"
        path.write_text("\n".join(prelude) + "\n" + code + "\n")
        files.append(str(path))
    out, err, status = mypy_api.run(["--no-error-summary", *files])
    assert status == 0, out + err


def test_the_trainer_examples_of_the_pages_are_the_example_file_that_runs() -> None:
    """The README's and the trainer guide's loop is ``examples/minimal_trainer.py`` (run by tests/e2e), verbatim."""
    example = (ROOT / "examples" / "minimal_trainer.py").read_text()
    for page in ("README.md", "docs/guides/trainer.md"):
        block = next(b for p, _, b in PYTHON if p == ROOT / page and "load_causal_lm" in b)
        assert block.strip() in example, page
