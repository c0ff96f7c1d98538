"""``wsync serve --engine vllm``: a vLLM engine with its OpenAI-compatible HTTP API (the ``vllm`` extra).

The plug-in checks the command line; :mod:`~wsync_grpc.tools.engines.vllm_server`
(imported only when this engine is served, so that ``wsync`` works without vLLM)
runs vLLM's API server with the weight-sync server beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
from pathlib import Path

from wsync_grpc.tools import options as cli_options
from wsync_grpc.tools.common import UsageError
from wsync_grpc.tools.engines.registry import EngineOptions, EngineServer, ServerOptions
from wsync_grpc.wire.targets import is_loopback

_INSTALL = "pip install 'wsync-grpc[vllm]'; on CPU hosts see docs/guides/vllm.md"

log = logging.getLogger("wsync")


def _vllm_flags(vllm_args: str) -> set[str]:
    """The option names in ``--vllm-args`` (``--api-key=K`` and ``--api-key K`` alike).

    Raises:
        UsageError: the string does not split as a shell would (an unclosed quote).
    """
    try:
        words = shlex.split(vllm_args)
    except ValueError as e:
        raise UsageError(f"--vllm-args: {e}") from None
    return {w.partition("=")[0] for w in words if w.startswith("--")}


def check_http_exposure(args: argparse.Namespace) -> None:
    """Refuse to expose vLLM's HTTP API beyond loopback unprotected, as ``--host`` is for the control port.

    vLLM's OpenAI server is not behind wsync's token: on a non-loopback ``--http-host`` it needs its own API
    key (``--api-key`` in ``--vllm-args``, or ``VLLM_API_KEY``, vLLM's own settings) and TLS
    (``--ssl-certfile``/``--ssl-keyfile``), or ``--insecure``; with ``--insecure`` what is missing is logged.

    Raises:
        UsageError: an exposed HTTP API without API key or TLS and without ``--insecure``.
    """
    if is_loopback(args.http_host):
        return
    flags = _vllm_flags(args.vllm_args)
    missing = [
        what
        for what, present in (
            ("an API key (--api-key or VLLM_API_KEY)", "--api-key" in flags or bool(os.environ.get("VLLM_API_KEY"))),
            ("TLS (--ssl-certfile/--ssl-keyfile)", {"--ssl-certfile", "--ssl-keyfile"} <= flags),
        )
        if not present
    ]
    if not missing:
        return
    if not args.insecure:
        raise UsageError(
            f"--http-host {args.http_host} exposes vLLM's HTTP API without {' and '.join(missing)}: pass them in "
            "--vllm-args, or --insecure to accept that anyone who reaches the port can use it"
        )
    log.warning("vLLM's HTTP API served on %s without %s", args.http_host, " and ".join(missing))


class VllmPlugin(EngineServer):
    """The vLLM engine: ``--model DIR`` (required), ``--tensor-parallel-size``, ``--http-host/--http-port``,
    ``--vllm-args``."""

    name = "vllm"
    help = "a vLLM engine serving --model DIR with its OpenAI-compatible HTTP API (the 'vllm' extra)"

    def add_options(self, options: EngineOptions) -> None:
        """vLLM's tensor parallel size, HTTP address, and further engine arguments."""
        options.add_argument(
            "--tensor-parallel-size",
            type=cli_options.positive_int,
            default=1,
            metavar="N",
            help="vLLM's tensor parallel size",
        )
        options.add_argument(
            "--http-host",
            default="127.0.0.1",
            metavar="HOST",
            help="bind address of vLLM's HTTP API (default loopback)",
        )
        options.add_argument(
            "--http-port", type=cli_options.fixed_port, default=8000, metavar="PORT", help="TCP port of vLLM's HTTP API"
        )
        options.add_argument(
            "--vllm-args", default="", metavar="ARGS", help="further vLLM engine arguments, quoted as one string"
        )

    def check(self, args: argparse.Namespace) -> None:
        """Check ``--model`` and that vLLM is installed (without importing it: seconds).

        Raises:
            UsageError: no ``--model``, no such directory, the ``vllm`` extra is not installed, ``--vllm-args``
                that does not split as a shell would, an exposed
                ``--http-host`` without vLLM's API key and TLS (:func:`check_http_exposure`), or an HTTP address
                this host cannot bind now (:func:`~wsync_grpc.tools.options.check_bindable`).
        """
        if args.model is None:
            raise UsageError("--engine vllm needs --model DIR (a Hugging Face checkpoint directory with safetensors)")
        if not Path(args.model).is_dir():
            raise UsageError(f"--model {args.model}: no such directory")
        if importlib.util.find_spec("vllm") is None:
            raise UsageError(f"--engine vllm needs the 'vllm' extra: {_INSTALL}")
        _vllm_flags(args.vllm_args)  # the quoting only: the arguments are vLLM's own parser's to check
        cli_options.check_bindable(args.http_host, args.http_port, "--http-host", "--http-port")
        check_http_exposure(args)

    def serve(self, args: argparse.Namespace, server: ServerOptions) -> int:
        """Run vLLM's API server and the weight-sync server until SIGINT/SIGTERM.

        Raises:
            UsageError: the ``vllm`` extra is not installed.
            SystemExit: vLLM refused its arguments (``--vllm-args``).
        """
        try:
            from wsync_grpc.tools.engines import vllm_server
        except ImportError as e:
            raise UsageError(f"--engine vllm needs the 'vllm' extra ({_INSTALL}): {e}") from None
        return vllm_server.serve(
            vllm_server.VllmServeOptions(
                model=args.model,
                server=server,
                http_host=args.http_host,
                http_port=args.http_port,
                tensor_parallel_size=args.tensor_parallel_size,
                vllm_args=args.vllm_args,
            )
        )
