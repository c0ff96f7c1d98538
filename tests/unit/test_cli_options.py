"""Every option of every ``wsync`` command refuses a bad value in one line that names it, exit status 2, with no
traceback and before anything loads.

The table is generated from the CLI's own parser (:func:`wsync_grpc.tools.cli.build_parser`): each option's bad
values come from its value type (:mod:`wsync_grpc.tools.options`), its choices, or, for free text that a later
check refuses, from :data:`CHECKED`; options that take any text are listed in :data:`FREE`. An option in none of
them fails :func:`test_every_option_has_bad_values_or_takes_any_text`, so a new option gets a checked type or a
place here. The commands run in-process through ``main(argv)``; one subprocess runs the whole table again in a
fresh interpreter to show that no refusal imported ``transformers`` or ``vllm``. ``--vllm-args`` is vLLM's own
parser's to check, past the quoting.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from wsync_grpc.tools import cli, options
from wsync_grpc.tools.engines import EngineOptions

ROOT = Path(__file__).resolve().parents[2]

MISSING = "/nonexistent/wsync-test"
"""A path that does not exist."""

TEST_NET = "192.0.2.1"
"""An address of RFC 5737's TEST-NET-1, which no host here has: binding it fails at once, with no DNS."""

BAD_BY_TYPE: dict[Callable[[str], object], list[str]] = {
    options.port: ["99999", "-1", "http"],
    options.fixed_port: ["0", "65536", "80.5"],
    options.seconds: ["0", "-1", "nan", "1e9", "soon"],
    options.seconds_or_zero: ["-1", "inf", "soon"],
    options.positive_int: ["0", "1.5"],
    options.count: ["-1", "x"],
    options.file_path: [MISSING, "{dir}"],
    options.dir_path: [MISSING, "{file}"],
    options.file_to_write: [f"{MISSING}/port", "{dir}"],
    options.log_level: ["bogus"],
    options.target: ["nope", "host:99999", ":50051", "host:"],
    options.non_empty: ["", "  "],
    options.device: ["gpu", "cuda:x", "cpu:0"],
}
"""Bad values of each value type (``{dir}``, ``{file}``: a directory and a file that exist)."""

CHECKED: dict[tuple[str, str], list[str]] = {
    ("serve", "--engine"): ["nosuch"],
    ("serve", "--device"): ["cuda:7"],  # checked before the model loads: this host has no such device
    ("serve", "--synthetic"): ["nosuch"],
    ("serve", "--size"): ["nosuch"],
    ("serve", "--allow-master"): ["notacidr"],
    ("serve", "--max-calls"): ["nonsense", "control=0", "nosuch=1"],
    ("serve", "--host"): [TEST_NET],
    ("serve", "--metrics-host"): [TEST_NET],
    ("serve", "--http-host"): [TEST_NET],
    ("serve", "--vllm-args"): ['"unclosed'],
}
"""Free-text options that ``wsync serve`` checks after parsing, before the engine loads: (command, option) -> values."""

FREE: set[tuple[str, str]] = {
    ("serve", "--token"),
    ("reload", "--owner"),
    ("reload", "--adapter"),
    ("reload", "--token"),
    ("watch", "--token"),
    ("generate", "prompt"),
    ("generate", "--adapter"),
    ("unload-adapter", "name"),
    ("unload-adapter", "--owner"),
    ("cancel", "--reason"),
    ("cancel", "--owner"),
    ("leave", "--owner"),
    ("checksums", "names"),
}
"""Options any text is a value of: tokens, owner and adapter names, prompts, reasons, tensor names."""

FREE_EVERYWHERE = {"--token"}
"""Options that take any text on every command that has them (a bearer token)."""

CLIENT = ["--target", "127.0.0.1:1", "--timeout", "5"]
"""A command that calls an engine is pointed at a port nothing serves, so a bad value let through fails fast."""

BASE: dict[str, list[str]] = {
    "generate": ["hello", *CLIENT],
    "unload-adapter": ["adapter", *CLIENT],
    "watch": ["127.0.0.1:1", "--count", "1", "--timeout", "5"],
    "reload": ["--checkpoint", "/checkpoint", "--version", "v1", "--target", "127.0.0.1:1", "--timeout", "5"],
}
"""What each command needs besides the option under test, valid (default: :data:`CLIENT`)."""


@dataclass(frozen=True)
class Case:
    """One bad value of one option, and the command line that carries it."""

    command: str
    option: str
    value: str
    argv: list[str]
    label: str
    """The value as the table writes it (``{dir}`` for a directory made for the run): the test's id, the same in
    every process that collects it."""

    @property
    def id(self) -> str:
        return f"{self.command}{self.option}={self.label or 'empty'}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _name(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The actions that take a value (not help, not flags, not the sub-command)."""
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.nargs == 0:
            continue
        yield a


def _engine_of(serve: argparse.ArgumentParser) -> dict[str, str]:
    """Each engine option's engine, from the engines' argument groups."""
    owned: dict[str, EngineOptions] = serve.get_default("engine_options")
    return {_name(a): name for name, group in owned.items() for a in group.actions}


def _bad_values(command: str, action: argparse.Action) -> list[str] | None:
    """``None``: the option takes any text."""
    key = (command, _name(action))
    if key in CHECKED:
        return CHECKED[key]
    if action.type in BAD_BY_TYPE:
        return BAD_BY_TYPE[action.type]  # type: ignore[index]
    if action.choices is not None:
        return ["nosuch"]
    if key in FREE or _name(action) in FREE_EVERYWHERE:
        return None
    raise LookupError(f"wsync {command} {_name(action)} has no bad values here and is not listed as free text")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_base(option: str, engine: str | None, model_dir: str) -> list[str]:
    base = ["serve", "--port", "0"]
    if engine == "synthetic":
        base += ["--engine", "synthetic"]
    elif engine == "vllm":
        base += ["--engine", "vllm", "--model", model_dir, "--http-port", str(_free_port())]
    if option in ("--host", "--http-host"):
        base.append("--insecure")  # else the refusal is of an exposed port, before the address is tried
    if option == "--metrics-host":
        base += ["--metrics-port", str(_free_port())]
    return base


def _argv(command: str, action: argparse.Action, value: str, base: list[str]) -> list[str]:
    """``base`` with the option set to ``value`` last (the last value wins), or with ``value`` for a positional."""
    if not action.option_strings:
        return [command, value]
    return [*base, f"{_name(action)}={value}"]  # attached, so that a value may begin with a dash or be empty


def cases(workdir: Path) -> list[Case]:
    """Every option of every command with each of its bad values (files and directories made under ``workdir``)."""
    existing = {"{dir}": str(workdir), "{file}": str(workdir / "a-file")}
    (workdir / "a-file").write_text("not a certificate\n")
    parser = cli.build_parser()
    out: list[Case] = []
    for action in _options(parser):
        for label in _bad_values("wsync", action) or []:
            value = existing.get(label, label)
            out.append(Case("wsync", _name(action), value, [f"{_name(action)}={value}", "status"], label))
    commands = _subcommands(parser)
    engines = _engine_of(commands["serve"])
    for command, sub in commands.items():
        for action in _options(sub):
            for label in _bad_values(command, action) or []:
                value = existing.get(label, label)
                if command == "serve":
                    base = _serve_base(_name(action), engines.get(_name(action)), str(workdir))
                else:
                    base = [command, *BASE.get(command, CLIENT)]
                out.append(Case(command, _name(action), value, _argv(command, action, value, base), label))
    return out


@dataclass(frozen=True)
class Outcome:
    """What ``main(argv)`` did: its exit status and what it wrote on stderr."""

    status: int | None
    stderr: str


def run_main(argv: list[str], timeout_s: float = 60.0) -> Outcome:
    """``cli.main(argv)`` in a thread, its stderr captured; status ``None`` if it had not returned in time (it went
    on to serve or call an engine instead of refusing the command line)."""
    err, out = io.StringIO(), io.StringIO()
    result: list[int | None] = []

    def call() -> None:
        try:
            result.append(cli.main(argv))
        except SystemExit as e:
            result.append(e.code if isinstance(e.code, int) else 1)
        except BaseException as e:  # a traceback is what the test reports
            import traceback

            err.write("Traceback (most recent call last):\n" + "".join(traceback.format_exception(e)))
            result.append(1)

    with redirect_stderr(err), redirect_stdout(out):
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(timeout_s)
    return Outcome(result[0] if result else None, err.getvalue())


_WORKDIR = Path(tempfile.mkdtemp(prefix="wsync-cli-options-"))
CASES = cases(_WORKDIR)


def test_every_option_has_bad_values_or_takes_any_text() -> None:
    parser = cli.build_parser()
    for action in _options(parser):
        _bad_values("wsync", action)
    for command, sub in _subcommands(parser).items():
        for action in _options(sub):
            _bad_values(command, action)  # raises LookupError for an option the table does not know
    covered = {(c.command, c.option) for c in CASES}
    assert ("serve", "--port") in covered and ("serve", "--metrics-port") in covered
    assert ("serve", "--checkpoint-root") in covered and ("serve", "--tensor-parallel-size") in covered


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_bad_value_is_one_line_naming_the_option_and_exit_status_2(case: Case) -> None:
    outcome = run_main(case.argv)
    assert outcome.status is not None, f"wsync {' '.join(case.argv)} did not refuse its command line: {outcome}"
    lines = outcome.stderr.strip().splitlines()
    assert outcome.status == 2 and len(lines) == 1, (case.argv, outcome)
    assert "Traceback" not in outcome.stderr
    assert case.option in lines[0], (case.option, lines[0])


@contextmanager
def _listening() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(
    "option, extra",
    [
        ("--port", []),
        ("--metrics-port", []),
        ("--http-port", ["--engine", "vllm", "--model", str(_WORKDIR)]),
    ],
)
def test_a_port_in_use_is_refused_before_the_engine_loads(option: str, extra: list[str]) -> None:
    with _listening() as busy:
        outcome = run_main(["serve", "--port", "0", *extra, option, str(busy)])
    assert outcome.status == 2, outcome
    assert outcome.stderr.strip() == f"wsync serve: {option} {busy}: cannot bind 127.0.0.1:{busy}: the port is in use"


def test_an_unknown_option_and_a_missing_command_are_one_line() -> None:
    for argv, says in ((["serve", "--no-such-option"], "--no-such-option"), ([], "command")):
        outcome = run_main(argv)
        assert outcome.status == 2 and len(outcome.stderr.strip().splitlines()) == 1, outcome
        assert says in outcome.stderr


CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import test_cli_options as t
loaded = {}
for case in t.CASES:
    status = t.run_main(case.argv).status
    heavy = sorted(m for m in ("transformers", "vllm") if m in sys.modules)
    if heavy or status != 2:
        loaded[case.id] = [status, heavy]
print(json.dumps(loaded))
"""


def test_no_refusal_imports_transformers_or_vllm() -> None:
    """A fresh interpreter runs the whole table; after each case neither library has been imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize(
    ("argv", "option"), [(["--transport", "gloo"], "--transport"), (["--steps", "two"], "--steps")]
)
def test_the_demo_refuses_a_bad_option_in_one_line_before_loading_a_model(argv: list[str], option: str) -> None:
    from wsync_grpc.tools import demo

    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and f"argument {option}" in lines[0], lines


@pytest.mark.parametrize("value", ["gloo", "shared-memory"])
def test_a_trainer_rank_refuses_a_bad_transport_in_one_line(value: str) -> None:
    """``python -m wsync_grpc.tools.fsdp_rank`` (the sharded demo's and tests' rank) refuses a bad ``--transport`` in
    one line naming it, exit status 2, before it joins anything."""
    from wsync_grpc.tools import fsdp_rank

    err = io.StringIO()
    argv = ["--rank", "0", "--world", "2", "--master-port", "1", "--targets", "127.0.0.1:1", "--transport", value]
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        fsdp_rank.parse_args(argv)
    assert e.value.code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "argument --transport" in lines[0], lines
