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
    "launch": {"launch"},
    "ray": {"launch", "trainer", "ray"},
    "__init__": set(),
}
"""Layer -> the layers of ``wsync_grpc`` its modules may import (those of ``TOP`` may import any).

``launch`` starts engines as processes (``wsync serve``), so it needs none of the library; ``ray`` (the launcher
room's Ray side) starts them through ``launch`` inside Ray actors and builds trainer clients from their handles;
the package's ``__init__`` imports nothing, so that importing ``wsync_grpc.launch`` loads no more than that module.
"""

TOP = {"tools", "testing", "testing_vllm"}
"""The top of the picture: the CLI, the demos and the testing helpers, which may import any layer."""

LIBRARY = ("core", "wire", "group", "worker", "transports", "service", "trainer", "engines")
"""The layers below the launcher: launching is apart from them (they take targets, never processes)."""

FORBIDDEN_IN_LAUNCH = ("vllm", "torch")
"""What ``wsync_grpc.launch`` must not import when it is imported: engines and models load in the children."""

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


def _import_time_imports(tree: ast.Module) -> list[str]:
    """The modules that importing ``tree`` imports (those imported inside its functions left out)."""
    names: list[str] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            names += _imports(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo += ast.iter_child_nodes(node)
    return names


def _package_imports(tree: ast.AST) -> set[str]:
    """The ``wsync_grpc`` modules ``tree`` imports (``from wsync_grpc import testing`` as ``wsync_grpc.testing``)."""
    names = {m for m in _imports(tree) if m.startswith("wsync_grpc.")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "wsync_grpc" and node.level == 0:
            names |= {f"wsync_grpc.{a.name}" for a in node.names}
    return names


def test_the_layers_exist() -> None:
    layers = {_layer(p) for p in _modules()}
    assert set(ALLOWED) <= layers, f"missing layers: {set(ALLOWED) - layers}"
    assert layers <= set(ALLOWED) | TOP, f"layers neither in ALLOWED nor at the top: {layers - set(ALLOWED) - TOP}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    layer = _layer(path)
    imports = _imports(ast.parse(path.read_text()))
    if layer == "core":
        bad = [m for m in imports if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE)]
        assert not bad, f"the pure core imports {bad}"
    if layer in TOP:
        return  # tools, testing: the top of the picture
    ours = {m.split(".")[1] for m in imports if m.startswith("wsync_grpc.")}
    assert ours <= ALLOWED[layer], f"{layer} imports {sorted(ours - ALLOWED[layer])}"


def test_the_library_does_not_import_the_launcher() -> None:
    """Engine processes (on a cluster, Ray actors) are started by the launcher room; the library only takes targets."""
    assert not [layer for layer in LIBRARY if "launch" in ALLOWED[layer]], "a library layer may import launch"
    importers = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if _layer(p) in LIBRARY
        and any(
            m == "wsync_grpc.launch" or m.startswith("wsync_grpc.launch.")
            for m in _package_imports(ast.parse(p.read_text()))
        )
    ]
    assert not importers, f"{importers} import wsync_grpc.launch"


def test_nothing_below_imports_ray() -> None:
    """``wsync_grpc.ray`` (the ``ray`` extra) sits above the library and the process launcher: none of them
    imports it, nor Ray itself, so that wsync runs without Ray installed."""
    assert not [layer for layer, allowed in ALLOWED.items() if layer != "ray" and "ray" in allowed]
    importers = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if _layer(p) not in {"ray", *TOP}
        and any(m == "ray" or m.startswith(("ray.", "wsync_grpc.ray")) for m in _imports(ast.parse(p.read_text())))
    ]
    assert not importers, f"{importers} import Ray or wsync_grpc.ray"


def test_the_launcher_loads_no_engine() -> None:
    """``wsync serve --engine vllm`` runs in a child: importing the launcher imports neither vLLM nor torch."""
    imports = _import_time_imports(ast.parse((PACKAGE / "launch.py").read_text()))
    bad = [m for m in imports if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_LAUNCH)]
    assert not bad, f"wsync_grpc.launch imports {bad}"


@pytest.mark.parametrize(
    "path",
    [p for p in _modules() if _layer(p) not in {"testing", "testing_vllm"}],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_only_tests_use_the_testing_helpers(path: Path) -> None:
    """The package, its user-facing demos included, starts engines through ``wsync_grpc.launch``: the testing
    helpers are for tests and the bench, never what a user runs."""
    testing = {"wsync_grpc.testing", "wsync_grpc.testing_vllm"}
    used = sorted(_package_imports(ast.parse(path.read_text())) & testing)
    assert not used, f"{path.relative_to(PACKAGE)} imports {used}"


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


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    """``wsync_grpc.a.b`` for ``wsync_grpc/a/b.py`` (``wsync_grpc.a`` for ``wsync_grpc/a/__init__.py``)."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, each ``import`` and ``from ... import`` counted.

    Those under ``if TYPE_CHECKING:`` count: a type one module names from another ties the two
    together as much as a call does, even when nothing imports at run time. Function-local imports
    count too: one runs whenever its function does, and moving an import into a function is the usual
    way to hide a cycle, not to open it. ``from pkg import name`` is an edge to ``pkg.name`` when that is
    a module, else to ``pkg``; relative imports are resolved; a name that is no module of ``package``
    (another project's) is no edge. The parent packages an import runs first are not edges: a package's
    ``__init__`` presenting its submodules' names is not a cycle with each submodule that imports a
    sibling. ``importlib.import_module`` by name (the transport registry) is not an import statement,
    and is not counted.
    """
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        parent = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = parent.split(".")[: len(parent.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each group of modules that import one another (a strongly connected component,
    Tarjan's), as the modules in import order, the first repeated at the end; ``[]`` when there is none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                group.add(w)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A cycle through the first module of ``group`` (shortest, by breadth-first search within the group)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


KNOWN_CYCLES: list[frozenset[str]] = []
"""Cycles not opened yet, each as its modules: any other cycle fails, and so does one of these once it is gone
(then drop it from here)."""


def test_the_import_graph_has_no_cycle() -> None:
    """Every dependency between two modules runs one way, ``TYPE_CHECKING`` and function-local imports counted."""
    cycles = _cycles(_import_graph())
    new = [" -> ".join(c) for c in cycles if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles:\n  " + "\n  ".join(new)
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in {frozenset(c) for c in cycles}]
    assert not gone, f"these cycles are open now: drop them from KNOWN_CYCLES: {gone}"


def test_the_import_graph_counts_every_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
        "b.py": "def f():\n    from pkg import c\n    return c\n",
        "c.py": "from . import a\nfrom .sub import d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..b import f\nimport pkg.sub\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert _import_graph(pkg) == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},  # under TYPE_CHECKING
        "pkg.b": {"pkg.c"},  # in a function
        "pkg.c": {"pkg.a", "pkg.sub.d"},
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg.b", "pkg.sub"},
    }
    assert _cycles(_import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


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
