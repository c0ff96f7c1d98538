"""The decode loop of the reference engine: one thread that steps the admitted requests.

:class:`Scheduler` owns the generation thread and the weights lock. Each
step admits what :class:`~wsync_grpc.engines.reference.admission.Admission`
lets in, picks the next admitted request round-robin, and runs one decode
step of it under the weights lock, tagged with the weight version in force.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from wsync_grpc.engines.reference.admission import Admission
from wsync_grpc.engines.reference.requests import EngineClosed, FinishReason, PendingRequest, bounded_timeout

log = logging.getLogger(__name__)

Forward = Callable[[list[int], Any, str | None], tuple[int, Any, str]]
"""One decode step: ``(new token ids, KV cache or None, adapter or None) -> (greedy next token, updated cache,
the adapter's version)``; raises ``LookupError`` when the adapter is not served (the request is aborted)."""


class Scheduler:
    """The generation thread: admits, then decodes the admitted requests round-robin, one token per step.

    Args:
        admission: the request queue and pause state; its condition guards
            the state below too.
        forward: the model's decode step (:data:`Forward`); raising fails
            the request with a ``RuntimeError``.
        eos_ids: tokens that end a request with finish reason STOP.
        name: the model name, for the thread's name and logs.

    Each request keeps its own KV cache; :meth:`flush_cache` drops them all
    (a new cache epoch). Lock order: weights lock -> :attr:`Admission.cond`;
    the condition is never held while waiting for the weights lock.
    """

    def __init__(self, admission: Admission, forward: Forward, eos_ids: frozenset[int], name: str) -> None:
        self._admission = admission
        self._cond = admission.cond
        self._forward = forward
        self._eos_ids = eos_ids
        self._name = name
        self._weights = threading.RLock()
        # State below is guarded by self._cond.
        self._rr = 0
        self._writers = 0
        self._version = ""
        self._cache_epoch = 0
        self._thread = threading.Thread(target=self._loop, name=f"wsync-generate-{name}", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def weights_lock(self) -> Iterator[None]:
        """Hold the lock every inference step runs under (reentrant).

        A holder waits for the step in progress, if any, then no step runs
        until it lets go. Waiting holders take precedence over the generation
        loop's next step, so an update is never starved by a busy engine.
        """
        with self._cond:
            self._writers += 1
        try:
            self._weights.acquire()
        finally:
            with self._cond:
                self._writers -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            self._weights.release()

    def set_weight_version(self, version: str) -> None:
        """Tag the next inference steps with ``version`` (called under :meth:`weights_lock`)."""
        with self._cond:
            self._version = version

    @property
    def weight_version(self) -> str:
        """The weight version the next steps are tagged with (``""`` until the first update)."""
        with self._cond:
            return self._version

    def flush_cache(self) -> None:
        """Drop every KV cache: each admitted request recomputes its whole context at its next step.

        Frozen requests thereby continue with a context computed entirely by
        the current weights (SGLang's ``flush_cache`` after a weight update).
        The engine keeps no prefix cache.
        """
        with self._cond:
            self._cache_epoch += 1
            for req in self._admission.running:
                req.cache = None
                req.cached_len = 0

    def flush_adapter(self, name: str) -> None:
        """Drop the KV cache of every admitted request running with adapter ``name`` (it was replaced).

        Called under :meth:`weights_lock`: no step is in progress, and each such
        request recomputes its whole context with the new adapter at its next step.
        """
        with self._cond:
            for req in self._admission.running:
                if req.adapter == name:
                    req.cache, req.cached_len = None, 0

    def abort_adapter(self, name: str) -> int:
        """End every request (admitted or queued) naming adapter ``name`` with finish reason ABORTED; how many."""
        with self._cond:
            doomed = [r for r in (*self._admission.running, *self._admission.waiting) if r.adapter == name]
            for req in doomed:
                self._admission.finish_locked(req, FinishReason.ABORTED)
            self._cond.notify_all()
            return len(doomed)

    def close(self, timeout: float) -> None:
        """Stop the generation thread: queued requests fail with :class:`EngineClosed`,
        admitted ones end with finish reason ABORTED. Idempotent.

        Args:
            timeout: how long to wait for a step in progress to end, in seconds.
        """
        self._admission.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the generation thread ----------------------------------------------------------

    def _loop(self) -> None:
        adm = self._admission
        try:
            while True:
                with self._cond:
                    req = self._next_locked()
                if req is None:
                    return
                self._step(req)
        except BaseException:  # pragma: no cover - a bug; fail what is left rather than hang callers
            log.exception("generation loop of %s died", self._name)
            with self._cond:
                adm.closed = True
                for r in list(adm.waiting) + list(adm.running):
                    adm.fail_locked(r, EngineClosed("the generation loop died; see the engine log"))
            raise

    def _next_locked(self) -> PendingRequest | None:
        """Admit what may be admitted and pick the next request to step; ``None`` once closed."""
        adm = self._admission
        while True:
            if adm.closed:
                return None
            now = time.monotonic()
            adm.admit_locked(now)
            frozen = adm.frozen_locked()
            if adm.running and not frozen and self._writers == 0:
                self._rr %= len(adm.running)
                req = adm.running[self._rr]
                self._rr += 1
                return req
            pending = [r.deadline for r in (*adm.waiting, *adm.running)]
            self._cond.wait(bounded_timeout(min(pending) - now + 0.001) if pending else None)

    def _step(self, req: PendingRequest) -> None:
        """Run one decode step of ``req`` under the weights lock and record its token."""
        adm = self._admission
        with self._weights:
            with self._cond:
                if req.finished or adm.closed or adm.frozen_locked():
                    return
                adm.stepping = req
                version = self._version
                epoch = self._cache_epoch
                cache = req.cache if req.cache_epoch == epoch else None
                start = req.cached_len if cache is not None else 0
                context = req.prompt_ids + req.generated
            error: Exception | None = None
            token = -1
            new_cache: Any = None
            adapter_version = ""
            try:
                token, new_cache, adapter_version = self._forward(context[start:], cache, req.adapter)
            except Exception as exc:
                error = exc
            with self._cond:
                adm.stepping = None
                self._cond.notify_all()
                if req.finished:  # aborted, cancelled or expired during the step
                    return
                if isinstance(error, LookupError):  # its adapter was unloaded
                    adm.finish_locked(req, FinishReason.ABORTED)
                    return
                if error is not None:
                    log.exception("decode step of request %d failed", req.id, exc_info=error)
                    adm.fail_locked(req, RuntimeError(f"decode step failed: {error}"))
                    return
                if epoch == self._cache_epoch:
                    req.cache, req.cache_epoch, req.cached_len = new_cache, epoch, len(context)
                else:  # flushed during the step: recompute next time
                    req.cache, req.cached_len = None, 0
                req.generated.append(token)
                if not req.versions or req.versions[-1] != version:
                    req.versions.append(version)
                if req.adapter and (not req.adapter_versions or req.adapter_versions[-1] != adapter_version):
                    req.adapter_versions.append(adapter_version)
                if token in self._eos_ids:
                    adm.finish_locked(req, FinishReason.STOP)
                elif len(req.generated) >= req.max_new_tokens:
                    adm.finish_locked(req, FinishReason.LENGTH)
