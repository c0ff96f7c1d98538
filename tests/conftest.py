"""Shared fixtures. transformers (the ``engine`` extra) is imported lazily: tests that do not
use these fixtures run without it."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import VLLM_SHM_PREFIXES, build_tiny_llama

TIERS = ("unit", "integration", "e2e")
"""The tiers, one directory of ``tests/`` each, marked by that directory's name (``pytest -m unit``)."""


DEV_SHM = Path("/dev/shm")
_SHM_BEFORE = pytest.StashKey[set[str]]()


def _shm_names() -> set[str]:
    with contextlib.suppress(OSError):
        return {p.name for p in DEV_SHM.iterdir()}
    return set()


def _shm_in_use() -> set[str]:
    """The ``/dev/shm`` names some process on this host maps or holds open now."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # a process that ended meanwhile, or another user's
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        used.add(target.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return used


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SHM_BEFORE] = _shm_names()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Unlink the shared memory vLLM processes the suite killed left in ``/dev/shm`` (memory, on a tmpfs): names
    of :data:`VLLM_SHM_PREFIXES` that appeared during the run and no process maps or holds; and say which."""
    if hasattr(session.config, "workerinput") or _SHM_BEFORE not in session.config.stash:
        return  # an xdist worker: its controller looks
    new = _shm_names() - session.config.stash[_SHM_BEFORE]
    left = sorted(n for n in new - _shm_in_use() if n.startswith(VLLM_SHM_PREFIXES))
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            (DEV_SHM / name).unlink()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if left and reporter is not None:
        reporter.write_line(f"unlinked {len(left)} /dev/shm segment(s) killed vLLM processes left: {', '.join(left)}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (its directory) and ``vllm`` where it uses a vLLM engine; then deselect
    ``soak`` tests (minutes long) unless the ``-m`` expression names them (``make soak``).

    The tier and ``vllm`` marks are added before ``-m`` selects (``tryfirst``), so ``-m "not vllm"`` works.
    A test uses a vLLM engine when it takes the shared ``vllm`` fixture (``tests/e2e/conftest.py``) or
    is marked ``vllm`` itself (one that starts vLLM of its own). Not ``addopts = -m "not soak"``: any
    ``-m`` given on the command line would replace it, so ``pytest -m slow`` would run the slow soak
    tests too.
    """
    for item in items:
        tier = next((t for t in TIERS if f"/tests/{t}/" in item.path.as_posix()), None)
        if tier is not None:
            item.add_marker(tier)
        if "vllm" in getattr(item, "fixturenames", ()):
            item.add_marker("vllm")
    if "soak" in (config.getoption("markexpr") or ""):
        return  # the expression decides (-m soak, -m "soak or slow", -m "not soak")
    soak = [item for item in items if item.get_closest_marker("soak") is not None]
    if soak:
        config.hook.pytest_deselected(items=soak)
        items[:] = [item for item in items if item.get_closest_marker("soak") is None]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (converts the GGUF once per cache, ~30 s)."""
    pytest.importorskip("transformers")
    from wsync_grpc.engines.models import ensure_smollm2_dir

    try:
        return ensure_smollm2_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    """SmolLM2's tokenizer (vocabulary 49152, chat template), from local files."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture
def make_tiny_llama(smollm2_tokenizer: Any) -> Callable[..., Any]:
    """``make_tiny_llama(seed=0, tie=True)``: :func:`build_tiny_llama` with SmolLM2's vocabulary."""
    return functools.partial(build_tiny_llama, len(smollm2_tokenizer))


@pytest.fixture
def tiny_llama(make_tiny_llama: Callable[..., Any]) -> Any:
    """A fresh tiny random Llama (seed 0, tied embeddings) with SmolLM2's vocabulary."""
    return make_tiny_llama()
