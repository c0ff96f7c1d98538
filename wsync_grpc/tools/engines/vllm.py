"""``wsync serve --engine vllm``: a vLLM engine with its OpenAI-compatible HTTP API (the ``vllm`` extra).

The plug-in checks the command line; :mod:`~wsync_grpc.tools.engines.vllm_server`
(imported only when this engine is served, so that ``wsync`` works without vLLM)
runs vLLM's API server with the weight-sync server beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from wsync_grpc.tools.common import UsageError
from wsync_grpc.tools.engines.registry import EngineOptions, EngineServer, ServerOptions

_INSTALL = "pip install 'wsync-grpc[vllm]'; on CPU hosts see the README"


class VllmPlugin(EngineServer):
    """The vLLM engine: ``--model DIR`` (required), ``--tensor-parallel-size``, ``--http-host/--http-port``,
    ``--vllm-args``."""

    name = "vllm"
    help = "a vLLM engine serving --model DIR with its OpenAI-compatible HTTP API (the 'vllm' extra)"

    def add_options(self, options: EngineOptions) -> None:
        """vLLM's tensor parallel size, HTTP address, and further engine arguments."""
        options.add_argument(
            "--tensor-parallel-size", type=int, default=1, metavar="N", help="vLLM's tensor parallel size"
        )
        options.add_argument(
            "--http-host",
            default="127.0.0.1",
            metavar="HOST",
            help="bind address of vLLM's HTTP API (default loopback)",
        )
        options.add_argument("--http-port", type=int, default=8000, metavar="PORT", help="TCP port of vLLM's HTTP API")
        options.add_argument(
            "--vllm-args", default="", metavar="ARGS", help="further vLLM engine arguments, quoted as one string"
        )

    def check(self, args: argparse.Namespace) -> None:
        """Check ``--model`` and that vLLM is installed (without importing it: seconds).

        Raises:
            UsageError: no ``--model``, no such directory, or the ``vllm`` extra is not installed.
        """
        if args.model is None:
            raise UsageError("--engine vllm needs --model DIR (a Hugging Face checkpoint directory with safetensors)")
        if not Path(args.model).is_dir():
            raise UsageError(f"--model {args.model}: no such directory")
        if importlib.util.find_spec("vllm") is None:
            raise UsageError(f"--engine vllm needs the 'vllm' extra: {_INSTALL}")

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
