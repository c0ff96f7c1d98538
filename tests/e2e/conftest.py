"""The vLLM engines shared across the e2e modules (:mod:`shared_engines` says which covers what).

A test asks for a shared engine through the ``vllm`` fixture and names the engines it runs on with the
``vllm_engines`` marker (on the module, or on the test to narrow it)::

    pytestmark = pytest.mark.vllm_engines("tp3", "tp3-lora")

The ``vllm`` fixture is parametrized at session scope by engine name, so pytest groups the tests of
every module by engine, starts each engine once, and stops it before it starts the next: one shared
vLLM engine runs at a time. A module's own ``engine`` fixture wraps ``vllm`` in
:func:`~shared_engines.hand_over`, which brings the engine to the known state first.

Tests that start an engine of their own (the demo, the README's command, kill and orphan tests) say why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_engines import SPECS, Vllm, hand_over

from wsync_grpc.testing import free_port


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm_engines(*names): the shared vLLM engines (tests/e2e/shared_engines.py) a test runs on"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``vllm`` at session scope with the engines the closest ``vllm_engines`` marker names."""
    if "vllm" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("vllm_engines")
    if marker is None or not marker.args:
        raise pytest.UsageError(f"{metafunc.definition.nodeid} uses `vllm` without a vllm_engines(...) marker")
    unknown = [n for n in marker.args if n not in SPECS]
    if unknown:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: unknown shared engines {unknown}; see {sorted(SPECS)}")
    metafunc.parametrize("vllm", list(marker.args), indirect=True, scope="session")


@pytest.fixture(scope="session")
def vllm(request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    """The shared engine named by this test's parameter, started once and stopped when the next one starts."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    from wsync_grpc.testing_vllm import spawn_vllm_engine

    name: str = request.param
    spec = SPECS[name]
    tmp = tmp_path_factory.mktemp(f"vllm-{name}")
    (tmp / "checkpoints").mkdir()
    http_port = free_port()
    proc = spawn_vllm_engine(
        smollm2_dir,
        port_file=tmp / "port",
        http_port=http_port,
        tensor_parallel_size=spec.tensor_parallel_size,
        log=tmp / "engine.log",
        vllm_args=spec.vllm_args,
        env=dict(spec.env),
        extra_args=["--checkpoint-root", str(tmp / "checkpoints"), "--checkpoint-root", str(smollm2_dir)],
    )
    try:
        yield Vllm(name, spec, proc, f"http://127.0.0.1:{http_port}", smollm2_dir, tmp / "checkpoints")
    finally:
        proc.stop(grace_s=30)


@pytest.fixture(scope="module")
def engine(vllm: Vllm) -> Vllm:
    """The module's shared engine, handed over in the known state (:func:`shared_engines.hand_over`)."""
    hand_over(vllm)
    return vllm


@pytest.fixture
def at_checkpoint(engine: Vllm) -> Vllm:
    """The module's engine serving the checkpoint's weights, with no owner: restored only where it is not."""
    hand_over(engine)
    return engine
