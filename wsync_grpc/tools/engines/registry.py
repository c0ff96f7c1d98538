"""The registry of engines ``wsync serve --engine NAME`` can serve, and what a plug-in implements.

An engine plug-in is an object with a ``name`` (what ``--engine`` takes), a
one-line ``help``, the command-line options it contributes (an argument group
of its own in ``wsync serve --help``) and a check of them. It is one of two kinds:

- an :class:`EngineFactory` builds an in-process :class:`~wsync_grpc.core.engine.Engine`
  (with what to close at shutdown and any further gRPC services); ``wsync serve``
  serves it with the weight-sync servicer (the reference, synthetic and tensor engines);
- an :class:`EngineServer` runs its own server and starts the servicer beside it with
  :meth:`ServerOptions.start` (vLLM: its OpenAI-compatible API server in the same process).

Built-in engines are registered here by import path and loaded on first use, so
that a missing extra costs nothing until its engine is asked for. Third-party
engines register in the ``wsync.engines`` entry-point group; the entry point
names the plug-in class (instantiated with no arguments) or instance, e.g. in
the plug-in package's ``pyproject.toml``::

    [project.entry-points."wsync.engines"]
    sglang = "wsync_sglang.serve:SglangPlugin"

A plug-in may also be registered at run time with :func:`register_engine`
(before the ``wsync`` parser is built).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import grpc

from wsync_grpc.core.engine import Engine
from wsync_grpc.core.timeouts import ServerBounds
from wsync_grpc.service.auth import Principal
from wsync_grpc.service.call_limits import CallLimits
from wsync_grpc.service.server import WsyncServer, build_server
from wsync_grpc.tools.common import UsageError
from wsync_grpc.wire.keepalive import Keepalive

log = logging.getLogger("wsync")

ENTRY_POINT_GROUP = "wsync.engines"
"""The entry-point group third-party engine plug-ins register in."""

BUILTIN: dict[str, str] = {
    "reference": "wsync_grpc.tools.engines.reference:ReferencePlugin",
    "synthetic": "wsync_grpc.tools.engines.synthetic:SyntheticPlugin",
    "vllm": "wsync_grpc.tools.engines.vllm:VllmPlugin",
}
"""The engines wsync ships: ``--engine`` name -> ``"module:attribute"`` of the plug-in class."""

DEFAULT_ENGINE = "reference"
"""The engine ``wsync serve`` runs without ``--engine`` (or ``--synthetic``)."""


class EngineOptions:
    """The argument group an engine adds its ``wsync serve`` options to; remembers which are the engine's.

    ``wsync serve`` refuses an option of one engine given to another (it would be
    silently ignored), so an engine adds its options here rather than to the parser.
    Option strings are shared with every other engine's and ``wsync serve``'s own:
    prefix new ones with the engine's name (``--sglang-mem-fraction``).
    """

    def __init__(self, group: argparse._ArgumentGroup) -> None:
        self._group = group
        self.actions: list[argparse.Action] = []
        """The options added so far (argparse actions: ``dest``, ``default``, ``option_strings``)."""

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action:
        """:meth:`argparse.ArgumentParser.add_argument` in the engine's group.

        Raises:
            argparse.ArgumentError: an option string another engine (or ``wsync serve``) already has.
        """
        action = self._group.add_argument(*flags, **kwargs)
        self.actions.append(action)
        return action

    def given(self, args: argparse.Namespace) -> list[str]:
        """The options of this group that ``args`` sets to something other than their default."""
        return [a.option_strings[0] for a in self.actions if getattr(args, a.dest, a.default) != a.default]


@dataclass(frozen=True)
class BuiltEngine:
    """What an :class:`EngineFactory` built: the engine ``wsync serve`` serves, and its extras.

    Attributes:
        engine: the engine, served by the weight-sync servicer.
        close: releases the engine's resources (called once at shutdown, after the server stopped
            taking calls).
        services: registers further gRPC services on the server and returns their full names (for
            reflection and health), e.g. the reference engine's ``GenerationService``; ``None``: none.
    """

    engine: Engine
    close: Callable[[], None] = field(default=lambda: None)
    services: Callable[[grpc.Server], list[str]] | None = None


@dataclass(frozen=True)
class ServerOptions:
    """The weight-sync server ``wsync serve`` was asked for, checked (every engine serves it the same way).

    Attributes:
        host, port: the gRPC server's bind address and TCP port (0 = any free one).
        token: the bearer token every call but health and reflection must carry (an operator's); ``None``: none.
        principals: further tokens, each a principal with a role (``--token-file``,
            :func:`~wsync_grpc.service.auth.read_token_file`); ``None``: none.
        tls_cert, tls_key: PEM files of the server's certificate chain and key; both set = TLS.
        tls_client_ca: PEM file of the authorities a client certificate must be signed by (mutual TLS).
        port_file: where to write the bound port once the engine serves (``None``: nowhere).
        grace: seconds in-flight RPCs get at shutdown.
        metrics_host, metrics_port: the Prometheus ``/metrics`` endpoint (``None`` port: not served).
        checkpoint_roots: directories disk updates may read checkpoints from (``--checkpoint-root``).
        limits: calls of each class at once (``--max-calls``); ``None``: the defaults.
        bounds: caps on what callers choose, and the update idle limit; ``None``: the defaults.
        keepalive: HTTP/2 keepalive of the server; ``None``: the defaults.
        allowed_masters: CIDR networks Init's master address must lie in (``--allow-master``); empty: any.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    principals: Mapping[str, Principal] | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    port_file: Path | None = None
    grace: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    checkpoint_roots: Sequence[str] = ()
    limits: CallLimits | None = None
    bounds: ServerBounds | None = None
    keepalive: Keepalive | None = None
    allowed_masters: Sequence[str] = ()

    def start(self, engine: Engine, services: Callable[[grpc.Server], list[str]] | None = None) -> WsyncServer:
        """Start the weight-sync server for ``engine`` (with ``services`` beside it); it serves until stopped.

        Raises:
            RuntimeError: the port cannot be bound (see :func:`~wsync_grpc.service.server.build_server`).
        """
        return build_server(
            engine,
            host=self.host,
            port=self.port,
            token=self.token,
            principals=self.principals,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_client_ca=self.tls_client_ca,
            extra=services,
            metrics_host=self.metrics_host,
            metrics_port=self.metrics_port,
            checkpoint_roots=self.checkpoint_roots,
            limits=self.limits,
            bounds=self.bounds,
            keepalive=self.keepalive,
            allowed_masters=self.allowed_masters,
        )


class EnginePlugin(ABC):
    """An engine ``wsync serve --engine NAME`` can serve (subclass :class:`EngineFactory` or :class:`EngineServer`).

    Attributes:
        name: what ``--engine`` takes (lower case, no spaces).
        help: one line for ``wsync serve --help``.
    """

    name: str
    help: str

    def add_options(self, options: EngineOptions) -> None:  # noqa: B027 (an engine may have no options)
        """Add this engine's ``wsync serve`` options (default: none).

        ``wsync serve``'s own options (``--model``, ``--dtype``, the server's) are not repeated here.
        """

    def check(self, args: argparse.Namespace) -> None:  # noqa: B027 (an engine may have nothing to check)
        """Check the parsed command line before anything starts (default: nothing to check).

        Raises:
            UsageError: what cannot work and how to fix it, in one line.
        """


class EngineFactory(EnginePlugin):
    """An engine living in the ``wsync serve`` process: built here, served by ``wsync serve``'s own server."""

    @abstractmethod
    def build(self, args: argparse.Namespace) -> BuiltEngine:
        """Build the engine from the checked command line (loading a model may take a while).

        Raises:
            UsageError: the engine cannot be built from what was given (no such model, a missing extra).
        """


class EngineServer(EnginePlugin):
    """An engine that runs its own server (e.g. an HTTP API) and the weight-sync server beside it."""

    @abstractmethod
    def serve(self, args: argparse.Namespace, server: ServerOptions) -> int:
        """Serve until SIGINT/SIGTERM, on the calling (main) thread; return the exit status.

        Start the weight-sync server with ``server.start(engine)`` and write ``server.port_file``
        once both serve.

        Raises:
            UsageError: the engine cannot be started from what was given.
        """


_registry: dict[str, EnginePlugin] = {}
_loaded = False


def register_engine(plugin: EnginePlugin, *, replace: bool = False) -> None:
    """Make ``plugin`` servable as ``wsync serve --engine plugin.name``.

    Register before the ``wsync`` parser is built (:func:`wsync_grpc.tools.cli.build_parser`):
    the parser asks each engine for its options once.

    Raises:
        TypeError: ``plugin`` is not an :class:`EngineFactory` or :class:`EngineServer`.
        ValueError: its name is empty or holds white space, its help is not one line, or another engine
            has its name (and not ``replace``).
    """
    _load()
    _register(plugin, replace=replace)


def unregister_engine(name: str) -> EnginePlugin:
    """Remove the engine ``name`` from the registry; the plug-in it held.

    Raises:
        UsageError: no engine has that name (the message lists those that do).
    """
    plugin = engine_plugin(name)
    del _registry[name]
    return plugin


def registered_engines() -> dict[str, EnginePlugin]:
    """The engines ``wsync serve`` can serve, by name: built-ins first, then third-party ones, in order."""
    _load()
    return dict(_registry)


def engine_plugin(name: str) -> EnginePlugin:
    """The plug-in registered as ``name``.

    Raises:
        UsageError: no engine has that name; the message lists the registered ones.
    """
    _load()
    try:
        return _registry[name]
    except KeyError:
        names = ", ".join(_registry)
        raise UsageError(
            f"--engine {name}: no such engine; registered engines are {names} "
            f"(third-party engines register in the {ENTRY_POINT_GROUP!r} entry-point group)"
        ) from None


def load_entry_points(eps: Iterable[EntryPoint] | None = None) -> list[str]:
    """Register the plug-ins of entry points (default: the installed ``wsync.engines`` group); their names.

    An entry point names a plug-in class (instantiated with no arguments) or instance; its
    entry-point name is only used in messages. One that cannot be loaded, is not a plug-in, or
    takes a name already registered is skipped with a warning, so a broken third-party package
    does not take the ``wsync`` command down.
    """
    _load()
    return _load_entry_points(entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps)


def _load() -> None:
    """Register the built-ins, then the installed entry points (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, target in BUILTIN.items():
        if name not in _registry:
            _register(_instantiate(_import(target)), replace=False)
    _load_entry_points(entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_points(eps: Iterable[EntryPoint]) -> list[str]:
    names: list[str] = []
    for ep in eps:
        try:
            plugin = _instantiate(ep.load())
            _register(plugin, replace=False)
        except Exception as e:  # a third-party package's bug: warn, serve the others
            log.warning("engine plug-in %r (%s) skipped: %s", ep.name, ep.value, e)
            continue
        names.append(plugin.name)
    return names


def _import(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _instantiate(obj: object) -> EnginePlugin:
    plugin = obj() if isinstance(obj, type) else obj
    if not isinstance(plugin, (EngineFactory, EngineServer)):
        raise TypeError(f"{obj!r} is not an EngineFactory or an EngineServer")
    return plugin


def _register(plugin: EnginePlugin, *, replace: bool) -> None:
    if not isinstance(plugin, (EngineFactory, EngineServer)):
        raise TypeError(f"{plugin!r} is not an EngineFactory or an EngineServer")
    name = getattr(plugin, "name", "")
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"{plugin!r}: an engine's name is a non-empty word, not {name!r}")
    text = getattr(plugin, "help", None)
    if not isinstance(text, str) or not text or "\n" in text:
        raise ValueError(f"engine {name!r}: its help is one line of text, not {text!r}")
    if name in _registry and not replace:
        raise ValueError(f"an engine named {name!r} is registered already ({type(_registry[name]).__qualname__})")
    _registry[name] = plugin
