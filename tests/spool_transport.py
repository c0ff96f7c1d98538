"""A test-only transport, "spool": the proof that a transport is an addition to wsync, not a change of it.

Nothing of ``wsync_grpc`` knows this module. It is a
:class:`~wsync_grpc.transports.TransportPart` (both halves) that a test registers with one line,
``monkeypatch.setitem(wsync_grpc.transports.TRANSPORTS, Transport.CUDA_IPC, "spool_transport")``
(the contract's ``Transport`` enum is fixed, so it borrows the reserved ``TRANSPORT_CUDA_IPC`` value,
answered UNIMPLEMENTED by every engine otherwise), and a trainer picks it with :class:`SpoolRequest`.

How the bytes travel: through a directory both sides see (:data:`SPOOL_DIR`, set by the test: the
trainer and the engines run in the test's process):

- the trainer half, :class:`SpoolSender`, packs each bucket as the flattened layout packs it (zero
  padding) and writes it to ``<spool>/<update_id>/<bucket index>.bin`` (a temporary name, then renamed,
  so a reader never sees half a file), checking the cancel signal before each bucket; it hashes each
  bucket as the broadcast sender does and hands the digest over (``job.on_digest``: the trainer declares
  it to the engines, which check it), then reports the bucket sent (``job.on_sent``). Several engines
  read the same files, so the sender, not a reader, removes them: an earlier update's directory when the
  next one starts, every one it wrote at :meth:`SpoolSender.release` (an abandoned update, the client's
  close);
- the engine half, :class:`SpoolReceiver`, one thread per worker, waits for each declared bucket's file
  (polling, stopped by the update's cancel signal, bounded by the engine's group timeout), reads it into a
  flat buffer of its own, checks its digest when the trainer declared one, and loads its tensors
  (streaming) or keeps them for Complete (staged), as the broadcast and disk receivers do.

The engine finds its update's files by the update's id, which its receive plan carries
(:attr:`ReceivePlan.update_id <wsync_grpc.core.update.ReceivePlan.update_id>`).

:class:`SpoolTransport` with ``corrupt`` set is a test hook, as the broadcast sender's
:class:`~wsync_grpc.transports.broadcast.sender.Corruption`: the sender flips one byte of that bucket's
file after hashing it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from wsync_grpc.core.digests import BucketHasher, Digest, check_digest, digest_of
from wsync_grpc.core.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    GroupTimeout,
    InvalidArgument,
    Unavailable,
    WsyncError,
)
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Bucket, Layout, Transport
from wsync_grpc.core.packing import pack_bucket, tensor_views
from wsync_grpc.core.update import PlannedUpdate, ReceivePlan
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.trainer.request import BroadcastRequest
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.sending import SendJob, SendSite, TransportSender
from wsync_grpc.worker.receiver import Receiver, ReceiverThread, ReceiveSite

log = logging.getLogger(__name__)

_T = TypeVar("_T")

SPOOL_DIR: Path | None = None
"""The spool directory both halves use; ``None`` until a test sets it (``monkeypatch.setattr``)."""

POLL_S = 0.002
"""How long a receiver sleeps between two looks for a file or a digest, in seconds (a cancel wakes it)."""


class _NotYet:
    """What a receiver's look finds while the thing it waits for is not there yet."""


NOT_YET = _NotYet()


def spool_dir() -> Path:
    """:data:`SPOOL_DIR`.

    Raises:
        Unavailable: SPOOL_UNSET, no test set it.
    """
    if SPOOL_DIR is None:
        raise Unavailable("SPOOL_UNSET", "spool_transport.SPOOL_DIR is not set")
    return SPOOL_DIR


def bucket_file(update_id: str, index: int) -> str:
    """Where bucket ``index`` of update ``update_id`` lies beneath the spool directory."""
    return f"{update_id}/{index}.bin"


@dataclass(frozen=True, kw_only=True)
class SpoolRequest(BroadcastRequest):
    """An update whose bytes the trainer writes to the spool (everything else as a broadcast's request)."""

    transport: ClassVar[Transport] = Transport.CUDA_IPC


# --------------------------------------------------------------------------------------------- the trainer half


class SpoolSender:
    """The spool's trainer half (a :class:`~wsync_grpc.transports.sending.TransportSender`): one file per bucket.

    Args:
        site: where it runs (one process: the spool has no rank rounds).
        corrupt: a test hook: flip a byte of this bucket's file after hashing it; ``None``: none.
    """

    def __init__(self, site: SendSite, corrupt: int | None = None) -> None:
        self._site = site
        self._corrupt = corrupt
        self._written: list[Path] = []

    def header_fields(self, job: SendJob) -> Mapping[str, Any]:
        """None: the receivers find the files by the update's id."""
        return {}

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """``None``: each bucket is hashed as it is written, and its digest follows the Prepare."""
        return None

    def send(self, job: SendJob) -> float:
        """Write every bucket of ``job`` to the spool, in index order; returns the time spent packing (seconds).

        Raises:
            ValueError: a layout or topology the spool does not carry.
            Cancelled: ``job.cancel`` was set before a bucket.
        """
        if job.topology.kind != "single" or job.layout is not Layout.FLATTENED:
            raise ValueError(f"the spool carries single-process flattened updates, not {job.topology} {job.layout}")
        self._clean()  # the updates written before this one were committed or abandoned
        spool = spool_dir()
        directory = spool / job.update_id
        directory.mkdir(parents=True)
        self._written.append(directory)
        pack_s = 0.0
        sent = 0
        for b in job.buckets:
            if job.cancel.is_set():
                raise Cancelled("the update was cancelled")
            t = time.monotonic()
            buf = pack_bucket(b, job.tensors(b), torch.empty(b.size_bytes, dtype=torch.uint8), zero_padding=True)
            pack_s += time.monotonic() - t
            digest = digest_of([buf])
            if self._corrupt == b.index:
                buf[0] ^= 0xFF  # after hashing: a faulty medium
            final = spool / bucket_file(job.update_id, b.index)
            tmp = final.with_name(f".{final.name}.tmp")
            with tmp.open("wb") as f:
                f.write(buf.numpy().tobytes())
            os.replace(tmp, final)
            sent += b.size_bytes
            if job.on_digest is not None:
                job.on_digest(b, digest)
            if job.on_sent is not None:
                job.on_sent(b, sent)
        return pack_s

    def _clean(self) -> None:
        for directory in self._written:
            shutil.rmtree(directory, ignore_errors=True)
        self._written = []

    def release(self) -> None:
        """Remove every update directory this sender wrote (an abandoned update, or the client closing)."""
        self._clean()


# --------------------------------------------------------------------------------------------- the engine half


class SpoolReceiver(ReceiverThread):
    """Reads one spool update's buckets for one worker (a :class:`~wsync_grpc.worker.receiver.Receiver`).

    Args:
        site: where it runs (no group); tensors are moved to ``site.device``.
        plan: the update: its apply mode, ``update_id`` (its files' directory) and ``timeout_s`` (the bound of
            each wait for a file or a digest, in seconds).
    """

    def __init__(self, site: ReceiveSite, plan: ReceivePlan) -> None:
        super().__init__(f"wsync-spool-reader-{site.worker}", site, plan)
        self.device = site.device
        self.update_id = plan.update_id
        self._timeout_s = plan.timeout_s
        self._digests_follow = plan.digests_follow

    @property
    def timeout_s(self) -> float:
        """The bound of one wait (a file, a digest), in seconds."""
        return self._timeout_s

    def run(self) -> None:
        try:
            self.armed.set()  # nothing to post: the files are read as they come
            self.first_post_at = time.monotonic()
            for i in itertools.count():
                bucket = self._poll(functools.partial(self._declared, i), f"no bucket {i} was declared")
                if bucket is None:
                    break
                self._bucket(bucket)
        except BaseException as e:
            if not isinstance(e, Cancelled | WsyncError):
                log.exception("spool reader of worker %d failed", self.worker)
            self.error = e
        finally:
            self.done.set()
            self.on_event(self)

    def _declared(self, i: int) -> Bucket | _NotYet | None:
        """Bucket ``i``; ``None``: no more will be declared."""
        try:
            return self.feed.get(i, 0)
        except LookupError:
            return NOT_YET

    def _poll(self, fetch: Callable[[], _T | _NotYet], what: str) -> _T:
        """``fetch()`` until it answers something but :data:`NOT_YET`, looking for a cancel in between.

        Raises:
            Cancelled: the update was cancelled meanwhile.
            GroupTimeout: ``timeout_s`` passed without an answer.
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            got = fetch()
            if not isinstance(got, _NotYet):
                return got
            if self.cancel.wait(POLL_S):
                raise Cancelled("the update was cancelled")
            if time.monotonic() > deadline:
                raise GroupTimeout(f"{what} within {self._timeout_s:g} s")

    def _read(self, bucket: Bucket) -> torch.Tensor | _NotYet:
        """Bucket ``bucket``'s file, read into a flat buffer of its own; :data:`NOT_YET` while it is not there.

        Raises:
            Unavailable: SPOOL_READ_FAILED.
            DataLoss: SPOOL_FILE_SIZE, the file holds more or fewer bytes than the bucket.
        """
        flat = torch.empty(bucket.size_bytes, dtype=torch.uint8)
        try:
            with (spool_dir() / bucket_file(self.update_id, bucket.index)).open("rb") as f:
                n = f.readinto(flat.numpy().data)
                extra = f.read(1)
        except FileNotFoundError:
            return NOT_YET
        except OSError as e:
            raise Unavailable("SPOOL_READ_FAILED", f"reading bucket {bucket.index}'s file failed: {e}") from e
        if n != bucket.size_bytes or extra:
            raise DataLoss(
                "SPOOL_FILE_SIZE", f"bucket {bucket.index}'s file does not hold its {bucket.size_bytes} bytes"
            )
        return flat

    def _expected(self, bucket: Bucket) -> Digest | None:
        """``bucket``'s digest: its spec's, or the one declared after it (waited for); ``None``: none promised.

        Raises:
            InvalidArgument: DIGEST_MISSING, the declarations ended without it.
            DeadlineExceeded: DIGEST_TIMEOUT.
        """
        if bucket.digest is not None or not self._digests_follow:
            return bucket.digest

        def declared() -> Digest | _NotYet | None:
            try:
                return self.feed.digest(bucket.index, 0)
            except GroupTimeout:
                return NOT_YET

        try:
            digest = self._poll(declared, f"bucket {bucket.index}'s digest was not declared")
        except GroupTimeout as e:
            raise DeadlineExceeded("DIGEST_TIMEOUT", str(e), bucket=str(bucket.index)) from e
        if digest is None:
            raise InvalidArgument("DIGEST_MISSING", f"bucket {bucket.index} has no digest", bucket=str(bucket.index))
        return digest

    def _bucket(self, bucket: Bucket) -> None:
        flat = self._poll(lambda: self._read(bucket), f"bucket {bucket.index}'s file did not come")
        self.last_arrival_at = time.monotonic()
        expected = self._expected(bucket)
        if expected is not None:
            h = BucketHasher()
            h.update(flat)
            check_digest(bucket.index, expected, h.digest())  # DataLoss: nothing of the bucket is used
            self.buckets_verified += 1
        named = [(name, t.to(self.device)) for name, t in tensor_views(flat, bucket.tensors)]
        if self.streaming:
            self.wrote_served = True
            with self.target.weights_lock():
                self.tensors_applied += self.target.load_weights(self.worker, named)
        else:
            self.staged.append(named)  # views of this bucket's own buffer, kept until Complete
        self.bytes_done += bucket.size_bytes
        self.buckets_done += 1
        self.on_event(self)

    def apply_swaps(self) -> int:
        """Nothing to swap: the tensors read are copied into the served ones."""
        return 0

    def release(self, reuse: bool) -> None:
        """Let go of the tensors read."""
        self.staged = []


# --------------------------------------------------------------------------------------------- the part


@dataclass(frozen=True)
class SpoolTransport:
    """The spool, both halves (a :class:`~wsync_grpc.transports.TransportPart`), under ``TRANSPORT_CUDA_IPC``.

    Attributes:
        corrupt: a test hook for the trainer half (see :class:`SpoolSender`); ``None``: none.
    """

    kind: Transport = Transport.CUDA_IPC
    needs_group: bool = False
    engine_builds_buckets: bool = False
    corrupt: int | None = None

    def check_header(self, h: UpdateHeader) -> UpdateHeader:
        """A spool update is flattened and declares every bucket at Prepare.

        Raises:
            InvalidArgument: SPOOL_LAYOUT, SPOOL_INCREMENTAL.
        """
        if h.layout is not Layout.FLATTENED:
            raise InvalidArgument("SPOOL_LAYOUT", "a spool update carries flattened buckets only")
        if h.incremental:
            raise InvalidArgument("SPOOL_INCREMENTAL", "a spool update declares every bucket at Prepare")
        return h

    def check_update(self) -> None:
        """``Update`` may declare the buckets' digests (no bucket: :meth:`check_header` refused incremental)."""

    def plan(
        self, header: UpdateHeader, validator: UpdateValidator, buckets: list[Bucket], context: PlanContext
    ) -> PlannedUpdate:
        """The stream's header and buckets as they are: the receivers find the files by the update's id.

        Raises:
            InvalidArgument: SPOOL_PIECES, a bucket holds a piece of a tensor (a sharded trainer's).
        """
        if any(t.piece is not None for b in buckets for t in b.tensors):
            raise InvalidArgument("SPOOL_PIECES", "a spool update carries whole tensors only")
        return PlannedUpdate(header, buckets)

    def receiver(self, site: ReceiveSite, plan: ReceivePlan) -> Receiver:
        """A :class:`SpoolReceiver` for the worker at ``site``."""
        return SpoolReceiver(site, plan)

    def sender(self, site: SendSite) -> TransportSender:
        """A :class:`SpoolSender`."""
        return SpoolSender(site, self.corrupt)


PART = SpoolTransport()
"""What ``wsync_grpc.transports.transport_for`` reads once the registry names this module."""
