"""The trainer's half of delta updates: what it last sent, and the delta of the next sync against it.

A delta (:mod:`wsync_grpc.core.delta`) names its base by the engine's own identity of the weights it serves
(``wsync.v1.GetStatusResponse.weight_identity``, issued by each apply and returned in the Complete reply), never
by the version label alone: two trainers, or a restarted one, can write "step-5" with other weights. So the
client keeps, after every successful sync it made with deltas on (:class:`DeltaTracker`):

- a copy of every tensor it sent, in the wire dtype, on the CPU (2 bytes per parameter for bfloat16): the base
  the next sync is diffed against; and the copy before it, which the next sync converts its tensors into;
- the version it sent and, per engine, the identity that engine's Complete reply returned.

The next sync sends a delta only when every engine taking part answered the last sync with an identity (an engine
behind, restarted, new, dirty or written by another trainer gets a whole update: the whole sync is then whole);
each engine's Prepare names that engine's identity, and the engine refuses a delta whose base it does not serve
(``FAILED_PRECONDITION BASE_VERSION_MISMATCH``, ``ENGINE_DIRTY``) before any byte moves. A tensor whose
delta would not save enough travels whole inside the delta update (:data:`~wsync_grpc.core.delta.DENSE_SHARE`).
The digest of a bucket with a delta entry is of the whole tensors it results in, so an engine's check proves the
result bit for bit.

A delta pays for its diff only where the wire is slower than the passes the diff and the rebuild make over the
model: between hosts, not over loopback, whose wire is itself a memory copy. A client that diffs the whole tensors
itself (one process, or a sharded trainer's rank 0 in the gather mode) therefore times its syncs of either kind and
falls back to whole updates while a delta, diff included, has taken longer than a whole sync, trying a delta again
now and then (:class:`DeltaCosts`; the ``delta_fallback`` setting).

Trainers whose process holds or gathers the whole tensors (a :class:`~wsync_grpc.trainer.source.WholeTensors`:
``(name, tensor)`` pairs, or a sharded trainer's rank 0 in the gather mode, which gathers each bucket with every
rank and diffs it as it comes); a sharded trainer's direct send, each rank its own pieces (:class:`DeltaSync`'s
``encoded``); the flattened layout; the broadcast and shared-memory transports.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from wsync_grpc.core.delta import DeltaCoding, EncodedTensor, delta_of
from wsync_grpc.core.digests import BucketHasher, Digest
from wsync_grpc.core.dtypes import wire_dtype
from wsync_grpc.core.lanes import lanes
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.trainer.results import DeltaSummary, EngineSyncResult, SyncError, SyncResult
from wsync_grpc.trainer.source import WholeTensors
from wsync_grpc.transports.broadcast.sender import bucket_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeltaPayload:
    """One update's tensors in the wire dtype and, for a delta, its entries and the base they name.

    Attributes:
        wires: every tensor of the update, in the wire dtype, contiguous, on the CPU (copies: the base of the next
            sync once this one succeeded).
        base_version: the base's version; ``""``: a whole update.
        identities: target -> the identity of the base that engine serves (each engine's Prepare names its own).
        entries: name -> its delta entry, for the tensors sent as one.
        summary: what the payload holds.
        whole_targets: engines taking part that are not at the base: they take the same weights whole, in the same
            commit (:class:`DeltaSync`); empty: every engine takes the delta.
        rank: the trainer rank whose tensors (or, in a sharded trainer's direct send, pieces) ``wires`` and
            ``entries`` are (0 for one process).
        rank_codings: a sharded trainer's direct send: every trainer rank's entries' codings, by rank then name
            (exchanged before planning: rank 0 plans every rank's buckets); empty: ``entries`` alone.
    """

    wires: Mapping[str, torch.Tensor]
    base_version: str = ""
    identities: Mapping[str, str] = field(default_factory=dict)
    entries: Mapping[str, EncodedTensor] = field(default_factory=dict)
    summary: DeltaSummary | None = None
    whole_targets: tuple[str, ...] = ()
    rank: int = 0
    rank_codings: Mapping[int, Mapping[str, DeltaCoding]] = field(default_factory=dict)

    @property
    def whole(self) -> DeltaPayload:
        """The same tensors as a whole update (no base)."""
        summary = self.summary.as_whole() if self.summary is not None else None
        return DeltaPayload(self.wires, summary=summary, rank=self.rank)

    def plan_deltas(self) -> dict[int, dict[str, DeltaCoding]]:
        """Every sending rank's entries' codings, by rank then name (for planning); empty for a whole update."""
        if not self.is_delta:
            return {}
        if self.rank_codings:
            return {r: dict(c) for r, c in self.rank_codings.items()}
        return {self.rank: self.codings}

    def digest_of(self, bucket: Bucket) -> Digest:
        """One bucket's digest (``wsync.v1.BucketDigest``), from this rank's tensors: of the whole tensors a
        bucket with a delta entry results in; of its flattened bytes otherwise."""
        if bucket.has_delta:
            h = BucketHasher()
            for t in bucket.tensors:
                h.update(self.wires[t.name])
            return h.digest()
        return bucket_digest(bucket, self.wires, Layout.FLATTENED)

    @property
    def is_delta(self) -> bool:
        """Whether the update is a delta (it names a base)."""
        return bool(self.base_version)

    @property
    def codings(self) -> dict[str, DeltaCoding]:
        """name -> the coding of its delta entry, for planning (:func:`~wsync_grpc.core.planning.plan_metadata`)."""
        return {n: e.coding for n, e in self.entries.items()}

    def bucket_tensors(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """The tensors to pack for ``bucket``: a delta entry's bytes, or the whole tensor in the wire dtype
        (a :meth:`~wsync_grpc.trainer.source.WeightSource.bucket_tensors`)."""
        return {
            t.name: self.entries[t.name].payload if t.delta is not None else self.wires[t.name] for t in bucket.tensors
        }


class DeltaTracker:
    """The last update a client sent with deltas on, and the identities its engines answered it with.

    Args:
        anchor_every: send a whole update after this many deltas in a row; 0: never.
    """

    def __init__(self, anchor_every: int = 0) -> None:
        self.anchor_every = anchor_every
        self.version = ""
        self._base: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}  # the base before the last, converted into at the next encode
        self._identities: dict[str, str] = {}
        self._deltas_in_a_row = 0
        self.costs = DeltaCosts()
        """The time this client's syncs of either kind took: whether a delta pays for its diff."""

    @property
    def base_bytes(self) -> int:
        """The memory the kept base takes, in bytes."""
        return sum(t.nbytes for t in self._base.values())

    @property
    def kept_bytes(self) -> int:
        """The memory the client keeps between syncs, in bytes: the base, and the base before it, which the next
        sync converts its tensors into (memory already touched: fresh memory would page-fault every 4 KiB)."""
        return self.base_bytes + sum(t.nbytes for t in self._spare.values())

    def identity(self, target: str) -> str:
        """The identity engine ``target`` answered the last sync with; ``""``: none known."""
        return self._identities.get(target, "")

    def encode(self, source: WholeTensors, dtype: torch.dtype | None, whole: bool = False) -> DeltaPayload:
        """The next update's tensors in the wire dtype and, unless a whole update is due (no base yet, an anchor,
        or ``whole``), the delta entries against the base of those that changed little enough; for no engine yet
        (:meth:`for_targets`).

        Args:
            source: the tensors to send, read whole one at a time (:meth:`WholeTensors.whole_tensors
                <wsync_grpc.trainer.source.WholeTensors.whole_tensors>`: a sharded trainer's rank 0 in the gather
                mode gathers them here, with every rank); each is dropped once converted and diffed.
            dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
            whole: send the update whole without diffing it (:attr:`SyncPlan.KEEP`).

        Raises:
            ValueError: a name appears twice.
            Exception: the source's, reading a tensor (a sharded trainer's rank lost mid-gather).
        """
        return self.encode_tensors(source.whole_tensors(), dtype, whole=whole, read_ahead=source.holds_tensors)

    def encode_tensors(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None,
        rank: int = 0,
        whole: bool = False,
        read_ahead: bool | None = None,
    ) -> DeltaPayload:
        """As :meth:`encode`, for ``tensors`` by name (or ``(name, tensor)`` pairs, read once, in order): a
        process's whole tensors, or a sharded trainer rank's own pieces (``rank``: that rank, in a direct send).
        ``DeltaSummary.diff_seconds`` is the time of the whole call, reading the tensors included.

        ``read_ahead``: whether the next tensor may be read before the last one is converted (tensors the caller
        holds anyway); ``False``: each is dropped first (a gathering source's memory bound); ``None``: whether
        ``tensors`` is a mapping.
        """
        t0 = time.monotonic()
        anchor = self.anchor_every > 0 and self._deltas_in_a_row >= self.anchor_every
        diff = bool(self.version) and not anchor and not whole
        wires: dict[str, torch.Tensor] = {}
        entries: dict[str, EncodedTensor] = {}
        count = changed = total = whole_bytes = values = positions = 0
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        # Each tensor converted and diffed on a lane of its own (wsync_grpc.core.lanes): torch's own parallel
        # operations would wait on any core another process keeps busy. The source is read here, in order (a
        # gathering source's collectives); without read-ahead the next tensor once the last one is converted and
        # dropped (a gathered bucket goes before the next is gathered), while the diffs of those before it go on.
        ahead = isinstance(tensors, Mapping) if read_ahead is None else read_ahead
        pool, width = lanes()
        pending: deque[tuple[str, Future[tuple[torch.Tensor, EncodedTensor | None, int]]]] = deque()

        def take() -> None:
            nonlocal count, changed, total, whole_bytes, values, positions
            name, future = pending.popleft()
            w, entry, k = future.result()
            wires[name] = w
            count += 1
            total += w.numel()
            whole_bytes += w.nbytes
            changed += k
            if entry is not None:
                values += entry.coding.values_bytes(w.element_size())
                positions += entry.coding.positions_bytes
                entries[name] = entry

        try:
            for name, given in pairs:
                spare = self._spare.pop(name, None)
                base = self._base.get(name) if diff else None
                converted = threading.Event()
                if given.device.type == "cpu":
                    task = pool.submit(_diffed, [given], base, (spare, dtype), converted)
                else:  # copied to the host here, on this thread's current stream, as the trainer ordered its work
                    task = pool.submit(_diffed, [_to_wire(given, spare, dtype)], base, None, converted)
                del given
                pending.append((name, task))
                if not ahead:
                    converted.wait()
                while len(pending) > (2 if ahead else 1) * width or (pending and pending[0][1].done()):
                    take()
            while pending:
                take()
        finally:
            wait([f for _, f in pending])  # a failed read or lane: the others end before the error goes up
        version = self.version if diff else ""
        summary = DeltaSummary(
            version, count, len(entries), changed, total, time.monotonic() - t0, whole_bytes, values, positions
        )
        return DeltaPayload(wires, version, {}, entries, summary, rank=rank)

    def for_targets(self, encoded: DeltaPayload, targets: Sequence[str], mixed: bool = False) -> DeltaPayload:
        """``encoded`` (:meth:`encode`) for the engines ``targets``: a delta to those at the base, each named by its
        identity, when that is every one of them or, ``mixed``, at least one (the others then in
        :attr:`DeltaPayload.whole_targets`); whole otherwise.
        """
        identities = {t: self._identities.get(t, "") for t in targets}
        at_base = {t: i for t, i in identities.items() if i}
        behind = tuple(t for t in targets if not identities[t])
        if not encoded.is_delta or not at_base or (behind and not mixed):
            return encoded.whole
        summary = dataclasses.replace(encoded.summary, whole_targets=behind) if encoded.summary is not None else None
        return dataclasses.replace(encoded, identities=at_base, summary=summary, whole_targets=behind)

    def applied(self, version: str, payload: DeltaPayload, engines: Mapping[str, EngineSyncResult]) -> None:
        """``payload`` was applied as ``version`` on ``engines``: it is the base of the next sync.

        An engine that answered without an identity (an older engine) gets whole updates.
        """
        self.version = version
        old, self._base = self._base, dict(payload.wires)
        kept = {id(t) for t in self._base.values()}
        self._spare = {n: t for n, t in old.items() if id(t) not in kept}
        self._identities = {t: r.weight_identity for t, r in engines.items() if r.weight_identity}
        self._deltas_in_a_row = self._deltas_in_a_row + 1 if payload.is_delta else 0

    def forget(self, targets: Sequence[str] | None = None) -> None:
        """Send whole updates to ``targets`` (``None``: every engine; the kept base is dropped too)."""
        if targets is None:
            self.version = ""
            self._base = {}
            self._spare = {}
            self._identities = {}
            return
        for t in targets:
            self._identities.pop(t, None)


def _to_wire(given: torch.Tensor, spare: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
    """``given`` in the wire dtype, contiguous, on the CPU: converted into ``spare`` when it fits (memory already
    touched), into a fresh copy otherwise."""
    with torch.no_grad():
        t = given.detach()
        wire = wire_dtype(t.dtype, dtype)
        if spare is not None and spare.dtype == wire and spare.shape == t.shape:
            return spare.copy_(t)
        return t.to(device="cpu", dtype=wire, copy=True).contiguous()


def _diffed(
    box: list[torch.Tensor],
    base: torch.Tensor | None,
    convert: tuple[torch.Tensor | None, torch.dtype | None] | None,
    converted: threading.Event,
) -> tuple[torch.Tensor, EncodedTensor | None, int]:
    """The tensor in ``box`` (taken out, so that nothing here holds it once converted: converted first by
    :func:`_to_wire` with ``convert``'s spare and dtype, if given; ``converted`` set then), its delta against
    ``base`` (``None``: whole) and its changed elements' count (every element without a base of its dtype and
    shape)."""
    try:
        w = box.pop()
        if convert is not None:
            w = _to_wire(w, *convert)
    finally:
        converted.set()
    if base is None or base.dtype != w.dtype or base.shape != w.shape:
        return w, None, w.numel()
    entry, k = delta_of(w, base)
    return w, entry, k


class SyncPlan(enum.Enum):
    """How the next sync of a client with deltas on goes (:meth:`DeltaCosts.plan`)."""

    DELTA = "delta"
    """Diffed against the base: a delta where the engines are at it, whole otherwise (the first sync, an anchor)."""
    KEEP = "keep"
    """Whole without a diff, its tensors kept as the next base (to time a whole sync, or before a delta is tried)."""
    PLAIN = "plain"
    """Whole, as with deltas off: nothing copied or kept (falling back); the base is dropped."""


class DeltaCosts:
    """Whether a delta pays for its diff on this client's fleet, from the time its syncs of either kind took.

    A delta's time is its sync's (``SyncResult.total_seconds``) plus the trainer's diff
    (``DeltaSummary.diff_seconds``); a whole sync's is its sync's. Both per byte of the whole update, the median of
    the last :attr:`window` of each. While deltas cost more (:meth:`plan`), syncs go whole as with deltas off
    (:attr:`SyncPlan.PLAIN`), and a delta is tried again every :attr:`probe_every` syncs (the sync before it
    keeps its tensors, :attr:`SyncPlan.KEEP`). While deltas cost less, a whole sync is timed again after
    :attr:`probe_every` deltas when they take more than half a whole sync's time, after four times as many
    otherwise (the first sync, whose time includes the engines' first touch of their memory, would otherwise
    decide for good). The client's first delta is not counted either: it converts into memory the client never
    touched before and the engines rebuild into memory of their own touched for the first time, so its time
    says little of the next ones' (the next sync is a delta again). Mixed syncs (some engines whole) and syncs
    that failed are not counted.

    Args:
        probe_every: syncs between two tries of the kind that is losing (at least 2).
        window: syncs of each kind whose median decides (at least 1).

    Raises:
        ValueError: ``probe_every`` below 2 or ``window`` below 1.
    """

    def __init__(self, probe_every: int = 8, window: int = 5) -> None:
        if probe_every < 2 or window < 1:
            raise ValueError(f"probe_every must be at least 2 and window at least 1, not {probe_every}, {window}")
        self.probe_every = probe_every
        self.window = window
        self._delta: deque[float] = deque(maxlen=window)
        self._whole: deque[float] = deque(maxlen=window)
        self._since = 0  # syncs of the winning kind since the losing one was last tried
        self._try_delta = False  # the last sync kept its tensors to try a delta next
        self._first_delta = True  # no delta of this client counted yet: the first is not

    def seconds_per_byte(self) -> tuple[float | None, float | None]:
        """The median time of a delta and of a whole sync, in seconds per byte of the whole update (``None``: not
        timed yet)."""
        return (
            statistics.median(self._delta) if self._delta else None,
            statistics.median(self._whole) if self._whole else None,
        )

    def plan(self, has_base: bool) -> SyncPlan:
        """How the next sync goes; ``has_base``: the client keeps a base to diff against."""
        delta, whole = self.seconds_per_byte()
        if delta is None or whole is None:
            return SyncPlan.DELTA  # until both were timed
        if delta <= whole:
            due = self.probe_every * (4 if 2 * delta < whole else 1)
            return SyncPlan.KEEP if has_base and self._since >= due else SyncPlan.DELTA
        if has_base and self._try_delta:
            return SyncPlan.DELTA
        return SyncPlan.KEEP if self._since + 2 >= self.probe_every else SyncPlan.PLAIN  # the delta: the sync after

    def record(self, plan: SyncPlan, summary: DeltaSummary, sync_seconds: float) -> None:
        """Count a successful sync that ran as ``plan``: ``summary`` is its ``SyncResult.delta``, ``sync_seconds`` its
        ``SyncResult.total_seconds``."""
        if summary.whole_targets or summary.whole_bytes <= 0:
            return
        ran_delta = bool(summary.base_version)
        if ran_delta and self._first_delta:
            self._first_delta = False
            return
        if ran_delta:
            self._delta.append((sync_seconds + summary.diff_seconds) / summary.whole_bytes)
        else:
            self._whole.append(sync_seconds / summary.whole_bytes)
        delta, whole = self.seconds_per_byte()
        delta_wins = delta is None or whole is None or delta <= whole
        self._since = 0 if ran_delta != delta_wins else self._since + 1  # the losing kind ran: counted afresh
        self._try_delta = plan is SyncPlan.KEEP and not delta_wins


def fallen_back(source: WholeTensors, dtype: torch.dtype | None) -> DeltaSummary:
    """What a sync sent whole as with deltas off (:attr:`SyncPlan.PLAIN`) says in ``SyncResult.delta``: every
    element counted as changed, no diff, ``fell_back``."""
    metas = source.metadata()
    total = sum(math.prod(m.shape) for m in metas)
    wire = [wire_dtype(m.dtype, dtype) for m in metas]
    nbytes = sum(math.prod(m.shape) * d.itemsize for m, d in zip(metas, wire, strict=True))
    return DeltaSummary("", len(metas), 0, total, total, 0.0, nbytes, fell_back=True)


REFUSED_BASE = ("BASE_VERSION_MISMATCH", "ENGINE_DIRTY", "NO_DELTA_BASE", "DELTA_DTYPE", "MISSING_BASE_IDENTITY")
"""The reasons an engine refuses a delta at Prepare for what it serves or is: it takes a whole update instead."""


R = TypeVar("R")
"""The type of the request an attempt runs."""


class DeltaRuns(Protocol[R]):
    """How :class:`DeltaSync` runs its updates (the client's runner and roster)."""

    def run(self, request: R, payload: DeltaPayload, before_commit: Callable[[], None] | None) -> SyncResult:
        """Run ``request`` once, with ``payload`` as its tensors, over the engines taking part (``before_commit``:
        see :meth:`UpdateRunner.run <wsync_grpc.trainer.runner.UpdateRunner.run>`).

        Raises:
            SyncError: the update failed; it was abandoned on every engine.
        """
        ...

    def taking_part(self, targets: Collection[str]) -> AbstractContextManager[None]:
        """Only ``targets`` take part inside the block."""
        ...

    def fresh(self, request: R) -> R:
        """``request`` again under a new update id."""
        ...


class DeltaSync(Generic[R]):
    """One sync with deltas on, as the fleet's attempts run it (``Roster.run`` may run an update again over fewer
    engines); the base moves on once the sync succeeded (:meth:`applied`).

    At each attempt, over the engines then taking part:

    - every one answered the client's last sync with an identity: a delta to them all;
    - some did and some did not (behind, restarted, new), in a staged sync: a **mixed** one, in one fleet
      commit: the whole weights to those behind, over a group of their own, verified; then the delta to the
      others over theirs, verified and applied; then the whole update applied (between its two phases:
      :meth:`UpdateProtocol.transfer_and_commit <wsync_grpc.trainer.protocol.UpdateProtocol.transfer_and_commit>`).
      No engine applies anything unless every one of both updates verified. One broadcast reaches every member
      of a group, so the two payloads cannot share one;
    - otherwise (none at the base, or a streaming sync with one behind): whole.

    An engine that refuses the delta for its base (:data:`REFUSED_BASE`: restarted, written by another trainer,
    dirty, no copy kept in its workers; nothing was sent) makes the attempt run again whole, at once.

    Args:
        tracker: the client's last update and its engines' identities.
        source: the tensors to send.
        dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
        targets: the engines taking part, asked at each attempt.
        runs: how the updates run.
        mixed: a mixed sync is allowed (a staged one).
        whole: send the update whole without diffing it (:attr:`SyncPlan.KEEP`).
        encoded: the update's payload encoded already (a sharded trainer's direct send, whose ranks each encode
            their own pieces: :class:`~wsync_grpc.trainer.sharded.source.DirectSource`); ``None``: encoded from
            ``source`` at the first attempt.
    """

    def __init__(
        self,
        tracker: DeltaTracker,
        source: WholeTensors | None,
        dtype: torch.dtype | None,
        targets: Callable[[], Sequence[str]],
        runs: DeltaRuns[R],
        mixed: bool,
        encoded: DeltaPayload | None = None,
        whole: bool = False,
    ) -> None:
        self._tracker = tracker
        self._source = source
        self._dtype = dtype
        self._targets = targets
        self._runs = runs
        self._mixed = mixed
        self._encoded = encoded
        self._whole = whole
        self._sent: DeltaPayload | None = None

    def attempt(self, request: R) -> SyncResult:
        """Run ``request`` once over the engines taking part (see the class).

        Raises:
            SyncError: as the runs' (a refusal for the base is answered by an attempt that sends the refusing
                engines the whole weights instead).
        """
        if self._encoded is None:  # once per sync: the attempts differ only by the engines taking part
            assert self._source is not None, "a sync without its payload encoded needs its tensors"
            self._encoded = self._tracker.encode(self._source, self._dtype, whole=self._whole)
        targets = list(self._targets())
        for again in (False, True):
            payload = self._tracker.for_targets(self._encoded, targets, mixed=self._mixed)
            self._sent = payload
            try:
                if payload.whole_targets:
                    return self._mixed_sync(request, payload, targets)
                return self._runs.run(request, payload, None)
            except SyncError as e:
                refused = e.stage == "prepare" and bool(e.failures)
                refused = refused and all(f.reason in REFUSED_BASE for f in e.failures.values())
                if again or not (payload.is_delta and refused):
                    raise
                log.info("engines %s refused the delta for their base; they take the weights whole", sorted(e.failures))
                self._tracker.forget(list(e.failures))
                request = self._runs.fresh(request)
        raise AssertionError("unreachable")

    def _mixed_sync(self, request: R, payload: DeltaPayload, targets: Sequence[str]) -> SyncResult:
        """The whole weights to ``payload.whole_targets`` and the delta to the others, in one commit.

        Raises:
            SyncError: either update failed; both were abandoned (nothing applied), or, failing in an engine's own
                apply, as the fleet commit says.
        """
        at_base = [t for t in targets if t in payload.identities]
        delta: list[SyncResult] = []

        def delta_part() -> None:  # the whole update verified: now the delta, up to its own commit
            with self._runs.taking_part(at_base):
                delta.append(self._runs.run(self._runs.fresh(request), payload, None))

        with self._runs.taking_part(payload.whole_targets):
            whole = self._runs.run(request, payload.whole, delta_part)
        (d,) = delta
        engines = {**whole.engines, **d.engines}
        return dataclasses.replace(
            whole,
            engines={t: engines[t] for t in targets if t in engines},
            bucket_count=whole.bucket_count + d.bucket_count,
            wire_bytes=whole.wire_bytes + d.wire_bytes,
            payload_bytes=whole.payload_bytes + d.payload_bytes,
            delta=d.delta,
        )

    def applied(self, result: SyncResult) -> SyncResult:
        """The sync succeeded with ``result``: what its last attempt sent is the base of the next; returns it."""
        if self._sent is not None:
            self._tracker.applied(result.weight_version, self._sent, result.engines)
        return result
