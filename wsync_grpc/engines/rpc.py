"""The front half of an engine whose weights live in worker processes: every call to its workers, over one ``call_all``.

An engine whose workers are other processes (vLLM's; SGLang's next) reaches
them through its own IPC, which runs one method on every worker and returns
each worker's result (vLLM's ``collective_rpc``). :class:`RpcWorkers` is
everything the servicer asks of those workers
(:class:`~wsync_grpc.core.engine.RemoteWorkers`, and the served tensors'
checksums and values, :class:`~wsync_grpc.core.engine.ServedChecksums`) written
once over one such call, :class:`CallAll`: the join and its poll loop, leave,
arm, declare, progress, apply, an adapter's tensors, the served tensors, each
encoded and decoded here with :mod:`wsync_grpc.core.messages`. An engine
supplies its ``call_all`` and its glue (pause, resume, cache flush, version,
parameter specs).

Each worker process answers through one dispatch table,
:mod:`wsync_grpc.engines.worker_calls`, keyed by the same :class:`WorkerCall`
names, so that the two halves cannot drift; an engine whose IPC calls methods
by name gives its workers one method, :data:`RPC_ENTRY`, that hands every call
to that table.

Runs in the front process: imports nothing of the worker side (no group, no
receiver, no worker host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.core.engine import ParamSpec, ReceiverProgress
from wsync_grpc.core.errors import GroupError, GroupTimeout
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.messages import buckets_to_msg, digests_to_msg, plan_to_msg, progress_from_msg, tensor_from_msg
from wsync_grpc.core.timeouts import DEFAULT_RPC_TIMEOUT_S, JOIN_OVERRUN_S
from wsync_grpc.core.update import ReceivePlan

JOIN_POLL_S = 0.05
"""How often the front asks the workers whether their join ended, in seconds."""

RPC_ENTRY = "wsync_call"
"""The one worker method an engine's IPC calls by name (vLLM's ``collective_rpc``): its arguments are a
:class:`WorkerCall`'s value and that call's arguments (see :func:`wsync_grpc.engines.worker_calls.dispatch`)."""


class WorkerCall(str, enum.Enum):
    """The calls a front makes to every worker, by name: the one list the front and the workers' table read.

    Each value is what travels (a plain string); the arguments and results of
    each are msgpack-native (:mod:`wsync_grpc.core.messages`), as documented on
    the table's handler (:data:`wsync_grpc.engines.worker_calls.WORKER_CALLS`).
    """

    JOIN_BEGIN = "join_begin"
    """Start joining the group on a thread of the worker's own (:func:`group_params_to_msg`)."""
    JOIN_OUTCOME = "join_outcome"
    """``None`` while the join runs, then ``{"rank": int, "error": str}``."""
    LEAVE = "leave"
    """Abandon any update in flight and leave the group."""
    ARM = "arm"
    """Start receiving a :func:`~wsync_grpc.core.messages.plan_to_msg` plan; the worker's progress."""
    DECLARE = "declare"
    """Further buckets, whether the declarations ended, late digests."""
    PROGRESS = "progress"
    """The worker's :func:`~wsync_grpc.core.messages.progress_to_msg` progress."""
    APPLY = "apply"
    """Apply the received update between two steps; the tensors loaded."""
    TAKE_ADAPTER = "take_adapter"
    """An adapter update's tensors from global rank 0, none from the others; the update ends."""
    SERVED = "served"
    """The served tensors in checkpoint coordinates (:class:`RpcWorkers` reads the entries)."""
    SET_BACKGROUND_CPUS = "set_background_cpus"
    """Where each worker's weight-sync threads run, by ``str(global rank)``."""


class CallAll(Protocol):
    """One call to every worker of an engine, through its own IPC (vLLM's ``collective_rpc``)."""

    def __call__(
        self, method: WorkerCall, *args: Any, timeout_s: float, publish_version: str | None = None
    ) -> list[Any]:
        """Run ``method`` with msgpack-native ``args`` on every worker, between two of its steps.

        Args:
            method: the call; it travels as its value, ``method.value``.
            args: the call's arguments (each msgpack-native).
            timeout_s: the workers' bound, in seconds; the caller waits a margin longer before giving up.
            publish_version: a weight version the engine publishes together with this call, so that no
                step runs between the two (the apply); ``None`` to publish nothing.

        Returns:
            Each worker's result, in worker (global rank) order.

        Raises:
            Exception: a worker's call raised, or the call did not end in time.
        """
        ...


def group_params_to_msg(params: GroupParams) -> dict[str, Any]:
    """The group a worker joins as a msgpack-native dict of :class:`~wsync_grpc.core.membership.GroupParams`'s
    fields (inverse: :func:`group_params_from_msg`)."""
    return dataclasses.asdict(params)


def group_params_from_msg(m: Mapping[str, Any]) -> GroupParams:
    """The group :func:`group_params_to_msg` wrote.

    Raises:
        TypeError: not such a message (a field missing or unknown).
    """
    return GroupParams(**m)


class RpcWorkers:
    """An engine's worker processes, as the servicer drives them: every call over one ``call_all``.

    Implements :class:`~wsync_grpc.core.engine.RemoteWorkers` and
    :class:`~wsync_grpc.core.engine.ServedChecksums` (with
    :meth:`~wsync_grpc.core.engine.Engine.get_weight`,
    :meth:`~wsync_grpc.core.engine.Engine.parameter_specs` and
    :meth:`~wsync_grpc.core.engine.Engine.aliases`); an engine composes it, by
    delegation or as its base class, and adds its glue. Thread-safe as far as
    ``call_all`` is: it keeps no state of its own between calls.

    Args:
        call_all: one call to every worker (:class:`CallAll`).
        specs: the checkpoint's tensors the workers serve, canonical name -> spec (full shapes).
        aliases: alias -> canonical name for tied tensors (e.g. ``lm_head.weight`` -> the embeddings).
    """

    def __init__(self, call_all: CallAll, specs: Mapping[str, ParamSpec], aliases: Mapping[str, str]) -> None:
        self._call_all = call_all
        self._served_specs = specs
        self._served_aliases = aliases

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """The checkpoint's tensors, canonical name -> spec (full shapes, the served dtype), as given."""
        return self._served_specs

    def aliases(self) -> Mapping[str, str]:
        """Alias -> canonical name for tied tensors, as given; empty for none."""
        return self._served_aliases

    # ------------------------------------------------------------ the group

    def join_workers(self, params: GroupParams) -> None:
        """Every worker joins at ``params.rank_offset`` + its global rank, on a thread of its own: steps run on.

        The front starts the joins (one call) and asks how they stand every
        :data:`JOIN_POLL_S` seconds (each a short call between two steps), for at most
        ``params.timeout_s`` + :data:`~wsync_grpc.core.timeouts.JOIN_OVERRUN_S` seconds.

        Raises:
            GroupTimeout, GroupError: the group did not form; every worker left.
        """
        deadline = time.monotonic() + params.timeout_s + JOIN_OVERRUN_S
        try:
            self._call_all(WorkerCall.JOIN_BEGIN, group_params_to_msg(params), timeout_s=DEFAULT_RPC_TIMEOUT_S)
            while True:
                outcomes = self._call_all(WorkerCall.JOIN_OUTCOME, timeout_s=DEFAULT_RPC_TIMEOUT_S)
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
                self.leave_workers()
            msg = str(e)
            if "did not form" in msg or "timed out" in msg.lower() or isinstance(e, TimeoutError):
                raise GroupTimeout(msg or f"the group did not form within {params.timeout_s:g} s") from e
            raise GroupError(msg) from e

    def leave_workers(self) -> None:
        """Every worker abandons its update and leaves the group (a join in flight leaves once it ends)."""
        self._call_all(WorkerCall.LEAVE, timeout_s=DEFAULT_RPC_TIMEOUT_S)

    # ------------------------------------------------------------ an update

    def arm_workers(self, plan: ReceivePlan) -> None:
        """Every worker starts its background receive (a disk update's: its read); returns once each is armed.

        Raises:
            Exception: a worker could not arm (not a member, an update in flight, not within
                ``plan.timeout_s`` seconds).
        """
        self._call_all(WorkerCall.ARM, plan_to_msg(plan), timeout_s=DEFAULT_RPC_TIMEOUT_S)

    def declare_to_workers(
        self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None
    ) -> None:
        """Feed further buckets and late digests (bucket index -> digest) to every worker (``closed``: the
        declarations ended)."""
        args = (buckets_to_msg(buckets), closed, digests_to_msg(digests or {}))
        self._call_all(WorkerCall.DECLARE, *args, timeout_s=DEFAULT_RPC_TIMEOUT_S)

    def worker_progress(self) -> list[ReceiverProgress]:
        """Each worker's receive progress, in worker order."""
        return [progress_from_msg(m) for m in self._call_all(WorkerCall.PROGRESS, timeout_s=DEFAULT_RPC_TIMEOUT_S)]

    def apply_on_workers(self, timeout_s: float, weight_version: str) -> int:
        """Every worker applies between two steps, and the engine publishes ``weight_version`` with it
        (``call_all``'s ``publish_version``); the tensors worker 0 loaded.

        Raises:
            Exception: a worker's apply failed or did not end within ``timeout_s`` seconds (its weights may
                be half applied).
        """
        applied = self._call_all(WorkerCall.APPLY, timeout_s, timeout_s=timeout_s, publish_version=weight_version)
        return int(applied[0])

    def adapter_from_workers(self, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """An adapter update's tensors (CPU, PEFT names), from the first worker that received them (every worker
        then drops its own).

        Raises:
            RuntimeError: a worker's receive failed or did not end within ``timeout_s`` seconds.
        """
        per_worker = self._call_all(WorkerCall.TAKE_ADAPTER, timeout_s, timeout_s=timeout_s)
        first: list[dict[str, Any]] = next((msgs for msgs in per_worker if msgs), [])
        return [(str(m["name"]), tensor_from_msg(m)) for m in first]

    # ------------------------------------------------------ served tensors

    def get_weight(self, name: str) -> torch.Tensor:
        """The served tensor ``name`` (canonical or alias) in checkpoint coordinates, gathered from every worker.

        Returns:
            A CPU tensor of the checkpoint's full shape and the served dtype.

        Raises:
            KeyError: unknown name.
        """
        canonical = self._served_aliases.get(name, name)
        if canonical not in self._served_specs:
            raise KeyError(name)
        per_worker = self._call_all(WorkerCall.SERVED, [canonical], True, timeout_s=DEFAULT_RPC_TIMEOUT_S)
        return self._gather(canonical, per_worker)

    def weight_checksums(self, names: Sequence[str]) -> list[tuple[str, torch.dtype, tuple[int, ...], str]]:
        """SHA-256 of each served tensor in checkpoint coordinates, every worker read between two steps.

        A tied tensor (the embeddings, also served by the LM head's own
        kernel on CPU) is read wherever it is served: the digest is of the
        bytes every copy holds, or, where the copies differ, the SHA-256 of
        their digests joined by commas in name order, which no tensor's
        bytes produce (so a stale copy never passes for the update).

        Returns:
            ``(name as asked, served dtype, full shape, hex SHA-256 of its C-contiguous bytes)`` per name.

        Raises:
            KeyError: unknown name, or one no worker serves.
            RuntimeError: no worker reported a digest of a served copy.
        """
        aliases, specs = self._served_aliases, self._served_specs
        canonical = [aliases.get(n, n) for n in names]
        for n, c in zip(names, canonical, strict=True):
            if c not in specs:
                raise KeyError(n)
        copies = {c: sorted([c, *(a for a, t in aliases.items() if t == c)]) for c in set(canonical)}
        wanted = sorted({x for c in copies.values() for x in c})
        per_worker = self._call_all(WorkerCall.SERVED, wanted, False, timeout_s=DEFAULT_RPC_TIMEOUT_S)
        served = {e["name"] for w in per_worker for e in w}
        out = []
        for n, c in zip(names, canonical, strict=True):
            if c not in served:
                raise KeyError(n)
            digests = [self._digest(x, per_worker) for x in copies[c] if x in served]
            dtype, shape = digests[0][0], tuple(specs[c].shape)
            shas = [d[1] for d in digests]
            sha = shas[0] if len(set(shas)) == 1 else hashlib.sha256(",".join(shas).encode()).hexdigest()
            out.append((n, dtype, shape, sha))
        return out

    @staticmethod
    def _digest(name: str, per_worker: list[list[dict[str, Any]]]) -> tuple[torch.dtype, str]:
        """``(dtype, SHA-256)`` of served tensor ``name`` from ``per_worker``'s :attr:`WorkerCall.SERVED` answers.

        The workers hash every tensor whole (a sharded one on the first tensor-parallel rank), so one
        answer carries its digest.

        Raises:
            RuntimeError: no worker reported a digest of ``name``.
        """
        whole = next((e for w in per_worker for e in w if e["name"] == name and e.get("shard") is None), None)
        if whole is None:
            raise RuntimeError(f"no worker reported a digest of {name}")
        return parse_dtype(whole["dtype"]), str(whole["sha256"])

    @staticmethod
    def _gather(name: str, per_worker: list[list[dict[str, Any]]]) -> torch.Tensor:
        """Tensor ``name`` from its slices (or its whole copy) in ``per_worker``'s :attr:`WorkerCall.SERVED`
        answers, slices joined along their ``shard`` dimension in rank order."""
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
