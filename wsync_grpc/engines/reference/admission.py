"""Admission of the reference engine: the request queue, the pause state, and how requests end.

:class:`Admission` holds the state every thread of the engine shares (the
FIFO of waiting requests, the admitted ones, the pause mode) under one
condition, and the rules that act on it: pause and resume (vLLM's
``/pause?mode=abort|wait|keep`` and ``/resume``), admission, cancel, expiry
and close. The decode loop (:class:`~wsync_grpc.engines.reference.scheduler.Scheduler`)
admits and steps requests through it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from wsync_grpc.core.engine import PauseMode, PauseOutcome
from wsync_grpc.engines.reference.requests import (
    EngineClosed,
    FinishReason,
    GenerationHandle,
    GenerationResult,
    GenerationTimeout,
    PendingRequest,
    bounded_timeout,
)

log = logging.getLogger(__name__)

_STRICTNESS = {PauseMode.WAIT: 0, PauseMode.KEEP: 1, PauseMode.ABORT: 2}
"""How hard a pause mode holds back the requests in flight: WAIT lets them run,
KEEP stops them, ABORT ends them. Pausing a paused engine keeps the stricter."""


class Admission:
    """The engine's request queue and pause state, guarded by one condition.

    Args:
        max_running: at most this many requests are admitted at once; the
            others wait in the queue.
        decode: token ids -> text (special tokens skipped), for the results;
            called with :attr:`cond` held.

    Attributes:
        cond: the state condition; every attribute below and every field of
            every request is guarded by it. Notified on every change.
        waiting: submitted requests not yet admitted, in FIFO order.
        running: admitted requests (frozen ones included), in admission order.
        paused: whether admission is paused.
        mode: the mode of the pause in force (meaningful only while ``paused``).
        stepping: the request whose decode step is running, set by the decode loop.
        closed: set once by :meth:`close` (or when the decode loop dies).
    """

    def __init__(self, max_running: int, decode: Callable[[list[int]], str]) -> None:
        self._max_running = max_running
        self._decode = decode
        self.cond = threading.Condition(threading.Lock())
        self.waiting: deque[PendingRequest] = deque()
        self.running: list[PendingRequest] = []
        self.paused = False
        self.mode: PauseMode | None = None
        self.stepping: PendingRequest | None = None
        self.closed = False
        self._next_id = 0

    def submit(
        self, ids: list[int], max_new_tokens: int, timeout: float, adapter: str | None = None
    ) -> GenerationHandle:
        """Queue a request for the prompt token ids ``ids``, bounded by ``timeout`` seconds from now.

        ``adapter`` names the LoRA adapter it runs with (``None``: the base model).

        Raises:
            EngineClosed: the engine is closed.
        """
        now = time.monotonic()
        with self.cond:
            if self.closed:
                raise EngineClosed("the engine is closed")
            req = PendingRequest(
                id=self._next_id,
                prompt_ids=ids,
                max_new_tokens=max_new_tokens,
                submitted=now,
                deadline=now + timeout,
                timeout=timeout,
                adapter=adapter,
            )
            self._next_id += 1
            self.waiting.append(req)
            self.cond.notify_all()
        return GenerationHandle(self, req)

    def pause(self, mode: PauseMode, timeout: float) -> PauseOutcome:
        """Stop admission and handle the requests in flight (vLLM's ``/pause?mode=abort|wait|keep``).

        * ABORT: every admitted request (running or frozen) ends at once with
          finish reason ABORTED and its partial output; does not wait for the
          generation loop (which may be blocked on the weights lock,
          :meth:`ReferenceEngine.weights_lock`).
        * WAIT: wait until every admitted request has finished.
        * KEEP: freeze the admitted requests between two decode steps; returns
          once no step is running. They keep their KV cache; :meth:`resume`
          continues them.

        Requests submitted while paused queue until :meth:`resume` (or their
        own timeout). Pausing a paused engine keeps the stricter of the two
        modes (WAIT < KEEP < ABORT) and applies it to what is left: ABORT after
        KEEP aborts the frozen requests; KEEP after a timed-out WAIT freezes the
        remaining ones; WAIT after KEEP leaves them frozen and counts them.

        Args:
            timeout: bound for the WAIT drain and for the step KEEP waits
                for, in seconds.

        Returns:
            Requests aborted, drained or now frozen by this call.

        Raises:
            TimeoutError: the wait did not end within ``timeout``; the engine
                stays paused and the requests left keep running (WAIT).
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self.cond:
            current = self.mode if self.paused else None
            if current is not None and _STRICTNESS[current] > _STRICTNESS[mode]:
                mode = current
            self.paused = True
            self.mode = mode
            self.cond.notify_all()
            if mode is PauseMode.ABORT:
                aborted = list(self.running)
                for req in aborted:
                    self.finish_locked(req, FinishReason.ABORTED)
                if aborted:
                    log.info("pause(abort): aborted %d requests", len(aborted))
                return PauseOutcome(aborted=len(aborted))
            if mode is PauseMode.KEEP:
                while self.stepping is not None:
                    if not self.wait_locked(deadline):
                        raise TimeoutError(f"pause(keep): a decode step still running after {timeout:.3g} s")
                return PauseOutcome(frozen=len(self.running))
            return self._drain_locked(deadline, timeout)

    def resume(self) -> int:
        """Admit requests again (vLLM's ``/resume``); return how many frozen requests continue.

        Resuming a serving engine does nothing and returns 0.
        """
        with self.cond:
            if not self.paused:
                return 0
            frozen = len(self.running) if self.mode is PauseMode.KEEP else 0
            self.paused = False
            self.mode = None
            self.cond.notify_all()
            return frozen

    def is_paused(self) -> bool:
        """Whether admission is paused."""
        with self.cond:
            return self.paused

    def pause_mode(self) -> PauseMode | None:
        """The mode of the pause in force, or ``None`` when serving."""
        with self.cond:
            return self.mode if self.paused else None

    def request_counts(self) -> tuple[int, int]:
        """``(running, waiting)``: admitted requests (frozen ones included) and queued ones."""
        with self.cond:
            return len(self.running), len(self.waiting)

    def close(self) -> None:
        """Close admission: queued requests fail with :class:`EngineClosed`, admitted ones end
        with finish reason ABORTED. Idempotent."""
        with self.cond:
            if not self.closed:
                self.closed = True
                while self.waiting:
                    req = self.waiting.popleft()
                    self.fail_locked(req, EngineClosed("the engine closed before the request was admitted"))
                for req in list(self.running):
                    self.finish_locked(req, FinishReason.ABORTED)
                self.cond.notify_all()

    def cancel(self, req: PendingRequest) -> bool:
        """End ``req`` with finish reason ABORTED; ``False`` if it had already ended."""
        with self.cond:
            if req.finished:
                return False
            self.finish_locked(req, FinishReason.ABORTED)
            return True

    def expire(self, req: PendingRequest) -> None:
        """Fail ``req`` with :class:`GenerationTimeout` unless it has ended."""
        with self.cond:
            self.expire_locked(req)

    # -- with cond held -----------------------------------------------------------------

    def frozen_locked(self) -> bool:
        """Whether a pause in KEEP mode holds the admitted requests between two steps."""
        return self.paused and self.mode is PauseMode.KEEP

    def admit_locked(self, now: float) -> None:
        """Expire the requests whose deadline passed, then admit from the queue unless paused."""
        for r in [r for r in (*self.waiting, *self.running) if r.deadline <= now]:
            self.expire_locked(r)
        if not self.paused:
            while self.waiting and len(self.running) < self._max_running:
                r = self.waiting.popleft()
                r.admitted_at = now
                self.running.append(r)

    def wait_locked(self, deadline: float) -> bool:
        """Wait on :attr:`cond` until notified or ``deadline`` (monotonic seconds); ``False`` once past it."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.cond.wait(bounded_timeout(remaining))
        return True

    def finish_locked(self, req: PendingRequest, reason: FinishReason) -> None:
        """End ``req`` with a :class:`GenerationResult` (its tokens so far) unless it has ended."""
        if req.finished:
            return
        now = time.monotonic()
        admitted = req.admitted_at if req.admitted_at is not None else now
        req.result = GenerationResult(
            text=self._decode(req.generated),
            token_ids=tuple(req.generated),
            finish_reason=reason,
            weight_versions=tuple(req.versions),
            adapter=req.adapter or "",
            adapter_versions=tuple(req.adapter_versions),
            queued_seconds=admitted - req.submitted,
            generate_seconds=now - admitted,
            prompt_tokens=len(req.prompt_ids),
        )
        self._end_locked(req)

    def fail_locked(self, req: PendingRequest, error: BaseException) -> None:
        """End ``req`` with ``error`` (raised by :meth:`GenerationHandle.result`) unless it has ended."""
        if req.finished:
            return
        req.error = error
        self._end_locked(req)

    def expire_locked(self, req: PendingRequest) -> None:
        """Fail ``req`` with :class:`GenerationTimeout` (saying why) unless it has ended."""
        if req.finished:
            return
        if req.admitted_at is None:
            why = f"engine paused ({self.mode.value})" if self.paused and self.mode else "engine busy"
            msg = f"request not admitted within its timeout of {req.timeout:.3g} s: {why}"
        else:
            msg = (
                f"request did not finish within its timeout of {req.timeout:.3g} s "
                f"({len(req.generated)} of {req.max_new_tokens} tokens generated)"
            )
        self.fail_locked(req, GenerationTimeout(msg, admitted=req.admitted_at is not None))

    def _drain_locked(self, deadline: float, timeout: float) -> PauseOutcome:
        """Pause WAIT: wait until the requests admitted now have finished, or a concurrent KEEP froze them.

        Raises:
            TimeoutError: ``deadline`` (monotonic seconds, ``timeout`` seconds after the call) passed.
        """
        inflight = list(self.running)
        while True:
            left = [r for r in inflight if not r.finished]
            if not left:
                return PauseOutcome(drained=len(inflight))
            if self.frozen_locked():  # a concurrent KEEP froze them
                return PauseOutcome(drained=len(inflight) - len(left), frozen=len(left))
            if not self.wait_locked(deadline):
                raise TimeoutError(
                    f"pause(wait): {len(left)} of {len(inflight)} requests still running after "
                    f"{timeout:.3g} s; the engine stays paused"
                )

    def _end_locked(self, req: PendingRequest) -> None:
        req.finished = True
        req.cache = None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.done.set()
        self.cond.notify_all()
