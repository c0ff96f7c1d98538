"""One wsync engine as a Ray actor: :class:`EngineActor` owns the engine's process and says where it serves.

The actor starts ``wsync serve`` (the reference or synthetic engine, or any engine registered with the CLI)
or ``wsync serve --engine vllm`` (:func:`~wsync_grpc.launch.spawn_vllm_engine`) as a child process, through
the launcher room (:mod:`wsync_grpc.launch`), bound to its node's address on a free port, and waits until it
serves. The engine's process and the actor's live and die together:

- the actor dies (``ray.kill``, a SIGKILL of its worker, its node or driver gone): the engine gets SIGKILL from
  the kernel (a parent-death signal, :func:`~wsync_grpc.launch.ending_with_parent`; ``wsync serve`` ends vLLM's
  own processes with it in turn, :mod:`wsync_grpc.tools.orphans`). The actor starts it from its constructor,
  which Ray runs on the worker's main thread, the thread the signal is tied to;
- the engine dies on its own (a crash, a SIGKILL): the actor's watcher thread ends the actor's process
  (``os._exit(1)``), which Ray takes for a failure and restarts the actor while ``max_restarts`` allows: the
  new actor starts a new engine, on a new port, perhaps on another node of its placement group's bundle.

What travels through Ray: the constructor's arguments (:class:`EngineSpec`, kept by Ray's GCS to restart the
actor, so a ``token`` in it is stored there) and the methods' small return values (:class:`EngineInfo`,
:class:`EngineHealth`). The weights and the ``wsync.v1`` calls never go through Ray: the trainer reaches the
engine at :attr:`EngineInfo.target` over gRPC, where nothing is pickled.

Units: times in seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wsync_grpc.launch import (
    DEFAULT_START_TIMEOUT_S,
    VLLM_START_TIMEOUT_S,
    VLLM_TEST_ARGS,
    EngineProcess,
    child_env,
    spawn_engine,
    spawn_vllm_engine,
    vllm_cpu_binds,
)

__all__ = ["RESERVED_ARGS", "RESERVED_VLLM_ARGS", "EngineActor", "EngineHealth", "EngineInfo", "EngineSpec"]

log = logging.getLogger(__name__)

_ANY_ADDRESS = ("0.0.0.0", "::", "")
"""Bind addresses that serve on every interface: the engine is then reached at its node's IP."""

RESERVED_ARGS = frozenset({"--host", "--port", "--port-file"})
"""``wsync serve`` options the engine actor sets itself (not in :attr:`EngineSpec.serve_args`)."""

RESERVED_VLLM_ARGS = frozenset(
    {"--engine", "--model", "--http-host", "--http-port", "--tensor-parallel-size", "--vllm-args"}
)
"""Options the engine actor also sets for vLLM (:attr:`EngineSpec.vllm_model` and its neighbours say them)."""


@dataclass(frozen=True)
class EngineSpec:
    """What each engine actor starts, and how it serves.

    Attributes:
        serve_args: ``wsync serve`` arguments that pick the engine and its options, e.g.
            ``("--synthetic", "tiny", "--dtype", "float32")``; not ``--host``, ``--port`` or ``--port-file``
            (the actor sets them: :data:`RESERVED_ARGS`). With :attr:`vllm_model`, further
            ``wsync serve --engine vllm`` arguments (not those of :data:`RESERVED_VLLM_ARGS` either).
        vllm_model: serve vLLM (``wsync serve --engine vllm``, the ``vllm`` extra installed on the nodes) on
            this model directory, as the engine's node sees it; ``None``: ``wsync serve serve_args``.
        tensor_parallel_size: vLLM's tensor parallel workers (give each bundle the CPUs or GPUs they need).
        vllm_args: further vLLM arguments, one string.
        host: the bind address; ``None`` (default): the node's IP (``ray.util.get_node_ip_address()``), which
            other nodes reach. ``"0.0.0.0"`` serves every interface (the target names the node's IP).
        insecure: pass ``--insecure``: ``wsync serve`` refuses a non-loopback address without TLS and a token
            unless told so (anyone who reaches the port can then change the weights: a private network only).
        token: the engines' token (``WSYNC_TOKEN`` in the engine's environment, never on its command line);
            the handles carry it too, for the trainer (:class:`~wsync_grpc.ray.handles.EngineHandle`). Ray
            keeps the spec (so the token) in its GCS to restart actors. A token travels in clear to a
            non-loopback target only with TLS: pass ``--tls-cert``/``--tls-key`` (paths on the node) in
            ``serve_args`` and ``credentials`` to the trainer.
        env: further environment variables of the engine's process.
        start_timeout_s: how long the actor waits for its engine to serve, in seconds; ``None``: 120 s, or
            300 s for vLLM (:data:`~wsync_grpc.launch.VLLM_START_TIMEOUT_S`).
        stop_grace_s: how long :meth:`EngineActor.stop` lets the engine shut down gracefully, in seconds.

    Raises:
        ValueError: ``serve_args`` sets an option the actor sets, or ``tensor_parallel_size`` is below 1.
    """

    serve_args: tuple[str, ...] = ()
    vllm_model: str | None = None
    tensor_parallel_size: int = 1
    vllm_args: str = VLLM_TEST_ARGS
    host: str | None = None
    insecure: bool = False
    token: str | None = field(default=None, repr=False)
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float | None = None
    stop_grace_s: float = 10.0

    def __post_init__(self) -> None:
        given = {a.split("=", 1)[0] for a in self.serve_args}
        reserved = given & (RESERVED_ARGS | (RESERVED_VLLM_ARGS if self.vllm_model is not None else frozenset()))
        if reserved:
            raise ValueError(f"serve_args must not set {sorted(reserved)}: the engine actor sets them")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class EngineInfo:
    """Where an engine actor runs and serves (:meth:`EngineActor.info`).

    Attributes:
        name: the engine's name (``launch_engines``' ``name`` and its index).
        target: the engine's ``host:port`` for the trainer.
        node_id: the Ray node the actor runs on (hex).
        node_ip: that node's IP.
        actor_pid: the actor's (Ray worker's) process id, on that node.
        engine_pid: the engine's process id, on that node.
        http_target: vLLM's OpenAI-compatible API, ``host:port``; ``None`` for other engines.
        log: the engine's output file, on that node, in a temporary directory of its own: removed when the
            engine is stopped (:meth:`EngineActor.stop`, or the actor's graceful exit), kept after a crash or
            a kill for the post-mortem.
    """

    name: str
    target: str
    node_id: str
    node_ip: str
    actor_pid: int
    engine_pid: int
    http_target: str | None
    log: str


@dataclass(frozen=True)
class EngineHealth:
    """An engine actor's view of its engine (:meth:`EngineActor.health`).

    Attributes:
        target: where it serves.
        running: whether its process runs.
        serving: whether it answered the gRPC health check (``grpc.health.v1``) with SERVING.
        detail: why not, when it did not ("" when it did).
    """

    target: str
    running: bool
    serving: bool
    detail: str = ""


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` now (for vLLM's HTTP API; another process may take it before vLLM does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EngineActor:
    """A Ray actor owning one wsync engine process (decorate with ``ray.remote``: :func:`launch_engines
    <wsync_grpc.ray.placement.launch_engines>` does, with the placement and ``max_restarts``).

    The constructor starts the engine and returns once it serves; a restarted actor (``max_restarts``) runs
    it again and so starts a new engine, on a new port. The engine ends with the actor, and the actor with
    the engine (the module's docstring says how).

    Args:
        name: the engine's name (in messages, and its log file's name).
        spec: what to start and how it serves.
        node_share: ``(index, count)``: this engine's place among the ``count`` engines of its placement group
            on its node (:func:`~wsync_grpc.ray.placement.launch_engines` counts them). A vLLM engine on CPU
            (tensor parallel size 1, no GPU assigned, ``VLLM_CPU_OMP_THREADS_BIND`` set by neither ``spec.env``
            nor the actor's environment) binds its forward to share ``index`` of the node's cores
            (:func:`~wsync_grpc.launch.vllm_cpu_binds`): vLLM's own choice is the same cores for every engine
            of a node. ``(0, 1)`` (default): vLLM's choice.

    Raises:
        EngineStartError: the engine exited before it served, or did not serve within
            ``spec.start_timeout_s`` (then it has been killed); Ray reports it as the actor's creation error.
        OSError: the engine's command could not be started.
    """

    def __init__(self, name: str, spec: EngineSpec, node_share: tuple[int, int] = (0, 1)) -> None:
        self._name = name
        self._spec = spec
        self._node_share = node_share
        self._stopping = threading.Event()
        context = ray.get_runtime_context()
        self._node_id: str = context.get_node_id()
        self._node_ip: str = ray.util.get_node_ip_address()
        bind = spec.host if spec.host is not None else self._node_ip
        self._host = self._node_ip if bind in _ANY_ADDRESS else bind
        self._dir = Path(tempfile.mkdtemp(prefix=f"wsync-{name}-"))
        self._http_target: str | None = None
        self._engine = self._start(bind)
        atexit.register(self._stop)  # a graceful exit of the actor stops the engine gracefully too
        threading.Thread(target=self._watch, name=f"wsync-watch {name}", daemon=True).start()

    def _start(self, bind: str) -> EngineProcess:
        spec = self._spec
        env = dict(spec.env)
        if spec.token is not None:
            env["WSYNC_TOKEN"] = spec.token
        args = ["--host", bind, *(["--insecure"] if spec.insecure else [])]
        port_file, log_file = self._dir / f"{self._name}.port", self._dir / f"{self._name}.log"
        if spec.vllm_model is None:
            return spawn_engine(
                [*spec.serve_args, *args],
                port_file=port_file,
                log=log_file,
                env=child_env(env),
                timeout_s=spec.start_timeout_s or DEFAULT_START_TIMEOUT_S,
                name=self._name,
                host=self._host,
                end_with_parent=True,
            )
        index, count = self._node_share
        if spec.tensor_parallel_size == 1 and not ray.get_gpu_ids() and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env = {**vllm_cpu_binds(count)[index], **env}  # the forward on cores no other engine here binds
        http_port = _free_port(bind or "0.0.0.0")
        self._http_target = _join(self._host, http_port)
        return spawn_vllm_engine(
            Path(spec.vllm_model),
            port_file=port_file,
            http_port=http_port,
            tensor_parallel_size=spec.tensor_parallel_size,
            vllm_args=spec.vllm_args,
            env=env,
            log=log_file,
            timeout_s=spec.start_timeout_s or VLLM_START_TIMEOUT_S,
            name=self._name,
            extra_args=[*spec.serve_args, *args, "--http-host", bind],
            host=self._host,
            end_with_parent=True,
        )

    def _watch(self) -> None:
        """End this actor's process when its engine ends on its own (Ray then restarts the actor)."""
        returncode = self._engine.process.wait()
        if self._stopping.is_set():
            return
        log.error("engine %s (pid %d) exited with %s: ending its actor", self._name, self._engine.pid, returncode)
        os._exit(1)

    def _stop(self) -> None:
        if not self._stopping.is_set():
            self._stopping.set()
            self._engine.stop(self._spec.stop_grace_s)
            shutil.rmtree(self._dir, ignore_errors=True)

    def target(self) -> str:
        """The engine's ``host:port`` (the node's IP unless ``spec.host`` names another address)."""
        return self._engine.target

    def info(self) -> EngineInfo:
        """Where this actor runs and its engine serves."""
        return EngineInfo(
            name=self._name,
            target=self._engine.target,
            node_id=self._node_id,
            node_ip=self._node_ip,
            actor_pid=os.getpid(),
            engine_pid=self._engine.pid,
            http_target=self._http_target,
            log=str(self._engine.log),
        )

    def health(self, timeout_s: float = 2.0) -> EngineHealth:
        """Whether the engine's process runs and answers the gRPC health check within ``timeout_s`` seconds.

        The check is made over a plaintext channel: an engine serving TLS reports ``serving=False`` with
        the reason in :attr:`EngineHealth.detail`.
        """
        target = self._engine.target
        if self._engine.process.poll() is not None:
            return EngineHealth(target, False, False, f"exited with {self._engine.process.returncode}")
        try:
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return EngineHealth(target, True, False, f"health check: {exc.code().name}: {exc.details()}")
        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        detail = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return EngineHealth(target, True, serving, detail)

    def stop(self) -> int | None:
        """Stop the engine gracefully (SIGTERM, then SIGKILL after ``spec.stop_grace_s`` seconds) and remove its
        files; the actor stays.

        Returns:
            The engine's exit status (``None`` if it could not be reaped).
        """
        self._stop()
        with contextlib.suppress(Exception):
            atexit.unregister(self._stop)
        return self._engine.process.returncode

    def placement_group(self) -> object:
        """The placement group this actor runs in (``ray.util.placement_group.PlacementGroup``; ``None`` outside one):
        how a driver that found the actor by name (:func:`~wsync_grpc.ray.placement.find_engines`) learns it."""
        return ray.util.get_current_placement_group()

    def pid(self) -> int:
        """The actor's process id (a test SIGKILLs it, as a node's OOM killer would)."""
        return os.getpid()
