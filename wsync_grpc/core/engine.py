"""The interface between the wsync servicer and the inference engine it lives in.

Every engine (the tensor and reference engines in :mod:`wsync_grpc.engines`,
vLLM's front in :mod:`wsync_grpc.engines.vllm.front`) implements :class:`Engine`:
which parameters an update may carry, how to pause and resume admission, how
to flush caches, where its workers are. Where the weights live decides the rest,
and an engine implements only what applies to it:

- weights in this process (threads of the servicer's process are its workers):
  :class:`WeightTarget` (``load_weights``), with the optional
  :class:`InPlaceReceive` and :class:`StorageSwap`;
- weights in other processes (vLLM's workers): :class:`RemoteWorkers`, each
  worker running :class:`~wsync_grpc.engines.host.WorkerHost`; optionally
  :class:`ServedChecksums`.

LoRA adapters are :class:`~wsync_grpc.core.lora.LoraAdapters` (the only meaning
of "adapter" in wsync). Everything here is plain Python and torch; no gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.params import ParamSpec as ParamSpec  # the specs an engine serves: part of its interface
from wsync_grpc.core.update import ReceivePlan


class PauseMode(enum.Enum):
    """What a pause does with generation requests in flight.

    Mirrors ``wsync.v1.PauseMode`` (vLLM's ``/pause?mode=abort|wait|keep``).
    """

    ABORT = "abort"
    """End every request in flight at once (finish reason aborted)."""
    WAIT = "wait"
    """Let requests in flight finish; admit no new ones."""
    KEEP = "keep"
    """Freeze requests in flight between two decode steps; continue on resume."""


@dataclass(frozen=True)
class PauseOutcome:
    """What a pause did, counted in requests (``wsync.v1.PauseResponse``)."""

    aborted: int = 0
    drained: int = 0
    frozen: int = 0


@runtime_checkable
class Engine(Protocol):
    """What the servicer needs from an inference engine.

    Thread-safety: every method may be called from gRPC worker threads and
    from the servicer's receiver threads concurrently; implementations guard
    their own state.
    """

    @property
    def name(self) -> str:
        """A short name for logs and the status RPC (e.g. the model id)."""
        ...

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """Canonical name -> spec of every tensor an update may carry, in model order."""
        ...

    def aliases(self) -> Mapping[str, str]:
        """Alias name -> canonical name for tied tensors.

        E.g. ``{"lm_head.weight": "model.embed_tokens.weight"}`` for a model
        with tied embeddings: an update may carry either name and the tensor
        is loaded once.
        """
        ...

    def worker_devices(self) -> Sequence[torch.device]:
        """The device of each worker; one weight-sync rank per entry."""
        ...

    def weights_lock(self) -> AbstractContextManager[object]:
        """A context manager held while weights change.

        The engine holds the same lock around every inference step, so that
        no step ever runs on a mix of old and new weights.
        """
        ...

    def get_weight(self, name: str) -> torch.Tensor:
        """The served tensor ``name`` (canonical or alias), for checksums.

        Raises:
            KeyError: unknown name.
        """
        ...

    def set_weight_version(self, version: str) -> None:
        """Record the weight version that the next inference steps serve.

        Called under :meth:`weights_lock`, right after the last load, so that
        responses are tagged with the version their tokens were produced with.
        """
        ...

    def pause(self, mode: PauseMode, timeout: float) -> PauseOutcome:
        """Stop admitting new requests and handle the ones in flight per ``mode``.

        Returns once the mode holds: ABORT at once; WAIT when every request in
        flight has finished; KEEP when no inference step is running. Pausing a
        paused engine applies the stricter mode to what is left.

        Args:
            timeout: bound for the WAIT drain, in seconds.

        Raises:
            TimeoutError: WAIT did not drain within ``timeout``; the engine
                stays paused and the rest keeps running.
        """
        ...

    def resume(self) -> int:
        """Admit requests again; return how many frozen requests continue."""
        ...

    def is_paused(self) -> bool:
        """Whether admission is paused."""
        ...

    def pause_mode(self) -> PauseMode | None:
        """The mode of the pause in force, or ``None`` when serving."""
        ...

    def flush_cache(self) -> None:
        """Drop every cache computed with the old weights (prefix / KV cache)."""
        ...

    def request_counts(self) -> tuple[int, int]:
        """``(running, waiting)`` generation requests."""
        ...


@runtime_checkable
class InPlaceReceive(Protocol):
    """Optional: an engine whose served tensors a streaming update may receive into directly.

    With streaming apply the servicer freezes the engine (pause KEEP) until
    Complete, and the weights change bucket by bucket anyway. For a bucket
    that holds a single tensor (the trainer sends every tensor of at least
    :data:`wsync_grpc.core.planning.DEFAULT_SOLO_BYTES` alone), the receiver then
    posts the broadcast straight into the served tensor instead of into a
    receive buffer followed by :meth:`WeightTarget.load_weights`: no receive
    buffer, no copy. The bytes land while the collective runs, without
    :meth:`Engine.weights_lock` held, so an engine may offer this only
    for tensors nothing reads while it is frozen. A broken update leaves such
    a tensor half written: the engine is then marked dirty and stays paused,
    as after any broken streaming update.
    """

    def receive_target(self, worker: int, name: str) -> torch.Tensor | None:
        """The served tensor of canonical ``name`` on ``worker``, to receive into, or None to copy as usual.

        The receiver uses it only when it is contiguous, on the worker's
        device, and has exactly the wire dtype and shape of the update's
        tensor; otherwise it falls back to :meth:`WeightTarget.load_weights`.
        """
        ...


@runtime_checkable
class StorageSwap(Protocol):
    """Optional: an engine that lets a staged update replace its served tensors' memory instead of copying into it.

    A staged update keeps the served weights intact until Complete, so it
    receives into buffers and, by default, copies every tensor into the served
    one after the last byte (:meth:`WeightTarget.load_weights`): on a CPU host
    that copy is as slow as the transfer and nothing overlaps it. For a tensor
    that travelled alone (a bucket of its own, see
    :data:`wsync_grpc.core.planning.DEFAULT_SOLO_BYTES`) in exactly the served dtype
    and shape, the receiver allocates an exact-size buffer and, at Complete,
    under :meth:`Engine.weights_lock`, hands it to the engine to serve
    from then on. An engine may offer this only where nothing depends on its
    weights' addresses (not under CUDA graphs captured on them) and each
    served tensor is the only one over its memory (no other views of it).
    """

    def swap_weights(self, worker: int, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Serve each ``(canonical name, tensor)`` in place of the served tensor of that name, without copying.

        Each tensor is contiguous, on the worker's device, has the served
        tensor's dtype and shape, and belongs to the engine from then on. The
        caller holds :meth:`Engine.weights_lock`.

        Returns:
            The memory the replaced tensors used, as 1-D ``uint8`` tensors over
            their whole storage that nothing else uses any more; the receiver
            reuses them as buffers for the next update. Leave out any memory
            that something else may still read.

        Raises:
            KeyError: unknown name.
        """
        ...


@runtime_checkable
class FusedGroups(Protocol):
    """Optional: an engine that serves some checkpoint tensors fused into one (vLLM's ``qkv_proj``, ``gate_up_proj``).

    Such a tensor is rebuilt from all of its parts when any part changes, so
    an update must carry every part or none; the servicer refuses anything
    else before a byte moves (reason ``PARTIAL_FUSED_GROUP``).
    """

    def fused_groups(self) -> Sequence[tuple[str, ...]]:
        """Groups of canonical names served as one tensor (e.g. a layer's q_proj, k_proj and v_proj weights)."""
        ...


@runtime_checkable
class ServedChecksums(Protocol):
    """Optional: an engine that digests its served tensors itself (its workers are other processes).

    ``GetWeightChecksums`` then asks it instead of reading every tensor
    through :meth:`Engine.get_weight`.
    """

    def weight_checksums(self, names: Sequence[str]) -> list[tuple[str, torch.dtype, tuple[int, ...], str]]:
        """``(name, served dtype, shape, hex SHA-256 of its C-contiguous bytes)`` for each of ``names``.

        ``names`` are canonical names or aliases, reported as asked.

        Raises:
            KeyError: unknown name.
        """
        ...


@runtime_checkable
class WeightTarget(Protocol):
    """The weights a receiver loads into: an engine whose weights live in this process, or a worker's model.

    The tensor and reference engines are one (their workers are threads of the
    servicer's process); so is a vLLM worker's model, loaded by
    :class:`~wsync_grpc.engines.host.WorkerHost` in that worker's process.
    """

    def weights_lock(self) -> AbstractContextManager[object]:
        """Held while weights change (see :meth:`Engine.weights_lock`)."""
        ...

    def load_weights(self, worker: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy received tensors into the served parameters of ``worker``.

        Args:
            worker: index into :meth:`Engine.worker_devices`.
            tensors: ``(canonical name, tensor)`` pairs; each tensor has the
                parameter's shape and a dtype accepted by
                :func:`wsync_grpc.core.dtypes.can_convert` (converted on copy).

        Returns:
            The number of tensors loaded.

        The caller holds :meth:`weights_lock` or has frozen the engine.
        """
        ...

    def get_weight(self, name: str) -> torch.Tensor:
        """The served tensor ``name`` (see :meth:`Engine.get_weight`)."""
        ...


@dataclass(frozen=True)
class ReceiverProgress:
    """Where one worker's receive of the update in flight stands: every receiver's progress, in any process.

    A receiver reports it (:meth:`wsync_grpc.worker.receiver.Receiver.progress`);
    an engine whose workers are other processes carries it to the front
    (:meth:`RemoteWorkers.worker_progress`, :func:`~wsync_grpc.core.messages.progress_to_msg`).

    Attributes:
        rank: the worker's rank in the weight-sync group (-1 when not a member).
        armed: its first receive is posted (or nothing is declared yet).
        done: its receiver ended (every bucket arrived, or it failed).
        buckets_done: buckets received.
        bytes_done: bytes received, in bytes.
        last_arrival_at: when the last bucket arrived, on the host's monotonic clock (seconds); ``None`` before.
        error: why its receiver failed (``GroupError``, ``GroupTimeout``, ``Cancelled``...); ``None`` while it has not.
        buckets_verified: buckets whose bytes matched their digest (:mod:`wsync_grpc.core.digests`).
    """

    rank: int
    armed: bool
    done: bool
    buckets_done: int
    bytes_done: int
    last_arrival_at: float | None
    error: BaseException | None
    buckets_verified: int = 0


@runtime_checkable
class RemoteWorkers(Protocol):
    """Optional: an engine whose workers are other processes (vLLM's), where the receivers run.

    The reference engine's workers are threads of the servicer's process: the
    servicer joins the group and runs each worker's receiver itself (one made by
    the update's transport, :mod:`wsync_grpc.transports`). An engine that offers
    this protocol instead has each worker process run a
    :class:`~wsync_grpc.engines.host.WorkerHost`, which joins the group at
    ``rank_offset`` plus its global rank, receives in the background, and
    applies between two of its inference steps; the servicer drives them
    through these calls (the messages of :mod:`wsync_grpc.core.messages`) and
    polls their progress. Each call reaches every worker and returns once all
    have answered.
    """

    def join_workers(self, params: GroupParams) -> None:
        """Every worker joins the group (blocks until it formed, at most ``params.timeout_s`` seconds).

        Raises:
            GroupTimeout, GroupError: the group did not form; no worker stays a member.
        """
        ...

    def leave_workers(self) -> None:
        """Every worker abandons any update in flight and leaves the group. Idempotent.

        Abandoning cancels the worker's receive and ends a half-done apply;
        the servicer calls this whenever an update fails.
        """
        ...

    def arm_workers(self, plan: ReceivePlan) -> None:
        """Every worker starts receiving ``plan``; returns once every first receive is posted.

        A disk update's workers read ``plan.files`` (no group needed); an
        adapter's (``plan.payload``) keep its tensors apart from the model for
        :meth:`adapter_from_workers`.

        Raises:
            Exception: a worker could not arm (not a member, or not within ``plan.timeout_s`` seconds).
        """
        ...

    def declare_to_workers(
        self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None
    ) -> None:
        """Feed every worker further buckets of an incremental update and the digests declared after their
        buckets (bucket index -> digest); ``closed``: the declarations ended (Complete), none will follow."""
        ...

    def worker_progress(self) -> list[ReceiverProgress]:
        """Each worker's receive progress, in worker order."""
        ...

    def apply_on_workers(self, timeout_s: float, weight_version: str) -> int:
        """Every worker applies what it received, between two inference steps; tensors loaded by worker 0.

        The engine publishes ``weight_version`` together with the apply, so
        that no step runs on the new weights under the old version.

        Raises:
            Exception: a worker's apply failed (its weights may be half applied).
        """
        ...

    def adapter_from_workers(self, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """An adapter update's tensors as the first worker received them (CPU copies, PEFT names); the update ends.

        Every worker lets its own copy go; the model is untouched (the engine
        then loads them as an adapter, :meth:`~wsync_grpc.core.lora.LoraAdapters.load_adapter`).

        Raises:
            Exception: a worker's receive failed or did not end within ``timeout_s`` seconds.
        """
        ...
