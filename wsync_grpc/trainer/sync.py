"""One update broadcast from the trainer to every engine: plan, Prepare, send, commit.

Steps (:meth:`SyncRunner.run`): bucket planning from the update's
:class:`~wsync_grpc.trainer.source.WeightSource` metadata
(:class:`~wsync_grpc.trainer.planning.Planner`, no tensor's bytes read);
(re-)initializing a stale group; the streaming Prepare (header, then the
bucket messages) to every engine at once, each replying once its receivers
are armed; the send of every bucket by the trainer's
:class:`~wsync_grpc.trainer.sender.Sender`, the source asked for one bucket's
tensors at a time; Complete everywhere; per-engine results and timings. The
calls and the failure protocol are :class:`~wsync_grpc.trainer.protocol.UpdateProtocol`'s.

Digests (``ClientSettings.digests``): the sender hashes each bucket while it is on the wire and a
:class:`~wsync_grpc.trainer.digests.DigestCourier` declares the digest to every engine right away
(the header says ``digests_follow``); every digest is declared before Complete. A sender whose
ranks hash their own buckets before Prepare (a sharded trainer's direct send) puts them in the
bucket specs instead.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket, total_wire_bytes
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.trainer.digests import DigestCourier
from wsync_grpc.trainer.options import apply_mode_name, layout_name
from wsync_grpc.trainer.planning import Planner, set_spec_digests
from wsync_grpc.trainer.protocol import UpdateProtocol
from wsync_grpc.trainer.request import UpdateRequest
from wsync_grpc.trainer.results import TRAINER, EngineFailure, SyncProgress, SyncResult
from wsync_grpc.trainer.sender import Sender
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.source import WeightSource


class SyncRunner:
    """Runs one broadcast update at a time (the caller holds the client's op lock).

    Args:
        calls: the update's calls over the engines and its failure protocol.
        settings: the client's settings (the planner reads them at every plan).
        sender: which trainer rank sends which bytes.
        cancel_event: the client's cancel signal; set, it stops the send at its next wait.
    """

    def __init__(
        self, calls: UpdateProtocol, settings: ClientSettings, sender: Sender, cancel_event: threading.Event
    ) -> None:
        self._calls = calls
        self._settings = settings
        self._sender = sender
        self._cancel_event = cancel_event
        self._planner = Planner(settings)

    def run(self, source: WeightSource, request: UpdateRequest) -> SyncResult:
        """Send ``source``'s tensors to every engine as ``request`` says, as one trace.

        Raises:
            ValueError: nothing to send, or a planning error.
            SyncError: the update failed; it was abandoned on every engine.
            ClientError: the client was closed.
        """
        return self._calls.run(request, lambda: self._run(source, request))

    def _run(self, source: WeightSource, request: UpdateRequest) -> SyncResult:
        calls = self._calls
        t_plan = time.monotonic()
        calls.phase("plan")
        buckets, messages = self._planner.plan(source.metadata(), request.bucket_bytes, request.dtype, request.layout)
        if not buckets:
            raise ValueError("nothing to sync: no tensors given")
        wire_bytes = total_wire_bytes(buckets, request.layout)
        plan_s = time.monotonic() - t_plan
        request.report("planned")
        init_s, group = calls.ensure_group(request)
        up_front = self._digests_before_send(request, buckets, source) if self._settings.digests else {}
        set_spec_digests(messages, up_front or {})
        courier = calls.digest_courier(request) if up_front is None else None
        header = request.header(len(buckets), wire_bytes, digests_follow=courier is not None)
        prepared = calls.prepare(request, header, messages)
        c = calls.transfer_and_commit(
            request, prepared, lambda: self._send(request, group, buckets, source, wire_bytes, courier)
        )
        result = SyncResult(
            update_id=request.update_id,
            weight_version=request.weight_version,
            layout=layout_name(request.layout),
            apply_mode=apply_mode_name(request.apply_mode),
            bucket_count=len(buckets),
            tensor_count=sum(len(b.tensors) for b in buckets),
            payload_bytes=sum(b.payload_bytes for b in buckets),
            wire_bytes=wire_bytes,
            init_seconds=init_s,
            plan_seconds=plan_s,
            prepare_seconds=prepared.seconds,
            broadcast_seconds=c.transfer_s,
            pack_seconds=c.pack_s,
            complete_seconds=c.done - c.started,
            verify_seconds=c.verify_s,
            total_seconds=c.done - prepared.started,
            engines=c.results,
        )
        return calls.applied(request, result)

    def _digests_before_send(
        self, request: UpdateRequest, buckets: Sequence[Bucket], source: WeightSource
    ) -> Mapping[int, Digest] | None:
        """The digests the sender computed before Prepare (:meth:`Sender.digests_before_send`); ``None``: they follow.

        Raises:
            SyncError: a trainer rank failed while hashing (stage ``"prepare"``; no byte was sent).
        """
        try:
            return self._sender.digests_before_send(buckets, request.layout, source)
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, "digests", exc)
            raise self._calls.abandon(request, "prepare", {TRAINER: trainer}) from exc

    def _send(
        self,
        request: UpdateRequest,
        group: WeightSyncGroup,
        buckets: Sequence[Bucket],
        source: WeightSource,
        wire_bytes: int,
        courier: DigestCourier | None,
    ) -> float:
        """Send every bucket in the request's layout (``courier``: declaring each digest as it is hashed);
        returns the time spent packing, in seconds.

        Raises:
            SyncError: the trainer's send failed or was cancelled, or an engine refused a digest (stage
                ``"broadcast"``).
        """
        on_sent = None
        if request.progress is not None:
            progress, start = request.progress, time.monotonic()

            def on_sent(b: Bucket, sent: int) -> None:
                elapsed = time.monotonic() - start
                progress(SyncProgress(request.update_id, b.index + 1, len(buckets), sent, wire_bytes, elapsed))

        on_digest = courier.add if courier is not None else None
        try:
            pack_s = self._sender.send(group, buckets, request.layout, source, on_sent, self._cancel_event, on_digest)
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, "broadcast", exc)
            raise self._calls.abandon(request, "broadcast", {TRAINER: trainer}, broadcast_started=True) from exc
        except BaseException:  # KeyboardInterrupt and the like: clean up, then let it go
            self._calls.abandon(request, "broadcast", {}, broadcast_started=True)
            raise
        if courier is not None:  # every digest declared before Complete
            failures = courier.finish(self._settings.rpc_timeout_s)
            if failures:
                raise self._calls.abandon(request, "broadcast", failures, broadcast_started=True)
        return pack_s
