"""The package's layering (docs/architecture.md): import arrows run one way, and every room stays small."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "wsync_grpc"

ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "wire": {"core", "wire"},
    "group": {"core", "group"},
    "worker": {"core", "group", "worker"},
    "transports": {"core", "group", "worker", "transports"},
    "service": {"core", "wire", "group", "worker", "transports", "service"},
    "trainer": {"core", "wire", "group", "transports", "trainer"},
    "engines": {"core", "group", "worker", "transports", "engines"},
}
"""Layer -> the layers of ``wsync_grpc`` its modules may import (tools and testing may import any)."""

FORBIDDEN_IN_CORE = ("grpc", "grpc_status", "google.protobuf", "google.rpc", "wsync.v1", "torch.distributed")

SOFT_LIMITS = {"module": 450, "class": 300, "function": 60}
"""Sizes past which a room is worth a second look (a warning, never a reason to split by line count)."""

HARD_LIMITS = {"module": 900, "class": 600, "function": 120}
"""Sizes no room reaches: past these a module holds more than one concept.

Classes and functions are measured without their docstrings (the public API's documentation is not code).
"""


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.stat().st_size > 0)


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_the_layers_exist() -> None:
    layers = {_layer(p) for p in _modules()}
    assert set(ALLOWED) <= layers, f"missing layers: {set(ALLOWED) - layers}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    layer = _layer(path)
    imports = _imports(ast.parse(path.read_text()))
    if layer == "core":
        bad = [m for m in imports if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE)]
        assert not bad, f"the pure core imports {bad}"
    if layer not in ALLOWED:
        return  # tools, testing: the top of the picture
    ours = {m.split(".")[1] for m in imports if m.startswith("wsync_grpc.")}
    assert ours <= ALLOWED[layer], f"{layer} imports {sorted(ours - ALLOWED[layer])}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_crosses_a_module(path: Path) -> None:
    """A name with a leading underscore stays in its module: what another module needs is public there."""
    crossing = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wsync_grpc")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not crossing, f"{path.relative_to(PACKAGE)} imports private names {crossing}"


VLLM_FRONT = ("__init__.py", "front.py", "lora.py", "checkpoint.py")
"""The modules of ``engines/vllm`` that run in vLLM's front (API server) process, beside the servicer."""


@pytest.mark.parametrize("name", VLLM_FRONT)
def test_vllm_front_imports_no_worker_side(name: str) -> None:
    """The front process drives vLLM's workers through ``collective_rpc``; what runs in them stays out of it."""
    imports = _imports(ast.parse((PACKAGE / "engines" / "vllm" / name).read_text()))
    ours = {m.split(".")[1] for m in imports if m.startswith("wsync_grpc.")}
    assert not ours & {"worker", "group"}, f"engines/vllm/{name} imports {sorted(ours & {'worker', 'group'})}"
    worker_side = {"wsync_grpc.engines.vllm.transfer", "wsync_grpc.engines.vllm.worker", "wsync_grpc.engines.host"}
    assert not set(imports) & worker_side, f"engines/vllm/{name} imports {sorted(set(imports) & worker_side)}"


def _docstring_lines(node: ast.AST) -> int:
    """Lines of the docstrings of ``node`` and of every function and class inside it."""
    total = 0
    for inner in ast.walk(node):
        if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and inner.body:
            first = inner.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                assert first.end_lineno is not None
                total += first.end_lineno - first.lineno + 1
    return total


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Lines of ``node``, its docstrings (and those of what it holds) left out."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1 - _docstring_lines(node)


def _sizes(text: str) -> list[tuple[str, str, int]]:
    """``(kind, name, lines)`` of a module's text and of every class and function in it."""
    out = [("module", "", text.count("\n"))]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            out.append(("class", node.name, _code_lines(node)))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append(("function", node.name, _code_lines(node)))
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_rooms_stay_small(path: Path) -> None:
    for kind, name, lines in _sizes(path.read_text()):
        where = f"{path.relative_to(PACKAGE)} {kind} {name}".rstrip()
        assert lines <= HARD_LIMITS[kind], f"{where}: {lines} lines"
        if lines > SOFT_LIMITS[kind]:
            warnings.warn(f"{where}: {lines} lines (worth a second look past {SOFT_LIMITS[kind]})", stacklevel=1)
