"""The servicer's engine over a running vLLM engine, in vLLM's front (API server) process.

:class:`VllmEngine` implements :class:`~wsync_grpc.core.engine.Engine`
with vLLM's own engine client (``AsyncLLM``): pause and resume are
``pause_generation(mode=abort|wait|keep)`` / ``resume_generation``, the cache
flush is ``reset_prefix_cache``, the weight version is the engine core's
(``update_weight_version``, the one vLLM stamps on generation outputs). Its
workers are vLLM's worker processes
(:class:`~wsync_grpc.core.engine.RemoteWorkers`): every call to them is
one ``collective_rpc`` to the methods of
:class:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension`, which vLLM runs
between two inference steps. The engine client lives on the server's
asyncio loop; the servicer's threads reach it through
``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.core.engine import ParamSpec, PauseMode, PauseOutcome, ReceiverProgress
from wsync_grpc.core.errors import GroupError, GroupTimeout
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.lora import AdapterState, LinearShape, LoraSpec
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.messages import buckets_to_msg, digests_to_msg, plan_to_msg, progress_from_msg, tensor_from_msg
from wsync_grpc.core.timeouts import DEFAULT_RPC_TIMEOUT_S, JOIN_OVERRUN_S
from wsync_grpc.core.update import ReceivePlan
from wsync_grpc.engines.vllm.checkpoint import checkpoint_specs, fused_groups, tied_aliases
from wsync_grpc.engines.vllm.lora import VllmLoras, lora_linears

T = TypeVar("T")

RPC_MARGIN_S = 10.0
"""Added to a worker call's own bound before the front gives up on it, in seconds."""

JOIN_POLL_S = 0.05
"""How often the front asks the workers whether their join ended, in seconds."""


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


class VllmEngine:
    """A vLLM engine, as the wsync servicer sees it.

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
        self._specs = checkpoint_specs(Path(mc.model), mc.dtype)
        self._aliases = tied_aliases(self._specs, bool(getattr(mc.hf_config, "tie_word_embeddings", False)))
        self._fused = fused_groups(list(self._specs), workers[0].get("packed", {}) if workers else {})
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
            await client.collective_rpc("wsync_set_background_cpus", args=(background,))
        return cls(client, asyncio.get_running_loop(), sorted(workers, key=lambda w: int(w["global_rank"])))

    # ------------------------------------------------------------ LoRA adapters

    def lora_linears(self) -> Mapping[str, LinearShape]:
        """The checkpoint's linear layers an adapter may target; empty unless vLLM serves LoRA (``--enable-lora``)."""
        return lora_linears(self._specs) if self.loras.enabled else {}

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

    def _rpc(self, method: str, *args: Any, timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> list[Any]:
        """Call ``method`` of every worker between two steps; each worker's result, in worker order."""
        results: list[Any] = self._call(
            self.client.collective_rpc(method, timeout=timeout_s, args=args), timeout_s + RPC_MARGIN_S
        )
        return results

    # ---------------------------------------------------------- the model

    @property
    def name(self) -> str:
        """The served model's name (``--served-model-name``, else its path)."""
        return self._name

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """The checkpoint's tensors, in checkpoint names, full shapes and the served dtype."""
        return self._specs

    def aliases(self) -> Mapping[str, str]:
        """``lm_head.weight`` -> ``model.embed_tokens.weight`` for tied embeddings; else empty."""
        return self._aliases

    def fused_groups(self) -> Sequence[tuple[str, ...]]:
        """Checkpoint names vLLM serves fused (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``)."""
        return self._fused

    def worker_devices(self) -> Sequence[torch.device]:
        """Each vLLM worker's device, in global rank order."""
        return self._devices

    def weights_lock(self) -> contextlib.AbstractContextManager[object]:
        """Orders the servicer's weight changes; the workers apply between two steps on their own."""
        return self._lock

    def get_weight(self, name: str) -> torch.Tensor:
        """The served tensor ``name`` in checkpoint coordinates, gathered from every worker.

        Raises:
            KeyError: unknown name.
        """
        canonical = self._aliases.get(name, name)
        if canonical not in self._specs:
            raise KeyError(name)
        return self._gather(canonical, self._rpc("wsync_served", [canonical], True))

    def weight_checksums(self, names: Sequence[str]) -> list[tuple[str, torch.dtype, tuple[int, ...], str]]:
        """SHA-256 of each served tensor in checkpoint coordinates, every worker read between two steps.

        A tied tensor (the embeddings, also served by the LM head's own
        kernel on CPU) is read wherever it is served: the digest is of the
        bytes every copy holds, or, where the copies differ, the SHA-256 of
        their digests joined by commas in name order, which no tensor's
        bytes produce (so a stale copy never passes for the update).

        Raises:
            KeyError: unknown name.
        """
        canonical = [self._aliases.get(n, n) for n in names]
        for n, c in zip(names, canonical, strict=True):
            if c not in self._specs:
                raise KeyError(n)
        copies = {c: sorted([c, *(a for a, t in self._aliases.items() if t == c)]) for c in set(canonical)}
        per_worker = self._rpc("wsync_served", sorted({x for c in copies.values() for x in c}))
        served = {e["name"] for w in per_worker for e in w}
        out = []
        for n, c in zip(names, canonical, strict=True):
            if c not in served:
                raise KeyError(n)
            digests = [self._digest(x, per_worker) for x in copies[c] if x in served]
            dtype, shape = digests[0][0], tuple(self._specs[c].shape)
            shas = [d[1] for d in digests]
            sha = shas[0] if len(set(shas)) == 1 else hashlib.sha256(",".join(shas).encode()).hexdigest()
            out.append((n, dtype, shape, sha))
        return out

    def _digest(self, name: str, per_worker: list[list[dict[str, Any]]]) -> tuple[torch.dtype, str]:
        """``(dtype, SHA-256)`` of served tensor ``name`` from ``per_worker``'s ``wsync_served`` answers.

        The workers hash every tensor whole (a sharded one on the first tensor-parallel rank), so one
        answer carries its digest.

        Raises:
            RuntimeError: no worker reported a digest of ``name``.
        """
        whole = next((e for w in per_worker for e in w if e["name"] == name and e.get("shard") is None), None)
        if whole is None:
            raise RuntimeError(f"no vLLM worker reported a digest of {name}")
        return parse_dtype(whole["dtype"]), str(whole["sha256"])

    def _gather(self, name: str, per_worker: list[list[dict[str, Any]]]) -> torch.Tensor:
        """Tensor ``name`` from its slices (or its whole copy) in ``per_worker``'s ``wsync_served`` answers."""
        slices: dict[int, torch.Tensor] = {}
        dim = 0
        for w in per_worker:
            for e in w:
                if e["name"] != name:
                    continue
                t = tensor_from_msg(e)
                if e.get("shard") is None:
                    return t
                dim, rank, _ = e["shard"]
                slices.setdefault(int(rank), t)
        return torch.cat([slices[r] for r in sorted(slices)], dim=dim).contiguous()

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

    # ------------------------------------------------------------- workers

    def join_workers(self, params: GroupParams) -> None:
        """Every worker joins at ``rank_offset`` + its global rank, on a thread of its own: vLLM's steps run on.

        The front starts the joins (one ``collective_rpc``) and asks how they stand every
        :data:`JOIN_POLL_S` seconds (each a short ``collective_rpc`` between two steps), for at most
        ``params.timeout_s`` + :data:`~wsync_grpc.core.timeouts.JOIN_OVERRUN_S` seconds.

        Raises:
            GroupTimeout, GroupError: the group did not form; every worker left.
        """
        info = {
            "master_address": params.master_address,
            "master_port": params.master_port,
            "rank_offset": params.rank_offset,
            "world_size": params.world_size,
            "group_name": params.group_name,
            "backend": params.backend,
            "timeout_s": params.timeout_s,
            "trainer_ranks": params.trainer_ranks,
        }
        deadline = time.monotonic() + params.timeout_s + JOIN_OVERRUN_S
        try:
            self._rpc("wsync_join_begin", info)
            while True:
                outcomes = self._rpc("wsync_join_outcome")
                errors = [str(o["error"]) for o in outcomes if o is not None and o["error"]]
                if errors:
                    raise GroupError(errors[0])
                if all(o is not None for o in outcomes):
                    return
                if time.monotonic() > deadline:
                    raise GroupTimeout(f"the group did not form within {params.timeout_s:g} s")
                time.sleep(JOIN_POLL_S)
        except Exception as e:
            with contextlib.suppress(Exception):
                self._rpc("wsync_leave")
            msg = str(e)
            if "did not form" in msg or "timed out" in msg.lower() or isinstance(e, TimeoutError):
                raise GroupTimeout(msg or f"the group did not form within {params.timeout_s:g} s") from e
            raise GroupError(msg) from e

    def leave_workers(self) -> None:
        """Every worker abandons its update and leaves the group."""
        self._rpc("wsync_leave")

    def arm_workers(self, plan: ReceivePlan) -> None:
        """Every worker starts its background receive (a disk update's: its read); returns once each is armed."""
        self._rpc("wsync_arm", plan_to_msg(plan))

    def adapter_from_workers(self, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """An adapter update's tensors, from the first worker that received them (every worker then drops its own).

        Raises:
            RuntimeError: a worker's receive failed or did not end within ``timeout_s`` seconds.
        """
        per_worker = self._rpc("wsync_take_adapter", timeout_s, timeout_s=timeout_s)
        first: list[dict[str, Any]] = next((msgs for msgs in per_worker if msgs), [])
        return [(str(m["name"]), tensor_from_msg(m)) for m in first]

    def declare_to_workers(
        self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None
    ) -> None:
        """Feed further buckets and late digests to every worker (``closed``: the declarations ended)."""
        self._rpc("wsync_declare", buckets_to_msg(buckets), closed, digests_to_msg(digests or {}))

    def worker_progress(self) -> list[ReceiverProgress]:
        """Each worker's receive progress."""
        return [progress_from_msg(m) for m in self._rpc("wsync_progress")]

    def apply_on_workers(self, timeout_s: float, weight_version: str) -> int:
        """Every worker applies between two steps, and the engine publishes ``weight_version`` with it.

        Both calls are queued together, so the engine core runs them one after
        the other before its next step.
        """

        async def both() -> list[Any]:
            apply = self.client.collective_rpc("wsync_apply", timeout=timeout_s, args=(timeout_s,))
            publish = self.client.update_weight_version(weight_version)
            applied, _ = await asyncio.gather(apply, publish)
            return list(applied)

        try:
            applied = self._call(both(), timeout_s + RPC_MARGIN_S)
        except BaseException:
            # The version went out with a failed apply: the engine is dirty now and says so.
            self._version = ""
            raise
        self._version = weight_version
        return int(applied[0])
