"""The worker half of an engine whose weights live in worker processes: one dispatch table for every call.

The front (:class:`~wsync_grpc.engines.rpc.RpcWorkers`) calls every worker by
a :class:`~wsync_grpc.engines.rpc.WorkerCall` name with msgpack-native
arguments; in each worker process :func:`dispatch` looks the name up in
:data:`WORKER_CALLS`, decodes the arguments (:mod:`wsync_grpc.core.messages`),
calls the worker's :class:`~wsync_grpc.engines.host.WorkerHost` (or the
engine's worker glue, :class:`HostedWorker`) and encodes the result. An
engine's worker side is then one entry its IPC calls by name
(:data:`~wsync_grpc.engines.rpc.RPC_ENTRY`; vLLM's:
:meth:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension.wsync_call`) and a
:class:`HostedWorker`.

Every handler runs on the worker's main thread, between two of its steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.messages import buckets_from_msg, digests_from_msg, plan_from_msg, progress_to_msg, tensor_to_msg
from wsync_grpc.engines.host import WorkerHost
from wsync_grpc.engines.rpc import WorkerCall, group_params_from_msg


class HostedWorker(Protocol):
    """One worker process as the table reaches it: its worker host and what the engine's glue adds."""

    @property
    def host(self) -> WorkerHost:
        """This worker's host (group membership, the update in flight)."""
        ...

    def begin_join(self, params: GroupParams) -> None:
        """Start joining the group on a thread of its own and return at once (steps run on).

        Raises:
            RuntimeError: an earlier join of this worker has not ended yet.
        """
        ...

    def join_outcome(self) -> dict[str, Any] | None:
        """The last join's end, ``None`` while it runs: ``{"rank": int, "error": str}`` (``error`` empty: joined)."""
        ...

    def leave(self) -> None:
        """Abandon any update in flight and leave the group (a join in flight leaves once it ends). Idempotent."""
        ...

    def served(self, names: list[str], want_data: bool) -> list[dict[str, Any]]:
        """This worker's served tensors in checkpoint coordinates (see :func:`served`'s entries).

        Args:
            names: checkpoint names to report; empty for all.
            want_data: send each tensor's bytes (``data``) rather than only a whole one's digest.
        """
        ...


def join_begin(w: HostedWorker, params: Mapping[str, Any]) -> None:
    """Start joining the group of :func:`~wsync_grpc.engines.rpc.group_params_to_msg` ``params`` on a thread
    of its own; poll :func:`join_outcome`.

    Raises:
        TypeError: not such a message.
        RuntimeError: an earlier join of this worker has not ended yet.
    """
    w.begin_join(group_params_from_msg(params))


def join_outcome(w: HostedWorker) -> dict[str, Any] | None:
    """``None`` while the join runs, then ``{"rank": int, "error": str}`` (``error`` empty: joined)."""
    return w.join_outcome()


def leave(w: HostedWorker) -> None:
    """Abandon any update in flight and leave the group."""
    w.leave()


def arm(w: HostedWorker, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Start receiving a :func:`~wsync_grpc.core.messages.plan_to_msg` plan; this worker's progress
    (:func:`~wsync_grpc.core.messages.progress_to_msg`).

    Raises:
        RuntimeError, TimeoutError, Unimplemented: see :meth:`~wsync_grpc.engines.host.WorkerHost.arm`.
    """
    w.host.arm(plan_from_msg(plan))
    return progress_to_msg(w.host.progress())


def declare(
    w: HostedWorker, buckets: Sequence[Mapping[str, Any]], closed: bool, digests: Sequence[Sequence[Any]] | None = None
) -> None:
    """Feed further buckets of an incremental update (:func:`~wsync_grpc.core.messages.buckets_to_msg`), and
    digests declared after their buckets (:func:`~wsync_grpc.core.messages.digests_to_msg`)."""
    w.host.declare(buckets_from_msg(buckets), closed, digests_from_msg(digests or []))


def progress(w: HostedWorker) -> dict[str, Any]:
    """This worker's receive progress (:func:`~wsync_grpc.core.messages.progress_to_msg`)."""
    return progress_to_msg(w.host.progress())


def apply(w: HostedWorker, timeout_s: float) -> int:
    """Apply the received update between two steps; the number of tensors loaded.

    Raises:
        RuntimeError: no update, or its receive failed or has not ended within ``timeout_s`` seconds.
    """
    return w.host.apply(timeout_s)


def take_adapter(w: HostedWorker, timeout_s: float) -> list[dict[str, Any]]:
    """An adapter update's received tensors (:func:`~wsync_grpc.core.messages.tensor_to_msg`) from global
    rank 0, empty from the others; the update ends on every worker, the model untouched.

    Raises:
        RuntimeError: no update, or its receive failed or has not ended within ``timeout_s`` seconds.
    """
    host = w.host
    return [tensor_to_msg(n, t) for n, t in host.take(timeout_s, keep=host.global_rank == 0)]


def served(w: HostedWorker, names: Sequence[str], want_data: bool = False) -> list[dict[str, Any]]:
    """Served tensors in checkpoint coordinates: a digest where this worker holds all of one, else its slice.

    A tensor sharded across tensor-parallel ranks is gathered onto the first of them and hashed there (every
    worker must be asked for the same ``names``, as one call to every worker does); with ``want_data`` the
    slices are sent instead, for the front to join.

    Args:
        names: checkpoint names to report; empty for all.
        want_data: send the bytes of whole tensors too (``data``), and each rank's slices.

    Returns:
        One dict per tensor: ``name``, ``dtype``, ``shape`` (of what this worker holds), ``shard``
        (``[dim, rank, count]`` or ``None``), and ``sha256`` (whole tensors) or ``data`` (the bytes, C order).
    """
    return w.served(list(names), bool(want_data))


def set_background_cpus(w: HostedWorker, by_rank: Mapping[str, Sequence[int]]) -> None:
    """Run this worker's weight-sync threads on ``by_rank[str(global rank)]`` (absent or empty: where its main
    thread runs); see :func:`~wsync_grpc.engines.host.threads_started_on`."""
    host = w.host
    host.background_cpus = frozenset(int(c) for c in by_rank.get(str(host.global_rank), []))


WORKER_CALLS: Mapping[WorkerCall, Callable[..., Any]] = {
    WorkerCall.JOIN_BEGIN: join_begin,
    WorkerCall.JOIN_OUTCOME: join_outcome,
    WorkerCall.LEAVE: leave,
    WorkerCall.ARM: arm,
    WorkerCall.DECLARE: declare,
    WorkerCall.PROGRESS: progress,
    WorkerCall.APPLY: apply,
    WorkerCall.TAKE_ADAPTER: take_adapter,
    WorkerCall.SERVED: served,
    WorkerCall.SET_BACKGROUND_CPUS: set_background_cpus,
}
"""Each call the front makes -> its handler ``(worker, *msgpack-native args) -> msgpack-native result``."""

if set(WORKER_CALLS) != set(WorkerCall):  # the front's names and this table are one list
    raise ImportError(f"calls without a handler: {sorted(c.value for c in set(WorkerCall) - set(WORKER_CALLS))}")


def dispatch(worker: HostedWorker, method: str, args: Sequence[Any]) -> Any:
    """Run the call named ``method`` (a :class:`~wsync_grpc.engines.rpc.WorkerCall` value) on ``worker``.

    Args:
        worker: this worker process.
        method: the call's name, as it travelled.
        args: its msgpack-native arguments.

    Returns:
        Its msgpack-native result.

    Raises:
        NotImplementedError: no such call (a front and workers of different wsync versions).
        Exception: what the handler raised.
    """
    try:
        call = WorkerCall(method)
    except ValueError:
        raise NotImplementedError(f"no wsync worker call {method!r}") from None
    return WORKER_CALLS[call](worker, *args)
