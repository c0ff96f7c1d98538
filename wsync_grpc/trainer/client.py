"""The trainer side of wsync: :class:`TrainerClient`, one facade over the parts of :mod:`wsync_grpc.trainer`.

The client builds its parts explicitly (:class:`~wsync_grpc.trainer.parts.ClientParts`: settings, fleet,
leases, the transports' senders, membership, the update protocol and its runner, metrics), holds the lock
that runs init, sync and leave one at a time, and converts the caller's values once (option strings into
the core's enums, replies into the typed views of :mod:`wsync_grpc.trainer.views`); every call is
delegated to one part. Its calls are grouped by what they are about: the updates here, the operator's
calls (:class:`~wsync_grpc.trainer.operator.OperatorCalls`), the members and their group
(:class:`~wsync_grpc.trainer.members.MemberCalls`).

Units: sizes in bytes, times in seconds, throughputs in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from wsync_grpc.trainer.adapters import adapter_update
from wsync_grpc.trainer.delta import DeltaPayload
from wsync_grpc.trainer.members import MemberCalls
from wsync_grpc.trainer.mixed import TransportChoice, TransportMix
from wsync_grpc.trainer.operator import OperatorCalls, per_target
from wsync_grpc.trainer.options import (
    ApplyMode,
    BackendName,
    Layout,
    TransportName,
)
from wsync_grpc.trainer.parts import ClientParts
from wsync_grpc.trainer.request import BroadcastRequest, DiskRequest
from wsync_grpc.trainer.results import SyncProgress, SyncResult
from wsync_grpc.trainer.roster import FleetPolicy
from wsync_grpc.trainer.sender import Sender
from wsync_grpc.trainer.settings import Settings, client_settings, setting_attributes, setting_keywords
from wsync_grpc.trainer.source import NamedTensors, WeightSource
from wsync_grpc.trainer.views import (
    InitResult,
    LeaveResult,
)
from wsync_grpc.transports.broadcast.sender import PackBuffers
from wsync_grpc.transports.disk.writer import save_checkpoint
from wsync_grpc.transports.sending import TrainerPeers
from wsync_grpc.wire.keepalive import Keepalive

__all__ = ["TrainerClient"]


@setting_attributes
class TrainerClient(Settings, OperatorCalls, MemberCalls):
    """Drives one or more engines from the trainer, whose one process is rank 0 of the weight-sync group.

    Nothing touches the network in the constructor; the group is formed by
    :meth:`init`, or lazily by the first :meth:`sync`. Use it as a context
    manager so that the group is left and the channels closed at the end::

        with TrainerClient(["10.0.0.2:50051", "10.0.0.3:50051"], master_address="10.0.0.1") as c:
            for step in range(steps):
                train_step()
                c.sync(model.named_parameters(), f"step-{step}")

    Thread-safety: :meth:`init`, :meth:`sync` and :meth:`leave` run one at a
    time (a second concurrent ``sync`` raises :class:`RuntimeError`);
    :meth:`cancel`, :meth:`status`, :meth:`pause`, :meth:`resume` and
    :meth:`checksums` may be called from other threads at any time, and
    :meth:`cancel` interrupts a ``sync`` in flight.

    The keywords from ``master_address`` to ``delta_fallback`` are the client's settings, each declared once (type,
    default, unit and meaning) in :class:`~wsync_grpc.trainer.settings.Settings`, in the same order; each is also
    a public attribute of the client (``workers`` as the read-only ``fixed_workers``): assigning one applies
    from the next call.

    Args:
        targets: the engines' control addresses, ``"host:port"``; the order
            fixes their rank offsets.
        token: shared secret sent as ``authorization: Bearer <token>`` with
            every call (the engines' ``--token``); ``None`` sends none. Without
            ``credentials`` it may only go to loopback targets (127.0.0.0/8, ::1,
            ``localhost``): another target raises ``ValueError`` (use TLS).
        credentials: TLS channel credentials (``grpc.ssl_channel_credentials``);
            ``None`` (default) uses plaintext channels.
        channel_options: extra gRPC channel options.
        keepalive: HTTP/2 keepalive of the client's channels (:class:`~wsync_grpc.wire.keepalive.Keepalive`):
            an engine that freezes or is cut off mid-update is named after ``interval_s + timeout_s``
            at most, and a stall shorter than ``timeout_s`` is never taken for a death; ``None`` (default):
            a ping every 10 s, 20 s to answer.
        keep_buffers: keep the two flat bucket buffers (up to twice the
            largest bucket, in bytes) between syncs. ``None`` (default) keeps
            them when the trainer's device is CPU, where freed memory returns
            to the OS and refilling fresh buffers costs page faults; not on
            CUDA, where torch's caching allocator already reuses freed blocks
            and the training step can use them between syncs. Released by
            :meth:`close`.
        owner: the client's display name as the engines' owner (``InitRequest.owner``;
            what ``GetStatus`` and ``NOT_OWNER`` show); ``None`` (default) =
            ``"host:pid:random"``. It proves nothing: each engine issues the client a
            lease credential at ``Init`` (or a disk update's ``Prepare``), which the
            client sends with every call on that engine. Every engine has one owner
            at a time: a client whose engine another live client owns gets
            ``NOT_OWNER`` from ``init``/``sync``.
        metrics_registry: where the client's Prometheus metrics go (:mod:`wsync_grpc.trainer.metrics`);
            ``None`` = a registry of its own (:attr:`metrics_registry`), for the caller to serve.
        peers: the trainer's ranks in the weight-sync group
            (:class:`~wsync_grpc.transports.sending.TrainerPeers`); ``None`` = one process at group rank 0.
            A sharded trainer's client passes its own (:class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient`).
            Each transport's part builds the sender of its updates from them
            (:meth:`TransportPart.sender <wsync_grpc.transports.TransportPart.sender>`).
        sender: deprecated (for one release): builds, from the client's two pack buffers, one object that is
            both the trainer's ranks and its broadcast sender (:class:`~wsync_grpc.trainer.sender.Sender`);
            use ``peers``. Not with ``peers``.
        policy: what an update does when engines are unreachable or fail before the commit decision
            (:class:`~wsync_grpc.trainer.roster.FleetPolicy`); ``None`` (default) = ``FleetPolicy()``:
            the update fails, all or nothing across every engine. ``FleetPolicy.exclude(min_engines=k)``
            leaves those engines out and publishes on the others (all or nothing across them) when
            at least ``k`` remain; each sync may pass its own.

    Raises:
        ValueError: no targets, duplicate targets, a ``workers`` list of the
            wrong length or with a count below 1, non-positive timeouts, a
            negative ``ramp_bytes`` or ``solo_bytes``; a ``token`` without
            ``credentials`` for a target that is not a loopback address.
    """

    def __init__(
        self,
        targets: Sequence[str],
        *,
        master_address: str = Settings.master_address,
        master_port: int | None = Settings.master_port,
        group_name: str = Settings.group_name,
        device: torch.device | str | None = None,
        backend: BackendName = "",
        workers: Sequence[int] | None = None,
        rpc_timeout_s: float = Settings.rpc_timeout_s,
        group_timeout_s: float = Settings.group_timeout_s,
        bucket_bytes: int = Settings.bucket_bytes,
        alignment: int = Settings.alignment,
        ramp_bytes: int = Settings.ramp_bytes,
        solo_bytes: int = Settings.solo_bytes,
        shared_memory_zero_copy: bool = Settings.shared_memory_zero_copy,
        digests: bool | None = None,
        delta: bool = Settings.delta,
        delta_anchor_every: int = Settings.delta_anchor_every,
        delta_fallback: bool = Settings.delta_fallback,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        keepalive: Keepalive | None = None,
        keep_buffers: bool | None = None,
        owner: str | None = None,
        metrics_registry: CollectorRegistry | None = None,
        sender: Callable[[PackBuffers], Sender] | None = None,
        policy: FleetPolicy | None = None,
        peers: TrainerPeers | None = None,
    ) -> None:
        targets = list(targets)
        settings = client_settings(targets, **setting_keywords(locals()))
        ClientParts.__init__(
            self,
            targets,
            settings,
            token=token,
            credentials=credentials,
            channel_options=channel_options,
            keepalive=keepalive,
            keep_buffers=keep_buffers,
            owner=owner,
            metrics_registry=metrics_registry,
            sender=sender,
            policy=policy,
            peers=peers,
        )

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The registry of the client's Prometheus metrics (serve it with ``prometheus_client``)."""
        return self._metrics.registry

    def leave(self) -> dict[str, LeaveResult]:
        """Every engine leaves the group, and so does the trainer; the next :meth:`sync` re-inits.

        Returns:
            target -> :class:`~wsync_grpc.trainer.views.LeaveResult` (``was_member`` is False where it
            was not a member).

        Raises:
            EngineCallError: some engine failed (FAILED_PRECONDITION with an update in flight: cancel first).
        """
        with self._op_lock:
            return per_target(self._membership.leave(), LeaveResult.from_proto)

    def close(self) -> None:
        """Leave the group (engines and trainer, best effort) and close the channels. Idempotent.

        Errors from engines are logged, not raised: ``close`` runs on the way out, often after another error.
        """
        if self._membership.closed:
            return
        self._membership.closed = True
        with self._op_lock:
            self._membership.leave_on_close()
            self._senders.release()
        self._leases.close()  # the engines release the lease at once
        self._fleet.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def init(self, *, force: bool = False) -> dict[str, InitResult]:
        """Form the weight-sync group: every engine's workers plus the trainer as rank 0.

        Steps (:meth:`Membership.form <wsync_grpc.trainer.membership.Membership.form>`):
        ``GetStatus`` everywhere, the client's ``KeepAlive`` lease on every
        engine, engines freed from an old membership, rank offsets
        ``1, 1 + w0, ...`` in target order, then ``Init`` everywhere while the
        trainer joins as rank 0; an engine's Init failing early ends it at once.

        Without ``force``, an initialized, healthy client returns its membership without any call.

        Returns:
            target -> :class:`~wsync_grpc.trainer.views.InitResult` (the group as each engine joined it).

        Raises:
            InitError: an engine failed (status, cleanup or Init), the
                trainer's join failed (under :data:`TRAINER`), or an engine
                reports other ranks than assigned. The client stays marked for
                re-initialization.
            ClientError: the client was closed.
        """
        with self._op_lock:
            return per_target(self._membership.init(force), InitResult.from_proto)

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | WeightSource,
        weight_version: str,
        *,
        layout: Layout = "flattened",
        apply_mode: ApplyMode = "staged",
        bucket_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        flush_cache: bool = False,
        progress: Callable[[SyncProgress], None] | None = None,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        policy: FleetPolicy | None = None,
        timeout_s: float | None = None,
        transport: TransportChoice = "broadcast",
        delta: bool | None = None,
    ) -> SyncResult:
        """Push ``named_tensors`` to every engine as ``weight_version``.

        Sequence: (re-)init if needed; plan buckets; a streaming ``Prepare``
        (header, then one message per bucket) to every engine concurrently,
        waiting for every reply (an engine replies once its receives are
        posted); broadcast every bucket (flattened: packed into a ``uint8``
        buffer, the next bucket packed while the current one is on the wire;
        individual: each tensor contiguous in its wire dtype); ``Complete``
        on every engine concurrently: for a staged update in two phases,
        ``verify_only`` everywhere, then, once every engine verified, the
        applying one, so that the new version is published on every engine
        or on none (except an engine failing in its own apply:
        :attr:`SyncError.published` says which).

        On any failure (an engine rejects the metadata, dies, times out, or
        the trainer's broadcast fails): no further byte is broadcast, the
        update is cancelled on every engine (engines whose Prepare was
        rejected keep their state and weights), the trainer leaves the group,
        the client is marked for re-init (the next ``sync`` re-initializes
        automatically), and one :class:`SyncError` is raised.

        Args:
            named_tensors: ``(name, tensor)`` pairs, e.g.
                ``model.named_parameters()`` or ``model.state_dict().items()``;
                tied tensors are sent once, under their first name. Or a
                :class:`~wsync_grpc.trainer.source.WeightSource` (metadata by
                global shape, tensors per bucket while sending).
            weight_version: the version the engines report once the update
                succeeded (SGLang's ``weight_version``), e.g. ``"step-42"``.
            layout: ``"flattened"`` (one broadcast per bucket, default) or
                ``"individual"`` (one per tensor).
            apply_mode: ``"staged"`` (apply everything at Complete; the
                engine needs memory for the whole update) or ``"streaming"``
                (apply bucket by bucket, about two buckets of extra memory; the
                engine is frozen until Complete).
            bucket_bytes: bucket capacity, in bytes; ``None`` = the client's.
            dtype: send floating tensors in this dtype (e.g. ``torch.bfloat16``).
            flush_cache: have the engines flush their prefix/KV cache (SGLang's
                ``flush_cache``).
            progress: called from this thread after every bucket.
            update_id: the update's id; ``None`` = a fresh UUID.
            on_phase: called from this thread with each phase's name as it ends
                (``"planned"``, ``"prepared"``, ``"broadcast"``, ``"verified"``,
                ``"applied"``); its exceptions are logged, not raised.
            policy: this sync's fleet policy; ``None`` = the client's (:attr:`policy`). Under
                ``exclude``, engines that do not answer or fail before the commit decision are left
                out (the update runs again over the others) and the result names them
                (:mod:`wsync_grpc.trainer.roster`).
            timeout_s: the whole sync's deadline, in seconds; ``None`` (default): none beyond each call's
                own timeouts. By it the sync ends: stopped at its next wait and abandoned everywhere
                (published nowhere; :class:`SyncError` at the stage it reached, ``failures[TRAINER]`` with
                reason ``DEADLINE_EXCEEDED``), unless every engine had verified it: the applying
                ``Complete`` is the commit and is never cut short (:mod:`wsync_grpc.trainer.deadline`).
            transport: how the bytes travel: ``"broadcast"`` (default: over the weight-sync group, formed by
                :meth:`init`) or ``"shared_memory"`` (engines on this host: each bucket packed into a
                shared-memory segment the engines' workers map read-only; no group, flattened layout only:
                :mod:`wsync_grpc.transports.shared_memory`) or ``"cuda_ipc"`` (tensors on a GPU, engines on that
                GPU: the same ring in GPU memory, :mod:`wsync_grpc.transports.cuda_ipc`; verified on one H100).
                Or a mixed fleet, target -> ``"broadcast"`` or ``"shared_memory"`` (targets not named:
                ``"broadcast"``): both in one fleet commit, staged and flattened (:mod:`wsync_grpc.trainer.mixed`).
                Never chosen by the client itself.
            delta: send only the elements whose value in the wire dtype changed since this client's last sync,
                when every engine serves what it sent (whole otherwise; ``(name, tensor)`` pairs, flattened
                layout: :mod:`wsync_grpc.trainer.delta`; :attr:`SyncResult.delta` says what was sent). ``None``:
                the client's ``delta`` setting.

        Returns:
            A :class:`SyncResult` with per-engine results and trainer-side timings.

        Raises:
            ValueError: empty ``weight_version``, nothing to send, a bad
                ``layout``/``apply_mode``/``transport`` (a mapping naming no engine of this client, or a mixed one
                that is streaming), a ``timeout_s`` not above 0, or a planning error.
            SyncError: the update failed (see above); the message names every
                failed engine with its code, reason and message.
            RuntimeError: another ``sync`` is running in this client.
            ClientError: the client was closed.
        """
        mix = TransportMix.of(transport, [e.target for e in self._fleet.members])  # refused before any call
        request = BroadcastRequest.create(
            weight_version,
            layout,
            apply_mode,
            bucket_bytes or self._settings.bucket_bytes,
            dtype=dtype,
            flush_cache=flush_cache,
            progress=progress,
            update_id=update_id,
            on_phase=on_phase,
        )
        request = mix.request(request)  # one transport's kind, or both in one commit (wsync_grpc.trainer.mixed)
        source = named_tensors if isinstance(named_tensors, WeightSource) else NamedTensors(named_tensors)
        if not (self._settings.delta if delta is None else delta):
            return self.run_update(source, request, policy=policy, timeout_s=timeout_s)
        return self._run_with_deltas(source, request, dtype, policy, timeout_s)

    def run_update(
        self,
        source: WeightSource,
        request: BroadcastRequest,
        *,
        policy: FleetPolicy | None = None,
        timeout_s: float | None = None,
        delta: DeltaPayload | bool | None = None,
    ) -> SyncResult:
        """Run one broadcast update built beforehand: :meth:`sync` once its arguments are converted.

        For trainers that build the :class:`~wsync_grpc.trainer.request.BroadcastRequest` themselves, e.g. a
        sharded trainer's rank 0 with its send topology (:class:`~wsync_grpc.core.topology.SendTopology`,
        which this client's sender must serve). ``delta``: deltas on, ``True`` (diffed from ``source``, as :meth:`sync`)
        or the payload encoded already (a sharded trainer's direct send, each rank's pieces against :attr:`deltas`).

        Raises:
            as :meth:`sync`.
        """
        if delta:  # True, or a payload
            encoded = delta if isinstance(delta, DeltaPayload) else None
            return self._run_with_deltas(source, request, request.dtype, policy, timeout_s, encoded=encoded)
        return self._run_update(request, source, policy, timeout_s)

    def sync_from_disk(
        self,
        checkpoint_path: str | os.PathLike[str],
        weight_version: str,
        *,
        apply_mode: ApplyMode = "staged",
        flush_cache: bool = False,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        policy: FleetPolicy | None = None,
        timeout_s: float | None = None,
    ) -> SyncResult:
        """Have every engine load the safetensors checkpoint at ``checkpoint_path`` as ``weight_version``.

        SGLang's ``update_weights_from_disk`` and vLLM's ``reload_weights``, as
        one committed update (:mod:`wsync_grpc.trainer.runner`): a header-only
        ``Prepare`` (``TRANSPORT_DISK``) everywhere, each engine validating
        every tensor from the files' headers before reading any; then, as for
        :meth:`sync`, ``Complete(verify_only)`` everywhere and the applying
        ``Complete`` only once every engine holds the whole checkpoint. No
        group is formed (no Init): each engine reads the files itself, inside
        the roots its operator allowed (``wsync serve --checkpoint-root``).

        Args:
            checkpoint_path: a directory (with ``model.safetensors.index.json``,
                or ``*.safetensors`` files) or one ``.safetensors`` file, as the
                engines see it; relative paths are taken under each engine's
                first checkpoint root.
            weight_version, apply_mode, flush_cache, update_id, on_phase, policy, timeout_s: as for :meth:`sync`
                (``on_phase`` gets ``"prepared"``, ``"verified"``, ``"applied"``). The client remembers
                the checkpoint: :meth:`catch_up` reads it on engines that fall behind.

        Returns:
            A :class:`SyncResult` (``wire_bytes`` 0; ``payload_bytes`` the checkpoint's tensors, in bytes).

        Raises:
            ValueError: empty ``weight_version`` or path, or a bad ``apply_mode``.
            SyncError: some engine refused or failed (PERMISSION_DENIED for a path outside its
                roots, NOT_FOUND, INVALID_ARGUMENT for a pickle file or tensors that do not fit
                its model...); the update was cancelled everywhere.
            RuntimeError: another sync is running in this client.
        """
        request = DiskRequest.create(
            checkpoint_path, weight_version, apply_mode, flush_cache=flush_cache, update_id=update_id, on_phase=on_phase
        )
        return self._run_update(request, None, policy, timeout_s)

    def save_and_sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        directory: str | os.PathLike[str],
        weight_version: str,
        *,
        engine_path: str | None = None,
        **kwargs: Any,
    ) -> SyncResult:
        """Save ``named_tensors`` as ``directory/model.safetensors``, then :meth:`sync_from_disk` it.

        Args:
            named_tensors: as for :meth:`sync` (tied tensors are written once).
            directory: where to write, on a disk the engines see too.
            weight_version: as for :meth:`sync`.
            engine_path: the directory as the engines see it; ``None`` = ``directory``.
            kwargs: further arguments of :meth:`sync_from_disk`.

        Raises:
            as :func:`~wsync_grpc.transports.disk.writer.save_checkpoint` and :meth:`sync_from_disk`.
        """
        save_checkpoint(named_tensors, directory)
        return self.sync_from_disk(engine_path if engine_path is not None else directory, weight_version, **kwargs)

    def sync_adapter(
        self,
        adapter: Any,
        name: str,
        version: str,
        *,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        policy: FleetPolicy | None = None,
        transport: TransportName = "broadcast",
    ) -> SyncResult:
        """Load (or replace) LoRA adapter ``name`` as ``version`` on every engine, as one committed update.

        Generation requests then name it (``GenerateRequest.adapter``); a
        replaced adapter never computes another token for anyone (requests
        running with it recompute their context with the new one). Each engine
        validates the adapter against its base model (target modules, shapes,
        rank) before anything changes; a bad one is refused with
        ``INVALID_ARGUMENT`` and the old one keeps serving.

        Args:
            adapter: a PEFT directory as the engines see it (``save_pretrained``'s output:
                ``adapter_config.json`` and ``adapter_model.safetensors``), read by each engine inside
                its checkpoint roots; or a live ``peft.PeftModel`` whose active LoRA adapter's
                tensors are sent by ``transport`` (:func:`~wsync_grpc.trainer.adapters.adapter_update`).
            name: the adapter's name on the engines (letters, digits, ``.``, ``-``, ``_``).
            version: its version, reported with every answer it produces.
            update_id, on_phase, policy: as for :meth:`sync`.
            transport: a live adapter's, as for :meth:`sync` (``"broadcast"`` forms the weight-sync group,
                ``"shared_memory"`` and ``"cuda_ipc"`` none); a directory takes the default only. Never chosen by
                the client.

        Raises:
            ValueError: an empty version, a bad ``transport`` (``"shared_memory"`` with a directory), or an
                object that is neither a path nor a PEFT LoRA model; before any call.
            SyncError: some engine refused or failed; the update was cancelled everywhere.
            RuntimeError: another sync is running in this client.
        """
        request, source = adapter_update(
            adapter, name, version, transport, self._settings.bucket_bytes, update_id=update_id, on_phase=on_phase
        )
        return self._run_update(request, source, policy)
