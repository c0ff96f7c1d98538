"""The value types of ``wsync``'s options, checked when the command line is parsed, before anything loads.

Each function here is an argparse ``type=``: it turns the option's text into
its value or raises :class:`argparse.ArgumentTypeError` with a reason, which
:class:`OneLineParser` prints as one line naming the option (exit status 2).
What can only be checked against this host is checked after parsing and
before anything loads: paths by :func:`check_paths` (so that a command line
naming another host's paths still parses), addresses by :func:`check_bindable`
(a port in use, an address that is not this host's).
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import socket
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from wsync_grpc.tools.common import UsageError

MAX_PORT = 65535
"""The largest TCP port."""

MAX_SECONDS = 7 * 24 * 3600.0
"""The longest duration an option takes, in seconds (a week: gRPC's millisecond options are 32-bit)."""

LOG_LEVELS = tuple(
    logging.getLevelName(n) for n in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
)
"""The level names ``--log-level`` takes (:mod:`logging`'s, any case)."""


class OneLineParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose refusals are one line on stderr, exit status 2.

    argparse prints its usage block before the error; here the line is the
    command, the option and the reason (``wsync serve: argument --port: 99999
    is not a TCP port (0-65535)``), as every other usage error of ``wsync``
    is. Sub-commands added through :meth:`add_subparsers` get the same class.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: <message>`` and exit with status 2 (argparse's status for a usage error)."""
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def port(text: str) -> int:
    """A TCP port to bind, 0 to 65535 (0: any free one).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range.
    """
    return _port_from(text, 0, f"a TCP port (0-{MAX_PORT}; 0 picks a free one)")


def fixed_port(text: str) -> int:
    """A TCP port others are told in advance, 1 to 65535 (0 would pick one nobody learns).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range.
    """
    return _port_from(text, 1, f"a TCP port to serve on (1-{MAX_PORT})")


def seconds(text: str) -> float:
    """A duration in seconds, above 0 and at most :data:`MAX_SECONDS`.

    Raises:
        argparse.ArgumentTypeError: not a number, not above 0, or above :data:`MAX_SECONDS`.
    """
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a duration above 0 seconds")
    return value


def seconds_or_zero(text: str) -> float:
    """A duration in seconds, 0 or more and at most :data:`MAX_SECONDS`.

    Raises:
        argparse.ArgumentTypeError: not a number, below 0, or above :data:`MAX_SECONDS`.
    """
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a duration of 0 seconds or more")
    return value


def positive_int(text: str) -> int:
    """An integer of 1 or more.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    return _integer_from(text, 1)


def count(text: str) -> int:
    """An integer of 0 or more (what 0 means is the option's).

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 0.
    """
    return _integer_from(text, 0)


def device(text: str) -> str:
    """A device to serve a model on: ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``, as PyTorch spells
    them (whether this host has it is checked before the model loads: :func:`check_device`).

    Raises:
        argparse.ArgumentTypeError: another spelling.
    """
    kind, _, index = text.partition(":")
    if (kind == "cpu" and not _) or (kind == "cuda" and (not _ or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N")


def check_device(text: str, option: str = "--device") -> None:
    """That this host has the device ``text`` (:func:`device`'s value); imports PyTorch.

    Raises:
        UsageError: a CUDA device where PyTorch sees none, or an index beyond those it sees.
    """
    if not text.startswith("cuda"):
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(text.partition(":")[2] or 0)
    if index >= n:
        raise UsageError(f"{option} {text}: this host has {n} CUDA device(s) PyTorch can use")


def file_path(text: str) -> Path:
    """A file that must exist on this host (checked by :func:`check_paths`, after parsing).

    Paths are checked after parsing, not here, so that a command line with a path of another host (a
    page's example) still parses.
    """
    return Path(text)


def dir_path(text: str) -> str:
    """A directory that must exist on this host, as given (checked by :func:`check_paths`, after parsing)."""
    return text


def file_to_write(text: str) -> Path:
    """A file to write later, whose directory must exist on this host (checked by :func:`check_paths`)."""
    return Path(text)


def _file_problem(value: object) -> str | None:
    path = Path(str(value))
    return None if path.is_file() else "no such file"


def _dir_problem(value: object) -> str | None:
    return None if Path(str(value)).is_dir() else "no such directory"


def _write_problem(value: object) -> str | None:
    path = Path(str(value))
    if path.is_dir():
        return "a directory, not a file to write"
    return None if path.parent.is_dir() else f"no such directory {path.parent}"


_PATH_PROBLEMS: dict[Callable[[str], object], Callable[[object], str | None]] = {
    file_path: _file_problem,
    dir_path: _dir_problem,
    file_to_write: _write_problem,
}


def check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a path option whose file or directory is not on this host: every option of ``parser`` (and of the
    sub-command ``args`` chose) typed :func:`file_path`, :func:`dir_path` or :func:`file_to_write`.

    Raises:
        UsageError: one line naming the option, the path and what is wrong with it.
    """
    actions = list(parser._actions)
    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        chosen = sub.choices.get(getattr(args, sub.dest or "", None) or "")
        if chosen is not None:
            actions += chosen._actions
    for action in actions:
        problem_of = _PATH_PROBLEMS.get(action.type)  # type: ignore[arg-type]
        value = getattr(args, action.dest, None)
        if problem_of is None or value is None:
            continue
        for one in value if isinstance(value, list) else [value]:
            problem = problem_of(one)
            if problem is not None:
                raise UsageError(
                    f"{action.option_strings[-1] if action.option_strings else action.dest} {one}: {problem}"
                )


def log_level(text: str) -> str:
    """A :mod:`logging` level name, any case (``debug``, ``INFO``...), as upper case.

    Raises:
        argparse.ArgumentTypeError: not one of logging's level names.
    """
    names = LOG_LEVELS
    if text.upper() not in names:
        raise argparse.ArgumentTypeError(f"{text} is not a log level: choose one of {', '.join(names)}")
    return text.upper()


def target(text: str) -> str:
    """An engine's gRPC address ``host:port`` (``[v6]:port`` for an IPv6 address), port 1 to 65535.

    Raises:
        argparse.ArgumentTypeError: no host, no port, or the port is not one.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text} is not an address host:port (port 1-{MAX_PORT})")
    return text


def non_empty(text: str) -> str:
    """A string with something in it (not only blanks).

    Raises:
        argparse.ArgumentTypeError: empty or blank.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def check_bindable(host: str, port: int, host_option: str, port_option: str) -> None:
    """Refuse an address this host cannot bind now, before a model loads: a host that does not resolve or is
    not this host's, or a port in use.

    The probe binds and closes a TCP socket with ``SO_REUSEADDR``, as gRPC's and
    Prometheus' servers bind (a port left in ``TIME_WAIT`` is bindable; one with a
    listener is not). Port 0 checks the host only. Another process may still take the
    port between the probe and the server's bind; the server's own bind then fails.

    Args:
        host, port: the address the server will bind.
        host_option, port_option: the options that named them, for the message (``--host``, ``--port``).

    Raises:
        UsageError: one line naming the option at fault (the port's when it is in use, else the host's),
            the address and the reason.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"{host_option} {host}: cannot resolve it: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"{port_option} {port}: cannot bind {host}:{port}: the port is in use") from None
            raise UsageError(f"{host_option} {host}: cannot bind {host}:{port}: {e.strerror}") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not an integer") from None


def _port_from(text: str, least: int, what: str) -> int:
    value = _integer(text)
    if not least <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def _integer_from(text: str, least: int) -> int:
    value = _integer(text)
    if value < least:
        raise argparse.ArgumentTypeError(f"{text} is not an integer of {least} or more")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number") from None
    if not math.isfinite(value) or abs(value) > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is not a duration in seconds (at most {MAX_SECONDS:g})")
    return value
