"""The engine-side helper process of the benchmarks.

One process per engine. It serves, side by side:

- the product: ``wsync.v1.WeightSyncService`` over gRPC for a
  :class:`~wsync_grpc.engines.tensor.TensorEngine` (what ``wsync serve
  --synthetic`` runs), built by :func:`wsync_grpc.service.server.build_server`;
- over plain HTTP/JSON (stdlib ``http.server``), what the baselines need:
  ``/init_weights_update_group`` joins a second, plain process group
  (:class:`bench.common.RawGroup`: same processes, same backend);
  ``/raw/arm`` + ``/raw/wait`` receive one raw broadcast into a reused,
  pre-touched buffer (the ceiling); ``/update_weights_from_distributed`` is the
  naive way (see :mod:`bench.naive`); ``/validate_json`` checks metadata sent
  as one JSON body (the control-plane comparison); ``/mem`` and
  ``/mem/reset`` read and reset this process's peak resident memory.

Run as ``python -m bench.engine --model 1gb --info-file F``; it writes
``{"grpc": "host:port", "http": "host:port", "pid": N}`` to ``F`` once serving,
and exits on SIGTERM (or when its parent dies).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from bench import naive
from bench.common import RawGroup, build_flat, die_with_parent, proc_memory, reset_peak_memory
from wsync_grpc.core.dtypes import can_convert, parse_dtype
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.server import WsyncServer, build_server

log = logging.getLogger("bench.engine")


class SpecEngine(TensorEngine):
    """A :class:`TensorEngine` over ``meta`` tensors: it validates metadata but holds no weights.

    Its worker is on CPU (gloo), so it can join a group and arm receivers;
    loading anything fails. Used only to time Prepare for models far larger
    than this machine's memory (a 32B dense model, a 100k-tensor MoE).
    """

    def worker_devices(self) -> Sequence[torch.device]:
        """One CPU worker."""
        return [torch.device("cpu")]

    def load_weights(self, worker: int, tensors: Any) -> int:
        """Refuse: there are no weights to load into."""
        raise RuntimeError("a spec-only engine holds no weights")


class _State:
    """Everything the HTTP handlers share."""

    def __init__(self, engine: TensorEngine, flat: torch.Tensor | None, server: WsyncServer) -> None:
        self.engine = engine
        self.flat = flat
        self.server = server
        self.group: RawGroup | None = None
        self.raw_buf: torch.Tensor | None = None
        self.raw_work: Any = None
        self.raw_times: dict[str, float] = {}
        # Updates run one at a time on one long-lived thread, as in an engine's scheduler loop
        # (not on the HTTP server's per-request threads).
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="naive-update")

    # ------------------------------------------------------------ handlers

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.group = RawGroup(
            master_address=body["master_address"],
            master_port=int(body["master_port"]),
            rank=int(body["rank_offset"]),
            world_size=int(body["world_size"]),
            device=self.engine.worker_devices()[0],
            group_name=body.get("group_name", "bench_baseline"),
            timeout_s=float(body.get("timeout_s", 120.0)),
        )
        return {"rank": int(body["rank_offset"])}

    def raw_arm(self, body: dict[str, Any]) -> dict[str, Any]:
        """Post one raw receive of ``nbytes`` into a reused, already touched buffer."""
        assert self.group is not None, "init_weights_update_group first"
        n = int(body["nbytes"])
        if self.flat is not None and self.flat.numel() >= n:
            buf = self.flat[:n]  # the model's own memory: touched, and reused by every run
        else:
            if self.raw_buf is None or self.raw_buf.numel() < n:
                # zeros: touched before the first run
                self.raw_buf = torch.zeros(n, dtype=torch.uint8, device=self.engine.worker_devices()[0])
            buf = self.raw_buf[:n]
        times: dict[str, float] = {}
        work = self.group.broadcast(buf)
        times["armed_at"] = time.monotonic()
        work.get_future().add_done_callback(lambda _f: times.setdefault("done_at", time.monotonic()))
        self.raw_work, self.raw_times = work, times
        return {"armed_at": times["armed_at"]}

    def raw_wait(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None and self.raw_work is not None, "raw/arm first"
        self.raw_work.wait()
        self.raw_times.setdefault("done_at", time.monotonic())
        self.raw_work = None
        return dict(self.raw_times)

    def naive_update(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None, "init_weights_update_group first"
        group = self.group
        n = self.worker.submit(
            naive.receive_and_load, self.engine, group, body["names"], body["dtypes"], body["shapes"]
        ).result()
        return {"success": True, "loaded": n}

    def validate_json(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate names, dtypes and shapes against the model (what Prepare checks, without byte offsets)."""
        specs = self.engine.parameter_specs()
        aliases = self.engine.aliases()
        seen: set[str] = set()
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            canonical = aliases.get(name, name)
            spec = specs.get(canonical)
            if spec is None:
                raise ValueError(f"unknown tensor {name!r}")
            if canonical in seen:
                raise ValueError(f"duplicate tensor {name!r}")
            seen.add(canonical)
            if not can_convert(parse_dtype(dtype), spec.dtype):
                raise ValueError(f"dtype mismatch for {name!r}")
            if tuple(shape) != spec.shape:
                raise ValueError(f"shape mismatch for {name!r}")
        return {"success": True, "tensors": len(seen)}

    def _cuda(self) -> torch.device | None:
        device = self.engine.worker_devices()[0]
        return device if device.type == "cuda" else None

    def mem(self, body: dict[str, Any]) -> dict[str, Any]:
        """Current and peak memory in bytes: resident memory on CPU, torch's allocated memory on CUDA."""
        cuda = self._cuda()
        if cuda is not None:
            return {"rss": torch.cuda.memory_allocated(cuda), "hwm": torch.cuda.max_memory_allocated(cuda)}
        rss, hwm = proc_memory()
        return {"rss": rss, "hwm": hwm}

    def mem_reset(self, body: dict[str, Any]) -> dict[str, Any]:
        """Reset VmHWM to the current RSS; ``drop_pool`` first empties the servicer's receive-buffer pools."""
        dropped = 0
        if body.get("drop_pool"):
            # Benchmark-only reach-ins (private attributes), to measure a "first sync" without
            # restarting the engine: empty the servicer's buffer pools, and forget the group's
            # completed collectives, whose Work objects still reference the last receive buffers
            # until the group's next broadcast prunes them.
            state = self.server.servicer.controller.state
            for pool in state.pools:
                dropped += pool.free_bytes
                keep, pool.keep = pool.keep, False
                pool.trim()
                pool.keep = keep
            for group in state.membership.groups:
                with group._lock:
                    group._pending = [w for w in group._pending if not w.is_completed()]
        gc.collect()
        cuda = self._cuda()
        if cuda is not None:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(cuda)
            return {"rss": torch.cuda.memory_allocated(cuda), "dropped": dropped}
        return {"rss": reset_peak_memory(), "dropped": dropped}


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "/init_weights_update_group": state.init_group,
        "/raw/arm": state.raw_arm,
        "/raw/wait": state.raw_wait,
        "/update_weights_from_distributed": state.naive_update,
        "/validate_json": state.validate_json,
        "/mem": state.mem,
        "/mem/reset": state.mem_reset,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self._reply(404, {"error": f"no route {self.path}"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                self._reply(200, route(body))
            except Exception as e:
                log.exception("%s failed", self.path)
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

        def _reply(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine")
    p.add_argument("--model", required=True, help="synthetic preset or bench.common.SPEC_MODELS name")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--meta", action="store_true", help="shapes only (spec-only engine, no weights)")
    p.add_argument("--device", default="cpu", help="where the weights live (cpu, or cuda:N for NCCL)")
    p.add_argument("--info-file", type=Path, required=True)
    p.add_argument("--checkpoint-root", action="append", default=[], help="where disk updates may read (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    dtype = getattr(torch, args.dtype)
    model = build_flat(args.model, dtype, args.seed, meta=args.meta, device=args.device)
    aliases = synthetic.aliases(synthetic.PRESETS[args.model]) if args.model in synthetic.PRESETS else {}
    engine: TensorEngine
    if args.meta:
        engine = SpecEngine(model.tensors, aliases=aliases, name=f"spec-{args.model}")
    else:
        engine = TensorEngine(model.tensors, aliases=aliases, name=f"synthetic-{args.model}")
    srv = build_server(engine, host="127.0.0.1", port=0, checkpoint_roots=args.checkpoint_root)
    state = _State(engine, model.flat, srv)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    info = {"grpc": srv.address, "http": f"127.0.0.1:{httpd.server_address[1]}", "pid": os.getpid()}
    tmp = args.info_file.with_name(args.info_file.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(args.info_file)
    stop.wait()
    httpd.shutdown()
    srv.stop(0.5)
    # Skip interpreter finalization: left process groups may still have collectives posted.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
