"""The client's cancel signal, and the whole sync's deadline that sets it.

Every wait of an update (the send's collective waits, Prepare's and the verifying Complete's
checks) stops at the next check once the client's :class:`CancelSignal` is set: by
``TrainerClient.cancel()``, by a held ``Watch`` that ended (:mod:`~wsync_grpc.trainer.liveness`), or
by the sync's own deadline (``sync(..., timeout_s=...)``). A passed deadline stays set until the
sync ends (clearing the signal for a new group or attempt clears a cancel, never the deadline), and
:meth:`CancelSignal.bound` caps each call's timeout by the time left, so that a sync ends by its
deadline: abandoned everywhere (published nowhere) unless every engine had verified it. The applying
``Complete`` that follows every engine's verification is the commit: it is never cut short, so that
a staged update is published everywhere or nowhere.

Units: seconds.
"""

from __future__ import annotations

import threading
import time

from wsync_grpc.trainer.results import TRAINER, EngineFailure

MIN_CALL_S = 0.05
"""The shortest timeout :meth:`CancelSignal.bound` gives a call, in seconds (a call with none left fails at once)."""


def check_timeout(timeout_s: float | None) -> None:
    """Refuse a sync timeout that is not above 0 seconds (``None``: no deadline, accepted).

    Raises:
        ValueError: ``timeout_s`` is not above 0.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be above 0 seconds, got {timeout_s}")


class CancelSignal(threading.Event):
    """An event set by a cancel or by the running sync's deadline (the latter survives :meth:`clear`).

    Waits poll :meth:`is_set` (the send's sliced collective waits, the protocol's checks); the deadline's
    timer also sets the event itself, for waits that block on it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._timeout_s: float | None = None
        self._timer: threading.Timer | None = None

    def is_set(self) -> bool:
        """Whether a cancel was asked for or the running sync's deadline passed."""
        return super().is_set() or self.expired

    @property
    def expired(self) -> bool:
        """Whether the running sync has a deadline and it passed."""
        deadline = self._deadline
        return deadline is not None and time.monotonic() >= deadline

    @property
    def timeout_s(self) -> float | None:
        """The running sync's whole timeout, in seconds; ``None``: it has none."""
        return self._timeout_s

    def start(self, timeout_s: float | None) -> None:
        """Give the sync that starts now ``timeout_s`` seconds in all (``None``: no deadline).

        Raises:
            ValueError: ``timeout_s`` is not above 0.
        """
        check_timeout(timeout_s)
        with self._lock:
            self._stop_timer()
            self._timeout_s = timeout_s
            self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
            if timeout_s is not None:
                self._timer = threading.Timer(timeout_s, super().set)
                self._timer.daemon = True
                self._timer.name = "wsync-sync-deadline"
                self._timer.start()

    def end(self) -> None:
        """The sync ended: forget its deadline (a cancel asked for meanwhile stays until the next :meth:`clear`)."""
        with self._lock:
            expired = self.expired
            self._stop_timer()
            self._deadline = self._timeout_s = None
            if expired:
                super().clear()  # set by the deadline's timer, not by a cancel

    def bound(self, seconds: float) -> float:
        """``seconds`` capped by the time left before the deadline (at least :data:`MIN_CALL_S`), in seconds."""
        deadline = self._deadline
        if deadline is None:
            return seconds
        return max(MIN_CALL_S, min(seconds, deadline - time.monotonic()))

    def failure(self, rpc: str) -> EngineFailure:
        """Why the signal is set, as the trainer's failure at ``rpc`` (the step that saw it): the deadline
        (``DEADLINE_EXCEEDED``), or a cancel (``CANCELLED``)."""
        if self.expired:
            return EngineFailure(
                TRAINER, rpc, None, "DEADLINE_EXCEEDED", f"the sync's deadline of {self._timeout_s:g} s passed"
            )
        return EngineFailure(TRAINER, rpc, None, "CANCELLED", "cancel() was called")

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
