"""The servicer's engine over a running vLLM engine, in vLLM's front (API server) process.

:class:`VllmEngine` implements :class:`~wsync_grpc.core.engine.Engine`
with vLLM's own engine client (``AsyncLLM``): pause and resume are
``pause_generation(mode=abort|wait|keep)`` / ``resume_generation``, the cache
flush is ``reset_prefix_cache``, the weight version is the engine core's
(``update_weight_version``, the one vLLM stamps on generation outputs). Its
workers are vLLM's worker processes
(:class:`~wsync_grpc.core.engine.RemoteWorkers`), driven by the engine-agnostic
:class:`~wsync_grpc.engines.rpc.RpcWorkers` over :meth:`VllmEngine.call_all`:
one ``collective_rpc`` to
:meth:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension.wsync_call`, which
vLLM runs between two inference steps. The engine client lives on the server's
asyncio loop; the servicer's threads reach it through
``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from wsync_grpc.core.engine import PauseMode, PauseOutcome
from wsync_grpc.core.lora import AdapterState, LinearShape, LoraSpec
from wsync_grpc.core.timeouts import DEFAULT_RPC_TIMEOUT_S
from wsync_grpc.engines.rpc import RPC_ENTRY, RpcWorkers, WorkerCall
from wsync_grpc.engines.vllm.checkpoint import checkpoint_specs, fused_groups, tied_aliases
from wsync_grpc.engines.vllm.lora import VllmLoras, lora_linears

T = TypeVar("T")

RPC_MARGIN_S = 10.0
"""Added to a worker call's own bound before the front gives up on it, in seconds."""


def worker_call(client: Any, method: WorkerCall, *args: Any, timeout_s: float | None = None) -> Any:
    """The coroutine of one ``collective_rpc`` running ``method`` on every vLLM worker (through
    :data:`~wsync_grpc.engines.rpc.RPC_ENTRY`); awaited, each worker's result in worker order.

    Args:
        client: vLLM's engine client.
        method: the call; it travels as its value.
        args: its msgpack-native arguments.
        timeout_s: vLLM's bound on the call, in seconds; ``None`` for none.
    """
    return client.collective_rpc(RPC_ENTRY, timeout=timeout_s, args=(method.value, *args))


def background_cpus(workers: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Where each worker's weight-sync threads run: its host's CPUs that no worker's forward is bound to.

    On a CPU backend vLLM binds each worker's OpenMP threads, its main thread
    among them, to cores of their own and leaves the rest (at least one per
    worker) to its other processes (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``).
    A weight-sync thread started from the main thread would run on the
    forward's cores and take them from generation for the whole receive and
    preparation; on the cores left it does not. Workers not bound narrower
    than their engine process (GPU workers, ``nobind``) are left where they run.

    Args:
        workers: each worker's :meth:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension.wsync_describe`.

    Returns:
        ``str(global rank)`` -> sorted CPU ids, for each bound worker with CPUs left; the others absent.
    """
    pinned = []  # (global rank, host, the CPUs of its engine process) of every bound worker
    bound: dict[str, set[int]] = {}  # host -> the CPUs of every bound worker's forward there
    for w in workers:
        cpus, host_cpus, host = set(w.get("cpus", [])), set(w.get("host_cpus", [])), str(w.get("host", ""))
        if cpus and cpus < host_cpus:
            pinned.append((str(w["global_rank"]), host, host_cpus))
            bound.setdefault(host, set()).update(cpus)
    left = {rank: sorted(host_cpus - bound[host]) for rank, host, host_cpus in pinned}
    return {rank: cpus for rank, cpus in left.items() if cpus}


class VllmEngine(RpcWorkers):
    """A vLLM engine, as the wsync servicer sees it.

    Its workers (:class:`~wsync_grpc.core.engine.RemoteWorkers`, checksums and
    served tensors) are :class:`~wsync_grpc.engines.rpc.RpcWorkers` over
    :meth:`call_all`; the rest is vLLM's glue.

    Args:
        client: vLLM's engine client (``vllm.v1.engine.async_llm.AsyncLLM``),
            started with the ``wsync`` weight-transfer backend and worker extension.
        loop: the asyncio loop the client runs on.
        workers: each worker's :meth:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension.wsync_describe`,
            in global rank order (see :meth:`create`).
    """

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop, workers: Sequence[Mapping[str, Any]]) -> None:
        self.client = client
        self.loop = loop
        mc = client.model_config
        self._name = str(mc.served_model_name or mc.model)
        specs = checkpoint_specs(Path(mc.model), mc.dtype)
        aliases = tied_aliases(specs, bool(getattr(mc.hf_config, "tie_word_embeddings", False)))
        super().__init__(self.call_all, specs, aliases)
        self._fused = fused_groups(list(specs), workers[0].get("packed", {}) if workers else {})
        self._devices = [torch.device(str(w["device"])) for w in workers]
        self._lock = threading.RLock()
        self._mode: PauseMode | None = None
        self._frozen = 0
        self._version = ""
        self.loras = VllmLoras(client, str(mc.model))
        """Its LoRA adapters (``wsync serve`` hands them vLLM's OpenAI serving models)."""

    @classmethod
    async def create(cls, client: Any) -> VllmEngine:
        """Ask the workers what they are and build the engine (call on the client's loop).

        Raises:
            RuntimeError: the engine was not started with the wsync backend and worker extension.
        """
        workers = await client.collective_rpc("wsync_describe")
        background = background_cpus(workers)
        if any(background.values()):
            await worker_call(client, WorkerCall.SET_BACKGROUND_CPUS, background)
        return cls(client, asyncio.get_running_loop(), sorted(workers, key=lambda w: int(w["global_rank"])))

    # ------------------------------------------------------------ LoRA adapters

    def lora_linears(self) -> Mapping[str, LinearShape]:
        """The checkpoint's linear layers an adapter may target; empty unless vLLM serves LoRA (``--enable-lora``)."""
        return lora_linears(self.parameter_specs()) if self.loras.enabled else {}

    def lora_max_rank(self) -> int:
        """vLLM's ``--max-lora-rank`` (it refuses a higher rank at load time; wsync at Prepare)."""
        return self.loras.max_rank

    def load_adapter(self, spec: LoraSpec, version: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Serve ``tensors`` as adapter ``spec`` through vLLM's own LoRA support (:class:`VllmLoras`).

        Raises:
            ValueError: vLLM refused it; the old adapter of that name keeps serving.
        """
        return self._call(self.loras.load(spec, version, tensors))

    def unload_adapter(self, name: str) -> tuple[str, int] | None:
        """Stop serving adapter ``name``; ``(its version, requests aborted)``, or ``None``."""
        return self._call(self.loras.unload(name))

    def adapters(self) -> list[AdapterState]:
        """The adapters served, by name."""
        return self.loras.adapters()

    # ------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> T:
        """Run ``coro`` on the client's loop and wait for it, at most ``timeout_s`` seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call_all(
        self, method: WorkerCall, *args: Any, timeout_s: float, publish_version: str | None = None
    ) -> list[Any]:
        """Run ``method`` on every worker between two steps (one ``collective_rpc``); each result, in worker order.

        The front waits :data:`RPC_MARGIN_S` seconds longer than vLLM's own bound. With ``publish_version``
        the call and ``update_weight_version`` are queued together, so the engine core runs them one after
        the other before its next step; on failure the version published is cleared (the engine is dirty).

        Args:
            method: the call (:class:`~wsync_grpc.engines.rpc.CallAll`).
            args: its msgpack-native arguments.
            timeout_s: vLLM's bound on the call, in seconds.
            publish_version: the weight version published with it; ``None`` for none.

        Raises:
            TimeoutError: no answer within ``timeout_s`` + :data:`RPC_MARGIN_S` seconds.
            Exception: a worker's call raised.
        """
        if publish_version is None:
            results: list[Any] = self._call(
                worker_call(self.client, method, *args, timeout_s=timeout_s), timeout_s + RPC_MARGIN_S
            )
            return results

        async def both() -> list[Any]:
            call = worker_call(self.client, method, *args, timeout_s=timeout_s)
            publish = self.client.update_weight_version(publish_version)
            answers, _ = await asyncio.gather(call, publish)
            return list(answers)

        try:
            results = self._call(both(), timeout_s + RPC_MARGIN_S)
        except BaseException:
            # The version went out with a failed call: the engine is dirty now and says so.
            self._version = ""
            raise
        self._version = publish_version
        return results

    # ---------------------------------------------------------- the model

    @property
    def name(self) -> str:
        """The served model's name (``--served-model-name``, else its path)."""
        return self._name

    def fused_groups(self) -> Sequence[tuple[str, ...]]:
        """Checkpoint names vLLM serves fused (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``)."""
        return self._fused

    def worker_devices(self) -> Sequence[torch.device]:
        """Each vLLM worker's device, in global rank order."""
        return self._devices

    def weights_lock(self) -> contextlib.AbstractContextManager[object]:
        """Orders the servicer's weight changes; the workers apply between two steps on their own."""
        return self._lock

    def set_weight_version(self, version: str) -> None:
        """Publish ``version`` as the one vLLM stamps on generation outputs (idempotent)."""
        if version != self._version:
            self._call(self.client.update_weight_version(version))
            self._version = version

    # ------------------------------------------------------ pause / resume

    def _unfinished(self) -> int:
        return int(self.client.output_processor.get_num_unfinished_requests())

    def pause(self, mode: PauseMode, timeout: float) -> PauseOutcome:
        """``pause_generation`` with ``mode``; the prefix cache is kept (a KEEP pause must not preempt).

        Raises:
            TimeoutError: WAIT did not drain within ``timeout`` seconds (the engine stays paused).
        """
        n = self._unfinished()
        coro = self.client.pause_generation(mode=mode.value, clear_cache=False)
        if mode is PauseMode.WAIT:
            try:
                self._call(asyncio.wait_for(coro, timeout), timeout + RPC_MARGIN_S)
            except (TimeoutError, asyncio.TimeoutError):
                self._mode = PauseMode.WAIT
                raise TimeoutError(f"requests in flight did not finish within {timeout:g} s") from None
        else:
            self._call(coro)
        if mode is PauseMode.KEEP:
            self._frozen = n
        self._mode = mode if self._mode is None or mode is not PauseMode.WAIT else self._mode
        return PauseOutcome(
            aborted=n if mode is PauseMode.ABORT else 0,
            drained=n if mode is PauseMode.WAIT else 0,
            frozen=n if mode is PauseMode.KEEP else 0,
        )

    def resume(self) -> int:
        """``resume_generation``; how many frozen requests continue."""
        self._call(self.client.resume_generation())
        frozen, self._frozen, self._mode = self._frozen, 0, None
        return frozen

    def is_paused(self) -> bool:
        """Whether a pause is in force."""
        return self._mode is not None

    def pause_mode(self) -> PauseMode | None:
        """The mode of the pause in force."""
        return self._mode

    def flush_cache(self) -> None:
        """``reset_prefix_cache(reset_running_requests=True)``: drop every KV block computed with the old weights.

        Running requests (frozen ones too) are preempted and recompute their
        whole context with the new weights at their next step, as vLLM's own
        ``pause_generation(clear_cache=True)`` does; without that the reset
        refuses while any request holds a block.

        Raises:
            RuntimeError: vLLM could not reset the cache (e.g. a request waits for a remote KV transfer).
        """
        if not self._call(self.client.reset_prefix_cache(reset_running_requests=True)):
            raise RuntimeError("vLLM did not reset its prefix cache")

    def request_counts(self) -> tuple[int, int]:
        """``(unfinished requests, 0)``: vLLM's front does not tell running from waiting."""
        return self._unfinished(), 0
