"""A mixed fleet in one sync and one fleet commit: the engines on the trainer's host through shared memory, the
others by broadcast (``TrainerClient.sync(transport={target: "shared_memory", ...})``).

One transport carries one update: a shared-memory ring reaches only the engines of the trainer's host, and a
broadcast reaches every member of its group. A mixed sync (:class:`MixedRequest`) is therefore two updates of the
same payload, committed as one, as a mixed delta sync commits its two payloads
(:class:`~wsync_grpc.trainer.delta.DeltaSync`), by :class:`TransportRunner`:

1. the **shared-memory part**, over the engines the mapping names ``"shared_memory"``: Prepare, the ring's send,
   ``Complete(verify_only)`` (every one of them verified);
2. between its two commit phases (:meth:`UpdateProtocol.transfer_and_commit
   <wsync_grpc.trainer.protocol.UpdateProtocol.transfer_and_commit>`'s ``before_commit``), the **broadcast part**,
   over the other engines, in a group formed for them alone (as a catch-up forms one; the next sync by broadcast
   over everyone re-forms it): Prepare, broadcast, ``Complete(verify_only)``, then its applying ``Complete``, only
   while every shared-memory engine is still held (their held ``Watch`` calls stay open meanwhile: one ended
   stops the broadcast part before it applies);
3. the shared-memory part applies.

Nothing is applied anywhere unless both parts verified: a failure in either part before that abandons both (the
engines of both keep serving their old weights) and raises the failing part's
:class:`~wsync_grpc.trainer.results.SyncError`, its message naming the other part. The one window is the fleet
commit's own (an engine failing in its own apply): an engine of the shared-memory part that fails its applying
``Complete`` after the broadcast part applied is named with stage ``"apply"``, and the error's ``results`` name
every engine that serves the new version.

Staged only: a streaming update applies bucket by bucket as it arrives, so the part that runs first would change
its engines before the other part had received anything; no all-or-nothing is possible and such a sync is refused
(``ValueError``). Flattened only (the shared-memory part's layout).

The fleet policy runs over the whole mixed sync (``Roster.run``): under ``exclude`` an engine dying or refusing in
either part before the commit decision is left out and the sync runs again from the start over the others, split
the same way; when one part has no engine left, the sync runs as one plain update by the other transport. With
deltas on, each part carries the same payload (a delta to the engines at the base, named by each engine's own
identity), so a mixed delta sync (some engines behind) nests the two transports inside each of its two payloads.

The result (:func:`joined_result`) is one :class:`~wsync_grpc.trainer.results.SyncResult` over every engine.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.options import TransportName, transport_of
from wsync_grpc.trainer.request import SENT_KINDS, BroadcastRequest, SharedMemoryRequest, UpdateRequest
from wsync_grpc.trainer.results import SyncError, SyncResult
from wsync_grpc.trainer.roster import Roster
from wsync_grpc.trainer.runner import UpdateRunner
from wsync_grpc.trainer.source import WeightSource

__all__ = ["MixedRequest", "TransportChoice", "TransportMix", "TransportRunner", "as_kind", "joined_result"]

TransportChoice = TransportName | Mapping[str, TransportName]
"""``TrainerClient.sync``'s ``transport``: one transport for every engine, or engine target -> transport (the
targets not named go by ``"broadcast"``)."""

K = TypeVar("K", bound=BroadcastRequest)


@dataclass(frozen=True, kw_only=True)
class MixedRequest(BroadcastRequest):
    """A sync whose engines of :attr:`shared_memory_targets` take it through shared memory, the others by broadcast,
    in one fleet commit (:class:`TransportRunner`); otherwise as :class:`~wsync_grpc.trainer.request.BroadcastRequest`
    (staged, flattened).

    Attributes:
        shared_memory_targets: the engines (``host:port``) that take it through shared memory.
    """

    shared_memory_targets: frozenset[str] = frozenset()

    def part(self, kind: type[K], update_id: str | None = None) -> K:
        """This update as one part of ``kind`` (a plain request of one transport), under ``update_id`` (``None``:
        this one's)."""
        return as_kind(self, kind, update_id=update_id or self.update_id)


def as_kind(request: BroadcastRequest, kind: type[K], **changes: object) -> K:
    """``request``'s fields (a :class:`~wsync_grpc.trainer.request.BroadcastRequest`'s) as a request of ``kind``,
    with ``changes``."""
    fields: dict[str, object] = {f.name: getattr(request, f.name) for f in dataclasses.fields(BroadcastRequest)}
    return kind(**{**fields, **changes})  # type: ignore[arg-type]


@dataclass(frozen=True)
class TransportMix:
    """Which transport each engine of one sync takes, validated before anything happens (:meth:`of`).

    Attributes:
        transport: the transport of every engine, when they all take the same one; ``None`` for a mixed sync.
        shared_memory: the engines that take it through shared memory (a mixed sync's; empty otherwise).
    """

    transport: Transport | None
    shared_memory: frozenset[str] = frozenset()

    @classmethod
    def of(cls, choice: TransportChoice, members: Sequence[str]) -> TransportMix:
        """The mix ``choice`` names over the client's ``members`` (their targets): one transport name for all, or a
        mapping target -> name whose targets not named go by ``"broadcast"``; a mapping that gives every member
        the same transport is a plain sync by it.

        Raises:
            ValueError: an unknown transport name, a mapping naming a target that is no member, or one mixing
                ``"cuda_ipc"`` with another transport.
        """
        if isinstance(choice, str):
            return cls(transport_of(choice))
        unknown = sorted(set(choice) - set(members))
        if unknown:
            raise ValueError(
                f"transport names {', '.join(map(repr, unknown))}, which is no engine of this client "
                f"(its engines: {', '.join(members)})"
            )
        chosen = {t: transport_of(name) for t, name in choice.items()}
        kinds = {chosen.get(t, Transport.BROADCAST) for t in members}
        if len(kinds) == 1:
            return cls(kinds.pop())
        if Transport.CUDA_IPC in kinds:
            raise ValueError(
                "a mixed fleet mixes 'shared_memory' and 'broadcast' only: engines taking 'cuda_ipc' sync alone "
                "(transport='cuda_ipc' for every engine of the client)"
            )
        return cls(None, frozenset(t for t in members if chosen.get(t) is Transport.SHARED_MEMORY))

    def request(self, request: BroadcastRequest) -> BroadcastRequest:
        """``request`` (built as a broadcast) as the kind this mix sends: one transport's, or a :class:`MixedRequest`.

        Raises:
            ValueError: a mixed sync that is streaming (no all-or-nothing is possible: the part that runs first
                would apply before the other received anything) or not in the flattened layout.
        """
        if self.transport is not None:
            kind = SENT_KINDS[self.transport]
            return request if type(request) is kind else as_kind(request, kind)
        if request.apply_mode is not ApplyMode.STAGED:
            raise ValueError(
                "a sync that mixes shared memory and broadcast must be staged: a streaming one would apply on the "
                "engines of one transport before those of the other received anything, so no all-or-nothing "
                "commit is possible (sync them apart, or staged)"
            )
        if request.layout is not Layout.FLATTENED:
            raise ValueError("a sync that mixes shared memory and broadcast is flattened (shared memory's layout)")
        return as_kind(request, MixedRequest, shared_memory_targets=self.shared_memory)


def joined_result(first: SyncResult, second: SyncResult, targets: Sequence[str]) -> SyncResult:
    """One result over both parts of a mixed sync: ``first`` (the shared-memory part, under the sync's update id),
    ``second`` (the broadcast part, which ran between ``first``'s two commit phases), ``targets`` the engines in
    rank order.

    ``engines`` holds every engine of both parts, in ``targets``' order; the counts (buckets, tensors, payload)
    are of the one payload both carried; ``wire_bytes`` and the trainer's times (init, plan, pack, transfer) add up
    both parts'; the engine-side phases (prepare, verify, complete, total) are ``first``'s, whose commit contains
    the whole of ``second``.
    """
    engines = {**first.engines, **second.engines}
    return dataclasses.replace(
        first,
        engines={t: engines[t] for t in targets if t in engines},
        wire_bytes=first.wire_bytes + second.wire_bytes,
        init_seconds=first.init_seconds + second.init_seconds,
        plan_seconds=first.plan_seconds + second.plan_seconds,
        pack_seconds=first.pack_seconds + second.pack_seconds,
        broadcast_seconds=first.broadcast_seconds + second.broadcast_seconds,
    )


class TransportRunner:
    """The client's update runner: a :class:`MixedRequest` as its two parts in one commit (see the module), any
    other request as :class:`~wsync_grpc.trainer.runner.UpdateRunner` runs it.

    Args:
        runner: runs one update over the engines taking part.
        roster: chooses which engines take part (each part runs over its own).
        fleet: the engines (those taking part are split between the parts at each attempt).
    """

    def __init__(self, runner: UpdateRunner, roster: Roster, fleet: Fleet) -> None:
        self._runner = runner
        self._roster = roster
        self._fleet = fleet

    def run(
        self,
        request: UpdateRequest,
        source: WeightSource | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> SyncResult:
        """Run ``request`` over the engines taking part, as :meth:`UpdateRunner.run
        <wsync_grpc.trainer.runner.UpdateRunner.run>` does (``before_commit`` likewise: for a mixed sync it runs
        once both parts verified, before either applies).

        Returns:
            One :class:`~wsync_grpc.trainer.results.SyncResult` over every engine taking part
            (:func:`joined_result` for a mixed sync).

        Raises:
            ValueError, Unimplemented, ClientError: as :meth:`UpdateRunner.run
                <wsync_grpc.trainer.runner.UpdateRunner.run>`.
            SyncError: the update failed; for a mixed sync, the failing part's error (both parts abandoned, unless
                it failed in an engine's own apply: :attr:`SyncError.results` then names every engine that applied).
        """
        if not isinstance(request, MixedRequest):
            return self._runner.run(request, source, before_commit)
        targets = [e.target for e in self._fleet.engines]
        local = [t for t in targets if t in request.shared_memory_targets]
        remote = [t for t in targets if t not in request.shared_memory_targets]
        if not local or not remote:  # one part left (the others were left out): one plain update
            kind = SharedMemoryRequest if local else BroadcastRequest
            return self._runner.run(request.part(kind), source, before_commit)
        second: list[SyncResult] = []
        errors: list[SyncError] = []

        def broadcast_part() -> None:  # the shared-memory part verified (and held): the broadcast part, to its commit
            with self._roster.taking_part(remote):
                try:
                    update = request.part(BroadcastRequest, uuid.uuid4().hex)
                    second.append(self._runner.run(update, source, before_commit))
                except SyncError as e:
                    errors.append(e)
                    raise

        try:
            with self._roster.taking_part(local):
                first = self._runner.run(request.part(SharedMemoryRequest), source, broadcast_part)
        except SyncError as e:
            raise _told(e, errors, second, local, remote) from e
        return joined_result(first, second[0], targets)


def _told(
    e: SyncError,
    errors: Sequence[SyncError],
    second: Sequence[SyncResult],
    local: Sequence[str],
    remote: Sequence[str],
) -> SyncError:
    """``e`` (a mixed sync's error) with the other part named: what happened to it, and every engine that applied."""
    results = dict(e.results)
    if errors:  # the broadcast part failed: the shared-memory part was abandoned with it
        note = f"the shared-memory part ({', '.join(local)}) had verified and was abandoned: nothing applied there"
    elif second:  # the shared-memory part failed in its own apply, after the broadcast part applied
        results.update(second[0].engines)
        note = f"the broadcast part applied on {', '.join(second[0].engines)} (they serve {e.weight_version!r} now)"
    else:  # the shared-memory part failed before the broadcast part began
        note = f"the broadcast part ({', '.join(remote)}) did not start: untouched"
    return SyncError(
        f"{e}; mixed sync: {note}",
        stage=e.stage,
        update_id=e.update_id,
        weight_version=e.weight_version,
        failures=e.failures,
        results=results,
        cancelled=e.cancelled,
        broadcast_started=e.broadcast_started,
    )
