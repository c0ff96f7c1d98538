"""Running the wsync servicer in a gRPC server: health, reflection, auth, graceful shutdown.

:func:`build_server` starts a ``grpc.server`` with ``wsync.v1.WeightSyncService``
(and, for the reference engine, ``wsync.v1.GenerationService``), standard
health checking (``grpc.health.v1``) and server reflection, so that
``grpcurl`` and ``buf curl`` work without proto files. It binds to loopback
by default (``docs/architecture.md``, "Invariants"); when exposed, use TLS and a shared-secret
token (``authorization: Bearer <token>`` metadata).
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from wsync.v1 import weight_sync_pb2, weight_sync_pb2_grpc

from wsync_grpc.core.engine import Engine
from wsync_grpc.service.metrics import RpcMetrics
from wsync_grpc.service.servicer import WeightSyncServicer

log = logging.getLogger(__name__)

WEIGHT_SYNC_SERVICE = weight_sync_pb2.DESCRIPTOR.services_by_name["WeightSyncService"].full_name
"""Full name of the service: ``wsync.v1.WeightSyncService``."""

if TYPE_CHECKING:
    _Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor

_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class _TokenAuth(_Interceptor):
    """Refuse calls without ``authorization: Bearer <token>`` (health and reflection stay open).

    The scheme is case-insensitive (RFC 6750 section 2.1 after RFC 7235); the token is compared in
    constant time.
    """

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>'")

        self._deny: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Prepare": grpc.stream_unary_rpc_method_handler(deny),
            "Watch": grpc.unary_stream_rpc_method_handler(deny),
        }
        self._deny_unary: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)

    def _authorized(self, value: str | bytes) -> bool:
        raw = value.encode() if isinstance(value, str) else value
        scheme, _, token = raw.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if details.method.startswith(_OPEN_METHODS):
            return continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and self._authorized(value):
                return continuation(details)
        deny = self._deny.get(details.method.rsplit("/", 1)[-1], self._deny_unary)
        return deny


@dataclass
class WsyncServer:
    """A running server.

    Attributes:
        server: the ``grpc.Server``.
        port: the bound TCP port.
        address: ``host:port`` to give clients.
        servicer: the weight-sync servicer.
        health: the health servicer (``""`` and the service name report SERVING).
        metrics_http: the HTTP server of ``/metrics`` (Prometheus), ``None`` when not asked for.
    """

    server: grpc.Server
    port: int
    address: str
    servicer: WeightSyncServicer
    health: health.HealthServicer
    metrics_http: Any = None
    _stopped: threading.Event = field(default_factory=threading.Event)

    def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, cancel any update, leave the group, then stop with ``grace`` seconds."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.servicer.shutdown()
        self.server.stop(grace).wait(grace + 5)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()

    def wait(self) -> None:
        """Block until the server stops."""
        self.server.wait_for_termination()


KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
"""HTTP/2 keepalive of the engine's server: it pings every connection every 2 s and drops one whose peer
does not answer within 2 s (``keepalive_timeout_ms``, and ``http2.ping_timeout_ms`` in gRPC's current
core). A frozen or partitioned trainer announces nothing (no FIN, no RST); the dropped connection ends
its held ``Watch`` and ``KeepAlive`` calls as its death would. The trainer's own pings are accepted
down to one a second (gRPC's A8 client-side keepalive)."""


def build_server(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    token: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    extra: Callable[[grpc.Server], list[str]] | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = None,
    checkpoint_roots: Sequence[str] = (),
) -> WsyncServer:
    """Start a server for ``engine`` on ``host:port`` (port 0 = any free port).

    Args:
        engine: the engine.
        host: bind address; loopback by default.
        port: TCP port; 0 picks a free one (see :attr:`WsyncServer.port`).
        max_workers: gRPC handler threads (each RPC holds one while it runs;
            Init and Complete may hold one for up to their timeout).
        token: if set, every call but health and reflection must carry
            ``authorization: Bearer <token>``.
        tls_cert, tls_key: PEM files of the server's certificate chain and key; both set = TLS.
        extra: registers further services on the server; returns their full names
            (for reflection and health).
        metrics_host: bind address of the Prometheus ``/metrics`` endpoint (default loopback).
        metrics_port: its TCP port; ``None`` (default) serves no metrics; 0 picks a free port.
        checkpoint_roots: directories disk updates may read checkpoints from
            (``--checkpoint-root``); empty: disk updates get PERMISSION_DENIED.

    Raises:
        ValueError: only one of ``tls_cert`` and ``tls_key`` given; a checkpoint root that is not a directory.
        OSError: a TLS file cannot be read.
        RuntimeError: the port could not be bound.
        OSError: the metrics port could not be bound.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and its key (tls_cert and tls_key)")
    creds = (
        grpc.ssl_server_credentials([(tls_key.read_bytes(), tls_cert.read_bytes())]) if tls_cert and tls_key else None
    )
    servicer = WeightSyncServicer(engine, checkpoint_roots=checkpoint_roots)
    # First, so that calls the token check refuses are counted too.
    rpc_metrics = RpcMetrics(servicer.engine.metrics)
    interceptors: list[_Interceptor] = [rpc_metrics]
    interceptors += [_TokenAuth(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="wsync-grpc"),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS],
    )
    weight_sync_pb2_grpc.add_WeightSyncServiceServicer_to_server(servicer, server)
    names = [WEIGHT_SYNC_SERVICE]
    if extra is not None:
        names += extra(server)
    rpc_metrics.count_services(names)  # only these methods get series of their own
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _enable_reflection([*names, health.SERVICE_NAME], server)
    bind = f"{host}:{port}"
    bound = server.add_secure_port(bind, creds) if creds is not None else server.add_insecure_port(bind)
    if bound == 0:
        raise RuntimeError(f"could not bind {bind}")
    metrics_http = servicer.engine.metrics.serve(metrics_host, metrics_port) if metrics_port is not None else None
    server.start()
    shown = host if ":" not in host else f"[{host}]"
    log.info("wsync serving %s on %s:%d", engine.name, shown, bound)
    return WsyncServer(server, bound, f"{shown}:{bound}", servicer, health_servicer, metrics_http)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
"""The stable reflection service (grpcurl's default); grpcio-reflection ships only ``v1alpha``."""


def _enable_reflection(service_names: list[str], server: grpc.Server) -> None:
    """Serve server reflection as ``grpc.reflection.v1alpha`` and as ``grpc.reflection.v1``.

    The two protocols are the same messages under two package names (same fields, same numbers),
    so one ``v1alpha`` servicer answers both: the ``v1`` method is registered with the ``v1alpha``
    message classes, which read and write identical bytes.
    """
    servicer = reflection.ReflectionServicer([*service_names, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),)
    )


def stop_on_signals(server: WsyncServer, grace: float = 5.0, on_stop: Callable[[], None] | None = None) -> None:
    """Stop ``server`` gracefully on SIGTERM or SIGINT (health NOT_SERVING, then ``stop(grace)``).

    Must be called from the main thread.
    """

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down (grace %.1f s)", signum, grace)
        threading.Thread(target=_stop, daemon=True).start()

    def _stop() -> None:
        server.stop(grace)
        if on_stop is not None:
            on_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` to ``path`` atomically (for launchers waiting on a port-0 server)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)
