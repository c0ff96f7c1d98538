"""Generation requests of the reference engine: their state, results, errors and handles.

A request is submitted with :meth:`ReferenceEngine.submit`, which returns a
:class:`GenerationHandle`; it ends with a :class:`GenerationResult` (finish
reason :class:`FinishReason`) or an error (:class:`EngineClosed`,
:class:`GenerationTimeout`, or a ``RuntimeError`` when the forward pass failed).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_MAX_NEW_TOKENS = 32
"""Tokens generated when a request does not say (``GenerateRequest.max_new_tokens`` = 0)."""

DEFAULT_TIMEOUT_S = 300.0
"""Bound of a whole request, admission wait included, in seconds, when it does not say."""


class FinishReason(enum.Enum):
    """Why a generation ended (``wsync.v1.FinishReason``)."""

    STOP = "stop"
    """The model produced an end-of-sequence token."""
    LENGTH = "length"
    """``max_new_tokens`` were produced."""
    ABORTED = "aborted"
    """A pause in ABORT mode, :meth:`GenerationHandle.cancel` or :meth:`ReferenceEngine.close` ended it."""


class EngineClosed(RuntimeError):
    """The engine was closed before the request could run."""


class GenerationTimeout(TimeoutError):
    """A request did not finish within its own timeout.

    Attributes:
        admitted: ``False`` when it never left the admission queue (the
            engine stayed paused or busy), ``True`` when it timed out while
            generating (its partial output is dropped).
    """

    def __init__(self, message: str, *, admitted: bool) -> None:
        super().__init__(message)
        self.admitted = admitted


@dataclass(frozen=True)
class GenerationResult:
    """The outcome of one generation request (``wsync.v1.GenerateResponse``).

    Attributes:
        text: the decoded generated text, prompt excluded, special tokens skipped.
        token_ids: the generated token ids, the final end-of-sequence token
            included when ``finish_reason`` is STOP.
        finish_reason: why generation ended.
        weight_versions: the distinct weight versions the tokens were produced
            with, in order; ``""`` is the version the engine started with.
            Empty only when the request was aborted before its first token.
        queued_seconds: time from submission to admission, in seconds.
        generate_seconds: time from admission to the end, in seconds.
        prompt_tokens: length of the prompt after the chat template, in tokens.
        adapter: the LoRA adapter the request named; ``""`` for the base model.
        adapter_versions: the distinct versions of that adapter the tokens were produced with, in
            order (more than one when it was replaced mid-request); empty for the base model.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    weight_versions: tuple[str, ...]
    queued_seconds: float
    generate_seconds: float
    prompt_tokens: int
    adapter: str = ""
    adapter_versions: tuple[str, ...] = ()


@dataclass(eq=False)
class PendingRequest:
    """One request's state; every field is guarded by the engine's state condition (:attr:`Admission.cond`)."""

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    submitted: float
    deadline: float
    timeout: float
    admitted_at: float | None = None
    generated: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    adapter: str | None = None
    adapter_versions: list[str] = field(default_factory=list)
    cache: Any = None
    cached_len: int = 0
    cache_epoch: int = -1
    finished: bool = False
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class RequestQueue(Protocol):
    """What a :class:`GenerationHandle` uses of the engine's request queue
    (:class:`~wsync_grpc.engines.reference.admission.Admission`)."""

    cond: threading.Condition
    """The state condition every request field is guarded by."""

    def cancel(self, req: PendingRequest) -> bool:
        """End ``req`` now with finish reason ABORTED; ``False`` if it had already ended."""
        ...

    def expire(self, req: PendingRequest) -> None:
        """End ``req`` with :class:`GenerationTimeout` (its timeout passed)."""
        ...


class GenerationHandle:
    """A submitted request (like a ``concurrent.futures.Future``).

    Obtained from :meth:`ReferenceEngine.submit`.
    """

    def __init__(self, admission: RequestQueue, request: PendingRequest) -> None:
        self._admission = admission
        self._req = request

    @property
    def id(self) -> int:
        """The request id, unique within the engine."""
        return self._req.id

    def done(self) -> bool:
        """Whether the request has ended (result or error)."""
        return self._req.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: forever) for the end; return :meth:`done`."""
        return self._req.done.wait(None if timeout is None else bounded_timeout(timeout))

    @property
    def admitted(self) -> bool:
        """Whether the request has left the admission queue."""
        with self._admission.cond:
            return self._req.admitted_at is not None

    @property
    def tokens_generated(self) -> int:
        """Number of tokens generated so far."""
        with self._admission.cond:
            return len(self._req.generated)

    def wait_for_tokens(self, n: int, timeout: float) -> bool:
        """Wait until at least ``n`` tokens were generated or the request ended.

        Returns:
            ``True`` when ``n`` tokens exist, ``False`` on timeout (seconds) or
            when the request ended with fewer.
        """
        deadline = time.monotonic() + timeout
        cond = self._admission.cond
        with cond:
            while len(self._req.generated) < n and not self._req.finished:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                cond.wait(bounded_timeout(remaining))
            return len(self._req.generated) >= n

    def cancel(self) -> bool:
        """End the request now with finish reason ABORTED (and its partial output, if admitted).

        Returns:
            ``True`` if this call ended it, ``False`` if it had already ended.
        """
        return self._admission.cancel(self._req)

    def result(self) -> GenerationResult:
        """Wait for the request's end, bounded by the timeout it was submitted with.

        Raises:
            GenerationTimeout: the timeout passed; the request is cancelled.
            EngineClosed: the engine closed before it ran.
            RuntimeError: the forward pass failed (the cause is chained).
        """
        req = self._req
        if not req.done.wait(bounded_timeout(req.deadline - time.monotonic())):
            self._admission.expire(req)
        req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result


def bounded_timeout(seconds: float) -> float:
    """``seconds`` clipped to what ``threading`` waits accept (0 to ``threading.TIMEOUT_MAX``)."""
    return min(max(0.0, seconds), threading.TIMEOUT_MAX)
