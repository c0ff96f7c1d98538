"""Running the wsync servicer in a gRPC server: health, reflection, auth, graceful shutdown.

:func:`build_server` starts a ``grpc.server`` with ``wsync.v1.WeightSyncService``
(and, for the reference engine, ``wsync.v1.GenerationService``), standard
health checking (``grpc.health.v1``) and server reflection, so that
``grpcurl`` and ``buf curl`` work without proto files. It binds to loopback
by default (``docs/architecture.md``, "Invariants"); when exposed, use TLS and a shared-secret
token (``authorization: Bearer <token>`` metadata, :mod:`wsync_grpc.service.auth`).

Every call belongs to a class with its own bound on concurrent calls, and the server's pool has a
thread for each call every class may run (:mod:`wsync_grpc.service.call_limits`), so that no traffic
starves the owner's calls; every duration a caller chooses is capped by the operator's
:class:`~wsync_grpc.core.timeouts.ServerBounds`; HTTP/2 keepalive notices a frozen peer
(:mod:`wsync_grpc.wire.keepalive`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from wsync.v1 import weight_sync_pb2, weight_sync_pb2_grpc

from wsync_grpc.core.engine import Engine
from wsync_grpc.core.timeouts import ServerBounds
from wsync_grpc.service.auth import Principal, Role, TokenAuth, is_loopback
from wsync_grpc.service.call_limits import CallLimiter, CallLimits
from wsync_grpc.service.interceptors import Interceptor
from wsync_grpc.service.metrics import RpcMetrics
from wsync_grpc.service.servicer import WeightSyncServicer
from wsync_grpc.wire.keepalive import Keepalive

log = logging.getLogger(__name__)

WEIGHT_SYNC_SERVICE = weight_sync_pb2.DESCRIPTOR.services_by_name["WeightSyncService"].full_name
"""Full name of the service: ``wsync.v1.WeightSyncService``."""


@dataclass
class WsyncServer:
    """A running server.

    Attributes:
        server: the ``grpc.Server``.
        port: the bound TCP port.
        address: ``host:port`` to give clients.
        servicer: the weight-sync servicer.
        health: the health servicer (``""`` and the service name report SERVING).
        limiter: the bounds on each class of calls, with the calls of each running now.
        metrics_http: the HTTP server of ``/metrics`` (Prometheus), ``None`` when not asked for.
    """

    server: grpc.Server
    port: int
    address: str
    servicer: WeightSyncServicer
    health: health.HealthServicer
    limiter: CallLimiter
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


def build_server(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    principals: Mapping[str, Principal] | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_client_ca: Path | None = None,
    extra: Callable[[grpc.Server], list[str]] | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = None,
    checkpoint_roots: Sequence[str] = (),
    limits: CallLimits | None = None,
    bounds: ServerBounds | None = None,
    keepalive: Keepalive | None = None,
    allowed_masters: Sequence[str] = (),
) -> WsyncServer:
    """Start a server for ``engine`` on ``host:port`` (port 0 = any free port).

    Args:
        engine: the engine.
        host: bind address; loopback by default.
        port: TCP port; 0 picks a free one (see :attr:`WsyncServer.port`).
        token: if set, every call but health must carry ``authorization: Bearer <token>``, and
            reflection too when ``host`` is not a loopback address; its bearer is an operator.
        principals: token -> principal (a name and a role: :mod:`wsync_grpc.service.auth`), accepted beside
            ``token``; a principal may make only the calls its role allows (PERMISSION_DENIED otherwise).
        tls_cert, tls_key: PEM files of the server's certificate chain and key; both set = TLS.
        tls_client_ca: PEM file of the certificate authorities a client's certificate must be signed by
            (``--tls-client-ca``; mutual TLS): a caller without such a certificate cannot complete the TLS
            handshake, before any call or token is looked at. ``None``: no client certificate is asked for.
        extra: registers further services on the server; returns their full names
            (for reflection and health).
        metrics_host: bind address of the Prometheus ``/metrics`` endpoint (default loopback).
        metrics_port: its TCP port; ``None`` (default) serves no metrics; 0 picks a free port.
        checkpoint_roots: directories disk updates may read checkpoints from
            (``--checkpoint-root``); empty: disk updates get PERMISSION_DENIED.
        limits: how many calls of each class may run at once (``--max-calls``); ``None``: the defaults
            (:data:`~wsync_grpc.service.call_limits.DEFAULT_CALL_LIMITS`). The server's pool has a thread for
            each (:meth:`~wsync_grpc.service.call_limits.CallLimits.pool_threads`).
        bounds: the caps on the durations callers choose and the update idle limit (``--max-timeout``,
            ``--max-lease-ttl``, ``--min-interval``, ``--update-idle-timeout``); ``None``: the defaults.
        keepalive: HTTP/2 keepalive of the server (``--keepalive-interval``, ``--keepalive-timeout``);
            ``None``: a ping every 10 s, 20 s to answer.
        allowed_masters: CIDR networks Init's master address must lie in (``--allow-master``;
            :class:`~wsync_grpc.service.membership.MasterAllowList`); empty: any.

    Raises:
        ValueError: only one of ``tls_cert`` and ``tls_key`` given, or ``tls_client_ca`` without them; a
            checkpoint root that is not a directory; an allowed master network that is not a CIDR network.
        OSError: a TLS file cannot be read.
        RuntimeError: the port could not be bound.
        OSError: the metrics port could not be bound.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and its key (tls_cert and tls_key)")
    if tls_client_ca is not None and tls_cert is None:
        raise ValueError("client certificates (tls_client_ca) need TLS (tls_cert and tls_key)")
    creds = None
    if tls_cert and tls_key:
        creds = grpc.ssl_server_credentials(
            [(tls_key.read_bytes(), tls_cert.read_bytes())],
            root_certificates=tls_client_ca.read_bytes() if tls_client_ca else None,
            require_client_auth=tls_client_ca is not None,
        )
    limits = limits if limits is not None else CallLimits()
    keepalive = keepalive if keepalive is not None else Keepalive()
    servicer = WeightSyncServicer(
        engine, checkpoint_roots=checkpoint_roots, bounds=bounds, allowed_masters=allowed_masters
    )
    limiter = CallLimiter(limits)
    # Metrics first, so that calls the token check or a class's bound refuses are counted too; the
    # token check before the bounds, so that a caller without the token takes no slot.
    rpc_metrics = RpcMetrics(servicer.engine.metrics)
    interceptors: list[Interceptor] = [rpc_metrics]
    tokens: dict[str, Principal] = dict(principals or {})
    if token:
        tokens[token] = Principal("token", Role.OPERATOR)
    interceptors += [TokenAuth(tokens, exposed=not is_loopback(host))] if tokens else []
    interceptors.append(limiter)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.pool_threads(), thread_name_prefix="wsync-grpc"),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0), *keepalive.server_options()],
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
    return WsyncServer(server, bound, f"{shown}:{bound}", servicer, health_servicer, limiter, metrics_http)


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
