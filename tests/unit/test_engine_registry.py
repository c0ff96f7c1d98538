"""The engine registry of ``wsync serve --engine NAME``: built-ins, their options, run-time and entry-point plug-ins."""

from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.tools import cli
from wsync_grpc.tools.engines import (
    ENTRY_POINT_GROUP,
    BuiltEngine,
    EngineFactory,
    EngineOptions,
    EngineServer,
    UsageError,
    engine_plugin,
    load_entry_points,
    register_engine,
    registered_engines,
    unregister_engine,
)
from wsync_grpc.tools.serve import chosen_engine


class OnesPlugin(EngineFactory):
    """A tiny engine: ``--ones-count N`` tensors of four ones."""

    name = "ones"
    help = "N tensors of four ones (a test engine)"

    def add_options(self, options: EngineOptions) -> None:
        options.add_argument("--ones-count", type=int, default=2, metavar="N", help="how many tensors")

    def check(self, args: argparse.Namespace) -> None:
        if args.ones_count < 1:
            raise UsageError("--ones-count needs at least one tensor")

    def build(self, args: argparse.Namespace) -> BuiltEngine:
        return BuiltEngine(TensorEngine({f"w.{i}": torch.ones(4) for i in range(args.ones_count)}, name="ones"))


@pytest.fixture
def ones() -> Iterator[OnesPlugin]:
    plugin = OnesPlugin()
    register_engine(plugin)
    try:
        yield plugin
    finally:
        unregister_engine(plugin.name)


def _serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def _help_sections(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``wsync serve --help``, by section title (``usage``, ``options``, ``--engine NAME``)."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    sections: dict[str, str] = {}
    title = "usage"
    for line in capsys.readouterr().out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            title = line[:-1]
        else:
            sections[title] = sections.get(title, "") + line + "\n"
    return sections


def test_the_builtins_are_registered_first_with_their_kind() -> None:
    engines = registered_engines()
    assert list(engines)[:3] == ["reference", "synthetic", "vllm"]
    assert isinstance(engines["reference"], EngineFactory) and isinstance(engines["synthetic"], EngineFactory)
    assert isinstance(engines["vllm"], EngineServer)
    assert all(p.help and "\n" not in p.help for p in engines.values())


def test_each_builtin_contributes_its_own_options_in_its_own_help_group(capsys: pytest.CaptureFixture[str]) -> None:
    owned = _serve_args().engine_options
    flags = {name: [a.option_strings[0] for a in options.actions] for name, options in owned.items()}
    assert flags["reference"] == []
    assert flags["synthetic"] == ["--size", "--seed"]
    assert flags["vllm"] == ["--tensor-parallel-size", "--http-host", "--http-port", "--vllm-args"]
    help = _help_sections(capsys)
    assert "--size PRESET" in help["--engine synthetic"] and "--seed N" in help["--engine synthetic"]
    assert "--http-port PORT" in help["--engine vllm"] and "--vllm-args ARGS" in help["--engine vllm"]
    common = [line.split()[0] for line in help["options"].splitlines() if line.startswith("  -")]
    assert "--engine" in common and not {"--size", "--seed", "--http-port", "--vllm-args"} & set(common)
    assert "Hugging Face" in help["--engine reference"]
    assert "the engine: reference, synthetic, vllm" in " ".join(help["options"].split())


@pytest.mark.parametrize(
    ("argv", "engine"),
    [
        ([], "reference"),
        (["--model", str(Path(__file__).parent)], "reference"),
        (["--synthetic", "tiny"], "synthetic"),
        (["--engine", "synthetic"], "synthetic"),
    ],
)
def test_the_engine_is_reference_unless_named_or_synthetic_is_given(argv: list[str], engine: str) -> None:
    assert chosen_engine(_serve_args(*argv)).name == engine


def test_synthetic_is_short_for_engine_synthetic_with_size() -> None:
    short, long = _serve_args("--synthetic", "0.25gb"), _serve_args("--engine", "synthetic", "--size", "0.25gb")
    chosen_engine(short), chosen_engine(long)
    assert short.size == long.size == "0.25gb"
    default = _serve_args("--engine", "synthetic")
    chosen_engine(default)
    assert default.size == "tiny"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engine", "nope"], "--engine nope: no such engine; registered engines are reference, synthetic, vllm"),
        (["--synthetic", "tiny", "--engine", "vllm"], "drop --synthetic"),
        (["--synthetic", "tiny", "--http-port", "9000"], "--http-port is an option of --engine vllm"),
        (["--seed", "3"], "--seed is an option of --engine synthetic, not of --engine reference"),
        (["--synthetic", "huge"], "--synthetic huge: no such synthetic preset: choose one of tiny,"),
        (["--engine", "synthetic", "--model", str(Path(__file__).parent)], "drop --model"),
        (["--engine", "vllm"], "--engine vllm needs --model DIR"),
    ],
    ids=["unknown", "synthetic-with-vllm", "foreign-option", "foreign-seed", "no-preset", "synthetic-model", "vllm"],
)
def test_what_cannot_work_is_refused_in_one_line(argv: list[str], says: str) -> None:
    with pytest.raises(UsageError) as e:
        chosen_engine(_serve_args(*argv))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_engine_is_refused_by_wsync_serve_with_the_registered_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["serve", "--engine", "nope", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reference, synthetic, vllm" in err[0] and ENTRY_POINT_GROUP in err[0], err


def test_a_plugin_registered_at_run_time_is_listed_with_its_options(
    ones: OnesPlugin, capsys: pytest.CaptureFixture[str]
) -> None:
    assert registered_engines()["ones"] is ones and engine_plugin("ones") is ones
    args = _serve_args("--engine", "ones", "--ones-count", "3")
    assert chosen_engine(args) is ones
    built = ones.build(args)
    assert sorted(built.engine.parameter_specs()) == ["w.0", "w.1", "w.2"]
    help = _help_sections(capsys)
    assert "--ones-count N" in help["--engine ones"] and "a test engine" in help["--engine ones"]
    with pytest.raises(UsageError, match="--ones-count is an option of --engine ones"):
        chosen_engine(_serve_args("--synthetic", "tiny", "--ones-count", "3"))
    with pytest.raises(UsageError, match="at least one tensor"):
        chosen_engine(_serve_args("--engine", "ones", "--ones-count", "0"))


def test_a_name_is_registered_once(ones: OnesPlugin) -> None:
    with pytest.raises(ValueError, match="'ones' is registered already"):
        register_engine(OnesPlugin())
    register_engine(OnesPlugin(), replace=True)
    assert engine_plugin("ones") is not ones
    with pytest.raises(TypeError, match="not an EngineFactory or an EngineServer"):
        register_engine(object())  # type: ignore[arg-type]


def test_entry_points_register_plugins_and_a_broken_one_is_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = EntryPoint(name="ones", value=f"{__name__}:OnesPlugin", group=ENTRY_POINT_GROUP)
    broken = EntryPoint(name="gone", value="no_such_module_for_wsync:Plugin", group=ENTRY_POINT_GROUP)
    clash = EntryPoint(name="synthetic", value=f"{__name__}:SyntheticAgain", group=ENTRY_POINT_GROUP)
    try:
        with caplog.at_level(logging.WARNING, logger="wsync"):
            assert load_entry_points([broken, good, clash]) == ["ones"]
        assert isinstance(engine_plugin("ones"), OnesPlugin)
        assert "engine plug-in 'gone'" in caplog.text and "no_such_module_for_wsync" in caplog.text
        assert "'synthetic' is registered already" in caplog.text
        assert type(engine_plugin("synthetic")).__name__ == "SyntheticPlugin"
    finally:
        unregister_engine("ones")


class SyntheticAgain(OnesPlugin):
    name = "synthetic"


def _readme_vllm_command() -> list[str]:
    """The vLLM guide's ``wsync serve --engine vllm`` command, as a shell would split it (after ``wsync``)."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "vllm.md").read_text()
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if "wsync serve --engine vllm" in line and "\\" in line)
    text = ""
    for line in lines[start:]:
        text += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(text)
    return words[words.index("wsync") + 1 :]


def test_the_readmes_vllm_command_parses_and_reaches_vllm_with_its_arguments() -> None:
    """``--vllm-args "--enforce-eager"`` (a value that begins with a dash) is read as the value, as written."""
    argv = _readme_vllm_command()
    assert "--vllm-args" in argv and "--enforce-eager" in argv
    args = cli.parse_args(argv)
    assert (args.command, args.engine, args.vllm_args, args.http_port, args.port) == (
        "serve",
        "vllm",
        "--enforce-eager",
        8000,
        50051,
    )
    from wsync_grpc.tools.engines.vllm_server import VllmServeOptions, vllm_argv

    opts = VllmServeOptions(model=args.model, vllm_args=args.vllm_args)
    assert vllm_argv(opts)[-1] == "--enforce-eager" and vllm_argv(opts)[:2] == ["--model", args.model]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--vllm-args", "--enforce-eager"], "--enforce-eager"),
        (
            ["--vllm-args", "--enforce-eager --enable-lora --max-lora-rank 8"],
            "--enforce-eager --enable-lora --max-lora-rank 8",
        ),
        (["--vllm-args=--enforce-eager"], "--enforce-eager"),
        (["--vllm-args", "--dtype=bfloat16", "--http-port", "8001"], "--dtype=bfloat16"),
    ],
)
def test_vllm_args_take_a_value_that_begins_with_a_dash(given: list[str], expected: str) -> None:
    args = cli.parse_args(["serve", "--engine", "vllm", "--model", "/m", *given])
    assert args.vllm_args == expected
    assert args.http_port == (8001 if "--http-port" in given else 8000)
    assert cli.attach_pass_through(["serve", "--port", "1"]) == ["serve", "--port", "1"]  # nothing else changes


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "without an API key (--api-key or VLLM_API_KEY) and TLS (--ssl-certfile/--ssl-keyfile)"),
        (["--vllm-args", "--api-key=k0123456789"], "without TLS (--ssl-certfile/--ssl-keyfile): pass them"),
        (
            ["--vllm-args", "--ssl-certfile c.pem --ssl-keyfile k.pem"],
            "without an API key (--api-key or VLLM_API_KEY):",
        ),
    ],
    ids=["bare", "key-only", "tls-only"],
)
def test_vllms_http_api_is_not_exposed_unprotected(tmp_path: Path, extra: list[str], says: str) -> None:
    """``--http-host`` beyond loopback is checked like ``--host``: vLLM's own API key and TLS, or ``--insecure``."""
    argv = ["--engine", "vllm", "--model", str(tmp_path), "--http-host", "0.0.0.0", *extra]
    with pytest.raises(UsageError) as e:
        chosen_engine(_serve_argv(*argv))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_vllms_http_api_exposed_with_its_key_and_tls_or_insecure_is_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    exposed = ["--engine", "vllm", "--model", str(tmp_path), "--http-host", "0.0.0.0"]
    protected = "--api-key k0123456789 --ssl-certfile c.pem --ssl-keyfile k.pem"
    assert chosen_engine(_serve_argv(*exposed, "--vllm-args", protected)).name == "vllm"
    monkeypatch.setenv("VLLM_API_KEY", "k0123456789")
    assert (
        chosen_engine(_serve_argv(*exposed, "--vllm-args", "--ssl-certfile=c.pem --ssl-keyfile=k.pem")).name == "vllm"
    )
    monkeypatch.delenv("VLLM_API_KEY")
    with caplog.at_level(logging.WARNING, logger="wsync"):
        assert chosen_engine(_serve_argv(*exposed, "--insecure")).name == "vllm"
    assert "vLLM's HTTP API served on 0.0.0.0 without an API key" in caplog.text
    assert chosen_engine(_serve_argv("--engine", "vllm", "--model", str(tmp_path))).name == "vllm"  # loopback


def _serve_argv(*argv: str) -> argparse.Namespace:
    """``wsync serve ARGV`` as the CLI parses it (``--vllm-args VALUE`` whatever VALUE begins with)."""
    return cli.parse_args(["serve", *argv])
