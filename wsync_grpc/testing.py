"""Helpers for tests, demos and benchmarks that run wsync engines: in-process servers, callers, a trainer rank.

- :func:`in_process_server` serves an engine on a loopback port in this process and
  yields a stub connected to it.
- :func:`owner_channel` is a channel whose calls are one caller's (it keeps its lease).
- :func:`join_as_trainer` initializes an engine and joins its group as rank 0 from this
  process, for driving the RPCs by hand.

Engine processes (:func:`spawn_engine`, :func:`spawn_process`, :class:`EngineProcess`, ...) are
started by :mod:`wsync_grpc.launch`; this module re-exports them, and ``free_port``, under the
same names for the tests and the bench.

Times are in seconds. The rest of the package does not import this module, and it needs nothing
beyond the package's own dependencies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.engine import Engine
from wsync_grpc.group.process_group import WeightSyncGroup, free_port, join_group
from wsync_grpc.launch import (
    DEFAULT_START_TIMEOUT_S,
    SOURCE_ROOT,
    EngineProcess,
    EngineStartError,
    EngineStartTimeout,
    child_env,
    cli_command,
    spawn_engine,
    spawn_process,
    stop_all,
    wait_all,
)
from wsync_grpc.service.server import WsyncServer, build_server
from wsync_grpc.wire.lease import lease_channel

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "SOURCE_ROOT",
    "EngineProcess",
    "EngineStartError",
    "EngineStartTimeout",
    "child_env",
    "cli_command",
    "free_port",
    "in_process_server",
    "join_as_trainer",
    "owner_channel",
    "spawn_engine",
    "spawn_process",
    "stop_all",
    "wait_all",
]


@contextmanager
def in_process_server(
    engine: Engine, *, stop_grace_s: float = 0.5, **build_server_kwargs: Any
) -> Iterator[tuple[WsyncServer, weight_sync_pb2_grpc.WeightSyncServiceStub]]:
    """Serve ``engine`` in this process; yield the server and a stub on an insecure :func:`owner_channel` to it.

    ``build_server_kwargs`` go to :func:`~wsync_grpc.service.server.build_server` (a loopback port
    chosen by the OS unless ``port`` is given; a TLS server needs a channel of your own). At the
    end the channel is closed and the server stopped with ``stop_grace_s`` seconds of grace.

    Raises:
        RuntimeError: the port could not be bound.
    """
    srv = build_server(engine, **build_server_kwargs)
    channel = owner_channel(srv.address)
    try:
        yield srv, weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
    finally:
        channel.close()
        srv.stop(stop_grace_s)


def owner_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to ``target`` (TLS with ``credentials``, else plaintext) whose calls are one caller's: it keeps
    the lease credential a reply issues it and presents it with every later call
    (:func:`~wsync_grpc.wire.lease.lease_channel`). Two such channels are two callers.
    """
    ch = grpc.secure_channel(target, credentials) if credentials is not None else grpc.insecure_channel(target)
    return lease_channel(ch)[0]


def join_as_trainer(
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub,
    timeout_s: float = 30,
    *,
    owner: str = "",
    metadata: Sequence[tuple[str, str]] = (),
) -> WeightSyncGroup:
    """Init the engine behind ``stub`` and join its group as rank 0 (world size 2) from this process.

    Returns the trainer's group (CPU, gloo); ``destroy()`` it when done. ``timeout_s`` (seconds)
    bounds the join and is the Init request's group timeout. ``owner`` is the Init's owner name
    (default: the anonymous owner); ``metadata`` goes with the call (a token).

    Raises:
        grpc.RpcError: Init failed.
        GroupTimeout, GroupError: the group did not form (see :func:`~wsync_grpc.group.process_group.join_group`).
    """
    port = free_port()
    req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, owner=owner)
    req.timeout.FromSeconds(int(timeout_s))
    fut = stub.Init.future(req, timeout=timeout_s + 10, metadata=tuple(metadata))
    group = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=timeout_s)
    fut.result()
    return group
