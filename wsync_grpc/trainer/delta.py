"""The trainer's half of delta updates: what it last sent, and the delta of the next sync against it.

A delta (:mod:`wsync_grpc.core.delta`) names its base by the engine's own identity of the weights it serves
(``wsync.v1.GetStatusResponse.weight_identity``, issued by each apply and returned in the Complete reply), never
by the version label alone: two trainers, or a restarted one, can write "step-5" with other weights. So the
client keeps, after every successful sync it made with deltas on (:class:`DeltaTracker`):

- a copy of every tensor it sent, in the wire dtype, on the CPU (2 bytes per parameter for bfloat16): the base
  the next sync is diffed against;
- the version it sent and, per engine, the identity that engine's Complete reply returned.

The next sync sends a delta only when every engine taking part answered the last sync with an identity (an engine
behind, restarted, new, dirty or written by another trainer gets a whole update: the whole sync is then whole);
each engine's Prepare names that engine's identity, and the engine refuses a delta whose base it does not serve
(``FAILED_PRECONDITION BASE_VERSION_MISMATCH``, ``ENGINE_DIRTY``) before any byte moves. A tensor whose
delta would not save enough travels whole inside the delta update (:data:`~wsync_grpc.core.delta.DENSE_SHARE`).
The digest of a bucket with a delta entry is of the whole tensors it results in, so an engine's check proves the
result bit for bit.

Single-process trainers (``(name, tensor)`` pairs, a :class:`~wsync_grpc.trainer.source.NamedTensors`); the
flattened layout; the broadcast and shared-memory transports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from wsync_grpc.core.delta import DeltaCoding, EncodedTensor, changed_positions, encode
from wsync_grpc.core.digests import BucketHasher, Digest
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.planning import TensorMeta
from wsync_grpc.trainer.results import DeltaSummary, EngineSyncResult, SyncError, SyncResult
from wsync_grpc.trainer.source import NamedTensors
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
    """

    wires: Mapping[str, torch.Tensor]
    base_version: str = ""
    identities: Mapping[str, str] = field(default_factory=dict)
    entries: Mapping[str, EncodedTensor] = field(default_factory=dict)
    summary: DeltaSummary | None = None

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

    def digests(self, buckets: Sequence[Bucket]) -> dict[int, Digest]:
        """Every bucket's digest (``wsync.v1.BucketDigest``): of the whole tensors a bucket with a delta entry
        results in; of its flattened bytes for the others."""
        out: dict[int, Digest] = {}
        for b in buckets:
            if b.has_delta:
                h = BucketHasher()
                for t in b.tensors:
                    h.update(self.wires[t.name])
                out[b.index] = h.digest()
            else:
                out[b.index] = bucket_digest(b, self.wires, Layout.FLATTENED)
        return out


class DeltaTracker:
    """The last update a client sent with deltas on, and the identities its engines answered it with.

    Args:
        anchor_every: send a whole update after this many deltas in a row; 0: never.
    """

    def __init__(self, anchor_every: int = 0) -> None:
        self.anchor_every = anchor_every
        self.version = ""
        self._base: dict[str, torch.Tensor] = {}
        self._identities: dict[str, str] = {}
        self._deltas_in_a_row = 0

    @property
    def base_bytes(self) -> int:
        """The memory the kept base takes, in bytes."""
        return sum(t.nbytes for t in self._base.values())

    def identity(self, target: str) -> str:
        """The identity engine ``target`` answered the last sync with; ``""``: none known."""
        return self._identities.get(target, "")

    def payload(
        self, source: NamedTensors, dtype: torch.dtype | None, targets: Sequence[str], whole: bool = False
    ) -> DeltaPayload:
        """The next update's tensors in the wire dtype and, when every engine of ``targets`` serves the base, the
        delta entries of those that changed little enough.

        Args:
            source: the tensors to send.
            dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
            targets: the engines taking part.
            whole: send a whole update anyway.

        Raises:
            ValueError: a name appears twice.
        """
        t0 = time.monotonic()
        metas: Sequence[TensorMeta] = source.metadata()
        identities = {t: self._identities.get(t, "") for t in targets}
        anchor = self.anchor_every > 0 and self._deltas_in_a_row >= self.anchor_every
        use_base = bool(self.version) and not whole and not anchor and all(identities.values()) and bool(targets)
        wires: dict[str, torch.Tensor] = {}
        entries: dict[str, EncodedTensor] = {}
        changed = total = whole_bytes = values = positions = 0
        with torch.no_grad():
            for meta in metas:
                t = source.tensor(meta.name).detach()
                wire_dtype = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
                w = t.to(device="cpu", dtype=wire_dtype, copy=True).contiguous()
                wires[meta.name] = w
                total += w.numel()
                whole_bytes += w.nbytes
                base = self._base.get(meta.name) if use_base else None
                if base is None or base.dtype != w.dtype or base.shape != w.shape:
                    changed += w.numel() if use_base else 0
                    continue
                entry = encode(w, base)
                if entry is None:
                    changed += changed_positions(w, base).numel()
                    continue
                changed += entry.changed_elements
                values += entry.coding.values_bytes(w.element_size())
                positions += entry.coding.positions_bytes
                entries[meta.name] = entry
        summary = DeltaSummary(
            self.version if use_base else "",
            len(metas),
            len(entries),
            changed if use_base else total,
            total,
            time.monotonic() - t0,
            whole_bytes,
            values,
            positions,
        )
        if not use_base:
            return DeltaPayload(wires, summary=summary)
        return DeltaPayload(wires, self.version, identities, entries, summary)

    def applied(self, version: str, payload: DeltaPayload, engines: Mapping[str, EngineSyncResult]) -> None:
        """``payload`` was applied as ``version`` on ``engines``: it is the base of the next sync.

        An engine that answered without an identity (an older engine) gets whole updates.
        """
        self.version = version
        self._base = dict(payload.wires)
        self._identities = {t: r.weight_identity for t, r in engines.items() if r.weight_identity}
        self._deltas_in_a_row = self._deltas_in_a_row + 1 if payload.is_delta else 0

    def forget(self, targets: Sequence[str] | None = None) -> None:
        """Send whole updates to ``targets`` (``None``: every engine; the kept base is dropped too)."""
        if targets is None:
            self.version = ""
            self._base = {}
            self._identities = {}
            return
        for t in targets:
            self._identities.pop(t, None)


REFUSED_BASE = ("BASE_VERSION_MISMATCH", "ENGINE_DIRTY", "NO_DELTA_BASE", "DELTA_DTYPE", "MISSING_BASE_IDENTITY")
"""The reasons an engine refuses a delta at Prepare for what it serves or is: it takes a whole update instead."""

R = TypeVar("R")
"""The type of the request an attempt runs."""


class DeltaSync(Generic[R]):
    """One sync with deltas on, as the fleet's attempts run it (``Roster.run`` may run an update again over fewer
    engines): each attempt sends a delta when every engine taking part then serves the tracker's base, else whole;
    the base moves on once the sync succeeded (:meth:`applied`).

    An engine that refuses the delta for its base (:data:`REFUSED_BASE`: restarted, written by another trainer,
    dirty, its weights in worker processes; nothing was sent) makes the attempt run again whole, at once.

    Args:
        tracker: the client's last update and its engines' identities.
        source: the tensors to send.
        dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
        targets: the engines taking part, asked at each attempt.
        run: runs one attempt of ``request`` with the payload given (the request's ``delta``).
    """

    def __init__(
        self,
        tracker: DeltaTracker,
        source: NamedTensors,
        dtype: torch.dtype | None,
        targets: Callable[[], Sequence[str]],
        run: Callable[[R, DeltaPayload], SyncResult],
    ) -> None:
        self._tracker = tracker
        self._source = source
        self._dtype = dtype
        self._targets = targets
        self._run = run
        self._sent: DeltaPayload | None = None

    def attempt(self, request: R) -> SyncResult:
        """Run ``request`` once over the engines taking part: a delta if they all serve the base, else whole.

        Raises:
            SyncError: as ``run``'s (a refusal for the base is answered by a whole attempt instead).
        """
        payload = self._tracker.payload(self._source, self._dtype, self._targets())
        self._sent = payload
        try:
            return self._run(request, payload)
        except SyncError as e:
            refused = e.stage == "prepare" and e.failures and all(f.reason in REFUSED_BASE for f in e.failures.values())
            if not (payload.is_delta and refused):
                raise
            log.info("engines %s refused the delta for their base; syncing whole", sorted(e.failures))
            self._tracker.forget(list(e.failures))
            summary = payload.summary.as_whole() if payload.summary is not None else None
            self._sent = DeltaPayload(payload.wires, summary=summary)
            return self._run(request, self._sent)

    def applied(self, result: SyncResult) -> SyncResult:
        """The sync succeeded with ``result``: what its last attempt sent is the base of the next; returns it."""
        if self._sent is not None:
            self._tracker.applied(result.weight_version, self._sent, result.engines)
        return result
