"""``wsync serve --engine vllm``'s server: one vLLM engine serving ``wsync.v1`` beside its OpenAI-compatible HTTP API.

This is vLLM's own API server (``vllm.entrypoints.openai.api_server``: the
same argument parser, engine client, FastAPI app and uvicorn loop), started
with the ``wsync`` weight-transfer backend and worker extension, plus the
wsync gRPC server in the same process, talking to the same engine client.
Rollout workers call the HTTP API (``/v1/completions``,
``/v1/chat/completions``, and ``/inference/v1/generate``, whose answers carry
the weight version of every token span); trainers and operators call
``wsync.v1`` on the gRPC port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsync_grpc.engines.vllm import BACKEND_NAME, WORKER_EXTENSION
from wsync_grpc.engines.vllm.front import VllmEngine
from wsync_grpc.service.server import WsyncServer, write_port_file
from wsync_grpc.tools.engines.registry import ServerOptions
from wsync_grpc.tools.orphans import end_forked_children_with_this_process, end_spawned_children_with_this_process

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmServeOptions:
    """What ``wsync serve --engine vllm`` was asked for.

    Attributes:
        model: the Hugging Face checkpoint directory vLLM loads (safetensors).
        server: the weight-sync server beside vLLM's (address, token, TLS, port file, metrics, ...).
        http_host, http_port: vLLM's HTTP API's bind address and TCP port.
        tensor_parallel_size: vLLM's ``--tensor-parallel-size``.
        vllm_args: further vLLM engine arguments, as one shell-quoted string (e.g. ``"--enforce-eager"``).
    """

    model: str
    server: ServerOptions = field(default_factory=ServerOptions)
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    tensor_parallel_size: int = 1
    vllm_args: str = ""


def vllm_argv(o: VllmServeOptions) -> list[str]:
    """The vLLM API server arguments for ``o``.

    Model, HTTP address, TP size, wsync's backend and worker extension, and
    ``--enable-scale-out`` (vLLM's ``/inference/v1/generate``), then ``o.vllm_args``.
    """
    return [
        "--model",
        o.model,
        "--host",
        o.http_host,
        "--port",
        str(o.http_port),
        "--tensor-parallel-size",
        str(o.tensor_parallel_size),
        "--weight-transfer-config",
        json.dumps({"backend": BACKEND_NAME}),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        # /inference/v1/generate: token-in/token-out generation whose answers carry
        # the weight version of every span of tokens (what RL rollouts need).
        "--enable-scale-out",
        *shlex.split(o.vllm_args),
    ]


def serve(o: VllmServeOptions) -> int:
    """Run the engine until SIGINT/SIGTERM (on the calling thread, which must be the main one); the exit code.

    vLLM's engine core and workers end with this process, even when it is SIGKILLed, on Linux
    (:mod:`wsync_grpc.tools.orphans`).

    Raises:
        SystemExit: vLLM refused its arguments.
    """
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM starts its engine core (and the engine core its workers) from the main thread, spawned (as
    # cli_env_setup sets) or forked: with a parent-death signal, they end with this process even when it is
    # SIGKILLed (wsync_grpc.tools.orphans).
    end_spawned_children_with_this_process()
    end_forked_children_with_this_process()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="wsync serve --engine vllm"))
    args = parser.parse_args(vllm_argv(o))
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    with private_rpc_dir():
        uvloop.run(_serve(o, args))
    return 0


RPC_DIR_PREFIX = "wsync-vllm-"
"""The name of :func:`private_rpc_dir`'s directory, before the server's pid and ``mkdtemp``'s suffix."""

SOCKET_NAME_BYTES = 36
"""The length of the name vLLM gives a socket file (``str(uuid.uuid4())``; ``get_open_zmq_ipc_path``)."""

SUN_PATH_BYTES = 107
"""The longest path of a Unix socket, in bytes (``sizeof(sockaddr_un.sun_path)`` less its NUL, on Linux)."""


@contextlib.contextmanager
def private_rpc_dir() -> Iterator[Path | None]:
    """A directory of this server's own for vLLM's ZeroMQ IPC sockets (``VLLM_RPC_BASE_PATH``), removed at the end.

    vLLM names a socket file ``<uuid>`` in ``VLLM_RPC_BASE_PATH`` (default: the temporary directory,
    ``tempfile.gettempdir()``) for each of its engine-core and worker queues, and leaves the files there when it
    ends, even cleanly: every engine started would leave a few in ``/tmp``. Here they go in
    ``<tmp>/wsync-vllm-<pid namespace>-<pid>-<random>`` (mode 0700, ``mkdtemp``), which the engine's processes
    inherit through the environment and which is removed once the server ends. A server that was SIGKILLed cannot
    remove its own: the next one started in the same pid namespace (a container sharing ``/tmp`` has its own)
    removes those whose pid no longer runs. Nothing is changed (and
    ``None`` yielded) where the caller's environment sets ``VLLM_RPC_BASE_PATH`` (its choice stands), or where a
    socket's path in the directory would pass the 107 bytes of a Unix socket address (``sun_path``), which vLLM's
    own paths, one directory shorter, might not.
    """
    if "VLLM_RPC_BASE_PATH" in os.environ:
        yield None
        return
    ns = _pid_namespace()
    _remove_dead_servers_dirs(Path(tempfile.gettempdir()), ns)
    path = Path(tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{ns}-{os.getpid()}-"))
    if len(os.fsencode(path)) + 1 + SOCKET_NAME_BYTES > SUN_PATH_BYTES:
        path.rmdir()
        yield None
        return
    os.environ["VLLM_RPC_BASE_PATH"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        shutil.rmtree(path, ignore_errors=True)


def _remove_dead_servers_dirs(tmp: Path, ns: int) -> None:
    """Remove the :func:`private_rpc_dir` directories in ``tmp`` of this user and of pid namespace ``ns`` (this
    process's) whose server's pid no longer runs (``psutil.pid_exists``; a zombie's directory stays)."""
    import psutil  # a dependency of vLLM's, which this server runs

    if not ns:
        return  # another namespace's pids are not seen from here: which server runs is unknown
    pattern = re.compile(rf"{re.escape(RPC_DIR_PREFIX)}{ns}-(\d+)-")
    for d in tmp.glob(f"{RPC_DIR_PREFIX}{ns}-*"):
        m = pattern.match(d.name)
        with contextlib.suppress(OSError):
            if m is None or not d.is_dir() or d.stat().st_uid != os.getuid() or psutil.pid_exists(int(m.group(1))):
                continue
            shutil.rmtree(d, ignore_errors=True)


def _pid_namespace() -> int:
    """This process's pid namespace, as the inode of ``/proc/self/ns/pid``; 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


async def _serve(o: VllmServeOptions, args: Any) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    srv: WsyncServer | None = None
    try:
        async with build_async_engine_client(args) as client:
            adapter = await VllmEngine.create(client)
            srv = o.server.start(adapter)
            specs = adapter.parameter_specs()
            log.info(
                "vLLM engine %s: %d checkpoint tensors, %d worker(s); wsync.v1 on %s, HTTP on %s",
                adapter.name,
                len(specs),
                len(adapter.worker_devices()),
                srv.address,
                listen_address,
            )
            ready = asyncio.create_task(_when_http_listens(o, srv.port))
            shutdown = await _build_and_serve(client, listen_address, sock, args, adapter)
            ready.cancel()
            # HTTP has stopped (SIGINT/SIGTERM): stop wsync before the engine goes.
            await asyncio.get_running_loop().run_in_executor(None, srv.stop, o.server.grace)
        await shutdown
    finally:
        if srv is not None:
            srv.stop(o.server.grace)
        sock.close()


async def _build_and_serve(client: Any, listen_address: str, sock: Any, args: Any, adapter: VllmEngine) -> Any:
    """vLLM's ``build_and_serve`` (its API server entry point), step by step with vLLM's own functions,
    so that the adapter gets the server's ``OpenAIServingModels``: LoRA adapters load through it and the
    OpenAI API's ``model`` field names them. Returns the shutdown task."""
    from vllm import envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    uvicorn_kwargs: dict[str, Any] = {}
    log_config = get_uvicorn_log_config(args)
    if log_config is not None:
        uvicorn_kwargs["log_config"] = log_config
    supported_tasks = await client.get_supported_tasks()
    app = build_app(args, supported_tasks, client.model_config)
    await init_app_state(client, app.state, args, supported_tasks)
    adapter.loras.serving_models = getattr(app.state, "openai_serving_models", None)
    log.info("Starting vLLM server on %s", listen_address)
    return await serve_http(
        app,
        sock=sock,
        enable_ssl_refresh=args.enable_ssl_refresh,
        peer_loads=None,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        h11_max_header_count=args.h11_max_header_count,
        **uvicorn_kwargs,
    )


async def _when_http_listens(o: VllmServeOptions, grpc_port: int) -> None:
    """Write the port file once vLLM's HTTP API accepts connections (both ports serve from then on)."""
    host = "127.0.0.1" if o.http_host in ("", "0.0.0.0") else o.http_host
    while True:
        try:
            _, writer = await asyncio.open_connection(host, o.http_port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        break
    log.info("serving: wsync.v1 on port %d, HTTP on port %d", grpc_port, o.http_port)
    if o.server.port_file is not None:
        write_port_file(o.server.port_file, grpc_port)
