"""The reference engine: a Hugging Face causal LM served in-process, with wsync-controlled admission.

:class:`ReferenceEngine` implements :class:`wsync_grpc.core.adapter.EngineAdapter`
for any ``transformers`` causal LM plus its tokenizer (``wsync serve`` uses
the embedded SmolLM2-135M-Instruct, see :mod:`wsync_grpc.engines.models`). It exists
so that pause modes and weight swaps are observable in generated text; it is
not a fast server.

Generation model:

* One background thread owns inference. Requests are submitted with
  :meth:`ReferenceEngine.submit` (or the blocking
  :meth:`ReferenceEngine.generate`), wait in a FIFO queue for admission, and
  once admitted are decoded round-robin, one token per step, each with its own
  KV cache (``past_key_values``). Decoding is greedy and deterministic.
* Every step runs under :meth:`ReferenceEngine.weights_lock`, so no step ever
  sees a mix of old and new weights (``DESIGN.md`` section 8, invariant 1), and
  is tagged with the weight version in force when it ran.
* :meth:`ReferenceEngine.pause` / :meth:`ReferenceEngine.resume` follow vLLM's
  ``/pause?mode=abort|wait|keep`` and ``/resume``.

Thread-safety: every public method may be called from any thread. Internal
lock order is ``weights_lock`` -> state condition -> tokenizer lock; the
state condition is never held while waiting for ``weights_lock``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from wsync_grpc.core.adapter import ParamSpec, PauseMode, PauseOutcome

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 32
"""Tokens generated when a request does not say (``GenerateRequest.max_new_tokens`` = 0)."""

DEFAULT_TIMEOUT_S = 300.0
"""Bound of a whole request, admission wait included, in seconds, when it does not say."""

_STRICTNESS = {PauseMode.WAIT: 0, PauseMode.KEEP: 1, PauseMode.ABORT: 2}
"""How hard a pause mode holds back the requests in flight: WAIT lets them run,
KEEP stops them, ABORT ends them. Pausing a paused engine keeps the stricter."""


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
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    weight_versions: tuple[str, ...]
    queued_seconds: float
    generate_seconds: float
    prompt_tokens: int


@dataclass(frozen=True)
class ParameterSummary:
    """Size of the served weights, ties counted once.

    Attributes:
        tensors: number of canonical tensors (what an update carries).
        parameters: total number of elements.
        nbytes: total size in the served dtypes, in bytes.
        dtypes: the served dtype names, sorted.
    """

    tensors: int
    parameters: int
    nbytes: int
    dtypes: tuple[str, ...]

    def __str__(self) -> str:
        return (
            f"{self.tensors} tensors, {self.parameters / 1e6:.1f}M parameters, "
            f"{self.nbytes / 2**20:.1f} MiB ({'/'.join(self.dtypes)})"
        )


@dataclass(eq=False)
class _Request:
    """One request's state; every field is guarded by the engine's state condition."""

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    submitted: float
    deadline: float
    timeout: float
    admitted_at: float | None = None
    generated: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    cache: Any = None
    cached_len: int = 0
    cache_epoch: int = -1
    finished: bool = False
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class GenerationHandle:
    """A submitted request (like a ``concurrent.futures.Future``).

    Obtained from :meth:`ReferenceEngine.submit`.
    """

    def __init__(self, engine: ReferenceEngine, request: _Request) -> None:
        self._engine = engine
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
        return self._req.done.wait(None if timeout is None else _bounded(timeout))

    @property
    def admitted(self) -> bool:
        """Whether the request has left the admission queue."""
        with self._engine._cond:
            return self._req.admitted_at is not None

    @property
    def tokens_generated(self) -> int:
        """Number of tokens generated so far."""
        with self._engine._cond:
            return len(self._req.generated)

    def wait_for_tokens(self, n: int, timeout: float) -> bool:
        """Wait until at least ``n`` tokens were generated or the request ended.

        Returns:
            ``True`` when ``n`` tokens exist, ``False`` on timeout (seconds) or
            when the request ended with fewer.
        """
        deadline = time.monotonic() + timeout
        with self._engine._cond:
            while len(self._req.generated) < n and not self._req.finished:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._engine._cond.wait(_bounded(remaining))
            return len(self._req.generated) >= n

    def cancel(self) -> bool:
        """End the request now with finish reason ABORTED (and its partial output, if admitted).

        Returns:
            ``True`` if this call ended it, ``False`` if it had already ended.
        """
        return self._engine._cancel(self._req)

    def result(self) -> GenerationResult:
        """Wait for the request's end, bounded by the timeout it was submitted with.

        Raises:
            GenerationTimeout: the timeout passed; the request is cancelled.
            EngineClosed: the engine closed before it ran.
            RuntimeError: the forward pass failed (the cause is chained).
        """
        req = self._req
        if not req.done.wait(_bounded(req.deadline - time.monotonic())):
            self._engine._expire(req)
        req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result


class ReferenceEngine:
    """A causal LM served in-process by one generation thread, admission controlled by wsync.

    Implements :class:`wsync_grpc.core.adapter.EngineAdapter` (structurally). One
    worker: the device the model lives on.

    Args:
        model: a ``transformers`` causal LM (``model(input_ids=...,
            past_key_values=..., use_cache=True, logits_to_keep=1)`` must
            return ``logits`` of shape ``(1, n, vocab)`` and ``past_key_values``).
            It is put in eval mode with gradients disabled.
        tokenizer: its tokenizer; the chat template is applied to prompts
            unless ``raw`` (or when the tokenizer has none).
        name: the model name for logs and status.
        max_running: at most this many requests are admitted at once; the
            others wait in the queue.

    Parameter naming: canonical names are Hugging Face's, in
    ``state_dict()`` order; a tensor reachable under several names (tied
    embeddings) has one canonical name, the first :meth:`torch.nn.Module.named_parameters`
    yields, and the others are :meth:`aliases`. Non-persistent buffers
    (rotary ``inv_freq``) are not weights and are not listed.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, name: str = "", max_running: int = 8) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        model.eval()
        model.requires_grad_(False)
        self._model = model
        self._tokenizer = tokenizer
        self._name = name or type(model).__name__
        self._max_running = max_running
        self._tensors, self._specs, self._aliases = _collect_weights(model)
        first = next(iter(self._tensors.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        config = getattr(model, "config", None)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._eos_ids = _eos_token_ids(model, tokenizer)
        self._has_chat_template = bool(getattr(tokenizer, "chat_template", None))

        self._weights = threading.RLock()
        self._tok_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        # State below is guarded by self._cond.
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._rr = 0
        self._paused = False
        self._mode: PauseMode | None = None
        self._stepping: _Request | None = None
        self._writers = 0
        self._version = ""
        self._cache_epoch = 0
        self._closed = False
        self._next_id = 0
        self._thread = threading.Thread(target=self._loop, name=f"wsync-generate-{self._name}", daemon=True)
        self._thread.start()
        log.info("reference engine %s serving %s on %s", self._name, self.parameter_summary(), self._device)

    @classmethod
    def from_pretrained(cls, model: str | None, dtype: torch.dtype = torch.float32) -> ReferenceEngine:
        """Load ``model`` with :func:`wsync_grpc.engines.models.load_causal_lm` and serve it.

        Args:
            model: ``None`` or ``"smollm2"`` for the embedded
                SmolLM2-135M-Instruct, else a local Hugging Face directory.
            dtype: the dtype to serve the parameters in.

        Raises:
            FileNotFoundError: no such model (see ``load_causal_lm``).
            ImportError: the ``engine`` extra is not installed.
        """
        from wsync_grpc.engines.models import load_causal_lm

        lm, tokenizer, name = load_causal_lm(model, dtype)
        return cls(lm, tokenizer, name=name)

    # -- EngineAdapter ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The model name given at construction (e.g. ``"SmolLM2-135M-Instruct"``)."""
        return self._name

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """Canonical name -> spec (served dtype, full shape) of every weight, in model order."""
        return dict(self._specs)

    def aliases(self) -> Mapping[str, str]:
        """Alias name -> canonical name for tied tensors.

        E.g. ``{"lm_head.weight": "model.embed_tokens.weight"}`` for SmolLM2.
        """
        return dict(self._aliases)

    def worker_devices(self) -> Sequence[torch.device]:
        """One worker: the device the model lives on."""
        return [self._device]

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

    def load_weights(self, worker: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(name, tensor)`` pairs into the served weights (``Tensor.copy_``: dtype and device convert).

        Names may be canonical or aliases. The caller holds
        :meth:`weights_lock` or has frozen the engine (pause KEEP, WAIT or ABORT).

        Returns:
            The number of tensors loaded.

        Raises:
            IndexError: ``worker`` is not 0.
            KeyError: unknown name.
            ValueError: shape mismatch (nothing after it is loaded).
        """
        self._check_worker(worker)
        n = 0
        with torch.no_grad():
            for name, tensor in tensors:
                target = self._tensors[self._aliases.get(name, name)]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} does not match the served {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                n += 1
        return n

    def receive_target(self, worker: int, name: str) -> torch.Tensor | None:
        """The served tensor of canonical ``name`` (:class:`~wsync_grpc.core.adapter.InPlaceReceive`).

        Streaming updates receive straight into it: the servicer freezes
        generation (pause KEEP) for the whole of a streaming update, and no
        step runs while the engine is frozen.

        Raises:
            IndexError: ``worker`` is not 0.
        """
        self._check_worker(worker)
        return self._tensors.get(name)

    def get_weight(self, name: str) -> torch.Tensor:
        """The served tensor ``name`` (canonical or alias), sharing storage with the model.

        Raises:
            KeyError: unknown name.
        """
        try:
            return self._tensors[self._aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"unknown parameter {name!r}") from None

    def set_weight_version(self, version: str) -> None:
        """Tag the next inference steps with ``version`` (called under :meth:`weights_lock`)."""
        with self._cond:
            self._version = version

    @property
    def weight_version(self) -> str:
        """The weight version the next steps are tagged with (``""`` until the first update)."""
        with self._cond:
            return self._version

    def pause(self, mode: PauseMode, timeout: float) -> PauseOutcome:
        """Stop admission and handle the requests in flight (vLLM's ``/pause?mode=abort|wait|keep``).

        * ABORT: every admitted request (running or frozen) ends at once with
          finish reason ABORTED and its partial output; does not wait for the
          generation loop (which may be blocked on :meth:`weights_lock`).
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
        with self._cond:
            current = self._mode if self._paused else None
            if current is not None and _STRICTNESS[current] > _STRICTNESS[mode]:
                mode = current
            self._paused = True
            self._mode = mode
            self._cond.notify_all()
            if mode is PauseMode.ABORT:
                aborted = list(self._running)
                for req in aborted:
                    self._finish_locked(req, FinishReason.ABORTED)
                if aborted:
                    log.info("pause(abort): aborted %d requests", len(aborted))
                return PauseOutcome(aborted=len(aborted))
            if mode is PauseMode.KEEP:
                while self._stepping is not None:
                    if not self._wait_locked(deadline):
                        raise TimeoutError(f"pause(keep): a decode step still running after {timeout:.3g} s")
                return PauseOutcome(frozen=len(self._running))
            inflight = list(self._running)
            while True:
                left = [r for r in inflight if not r.finished]
                if not left:
                    return PauseOutcome(drained=len(inflight))
                if self._paused and self._mode is PauseMode.KEEP:  # a concurrent KEEP froze them
                    return PauseOutcome(drained=len(inflight) - len(left), frozen=len(left))
                if not self._wait_locked(deadline):
                    raise TimeoutError(
                        f"pause(wait): {len(left)} of {len(inflight)} requests still running after "
                        f"{timeout:.3g} s; the engine stays paused"
                    )

    def resume(self) -> int:
        """Admit requests again (vLLM's ``/resume``); return how many frozen requests continue.

        Resuming a serving engine does nothing and returns 0.
        """
        with self._cond:
            if not self._paused:
                return 0
            frozen = len(self._running) if self._mode is PauseMode.KEEP else 0
            self._paused = False
            self._mode = None
            self._cond.notify_all()
            return frozen

    def is_paused(self) -> bool:
        """Whether admission is paused."""
        with self._cond:
            return self._paused

    def pause_mode(self) -> PauseMode | None:
        """The mode of the pause in force, or ``None`` when serving."""
        with self._cond:
            return self._mode if self._paused else None

    def flush_cache(self) -> None:
        """Drop every KV cache: each admitted request recomputes its whole context at its next step.

        Frozen requests thereby continue with a context computed entirely by
        the current weights (SGLang's ``flush_cache`` after a weight update).
        The engine keeps no prefix cache.
        """
        with self._cond:
            self._cache_epoch += 1
            for req in self._running:
                req.cache = None
                req.cached_len = 0

    def request_counts(self) -> tuple[int, int]:
        """``(running, waiting)``: admitted requests (frozen ones included) and queued ones."""
        with self._cond:
            return len(self._running), len(self._waiting)

    # -- generation API -----------------------------------------------------------------

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of ``prompt``: the chat template's user turn plus generation prompt unless ``raw``."""
        with self._tok_lock:
            if raw or not self._has_chat_template:
                ids = self._tokenizer(prompt)["input_ids"]
            else:
                text = self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
                )
                ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def submit(
        self,
        prompt: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        raw: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> GenerationHandle:
        """Queue a greedy generation request and return at once.

        Args:
            prompt: the user message (non-empty).
            max_new_tokens: at most this many tokens are generated (>= 1).
            raw: feed ``prompt`` as-is, without the chat template.
            timeout: bound of the whole request, admission wait included, in
                seconds; past it the request is cancelled and
                :meth:`GenerationHandle.result` raises :class:`GenerationTimeout`.

        Raises:
            ValueError: empty prompt, ``max_new_tokens`` < 1, ``timeout`` <= 0,
                or prompt plus ``max_new_tokens`` beyond the model's context.
            EngineClosed: the engine is closed.
        """
        if not prompt:
            raise ValueError("prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        ids = self.encode_prompt(prompt, raw)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        if self._max_positions is not None and len(ids) + max_new_tokens > self._max_positions:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's context of {self._max_positions} tokens"
            )
        now = time.monotonic()
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            req = _Request(
                id=self._next_id,
                prompt_ids=ids,
                max_new_tokens=max_new_tokens,
                submitted=now,
                deadline=now + timeout,
                timeout=timeout,
            )
            self._next_id += 1
            self._waiting.append(req)
            self._cond.notify_all()
        return GenerationHandle(self, req)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        raw: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> GenerationResult:
        """:meth:`submit` and wait for the result (same arguments and errors, plus those of
        :meth:`GenerationHandle.result`)."""
        return self.submit(prompt, max_new_tokens, raw=raw, timeout=timeout).result()

    def parameter_summary(self) -> ParameterSummary:
        """Number of canonical tensors, elements and bytes of the served weights."""
        specs = self._specs.values()
        return ParameterSummary(
            tensors=len(self._specs),
            parameters=sum(s.numel for s in specs),
            nbytes=sum(s.nbytes for s in specs),
            dtypes=tuple(sorted({str(s.dtype).removeprefix("torch.") for s in specs})),
        )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the generation thread: queued requests fail with :class:`EngineClosed`,
        admitted ones end with finish reason ABORTED. Idempotent.

        Args:
            timeout: how long to wait for a step in progress to end, in seconds.
        """
        with self._cond:
            if not self._closed:
                self._closed = True
                while self._waiting:
                    req = self._waiting.popleft()
                    self._fail_locked(req, EngineClosed("the engine closed before the request was admitted"))
                for req in list(self._running):
                    self._finish_locked(req, FinishReason.ABORTED)
                self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _check_worker(self, worker: int) -> None:
        if worker != 0:
            raise IndexError(f"worker {worker} out of range: the reference engine has one worker")

    def _wait_locked(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(_bounded(remaining))
        return True

    def _finish_locked(self, req: _Request, reason: FinishReason) -> None:
        if req.finished:
            return
        now = time.monotonic()
        admitted = req.admitted_at if req.admitted_at is not None else now
        with self._tok_lock:
            text = self._tokenizer.decode(req.generated, skip_special_tokens=True)
        req.result = GenerationResult(
            text=str(text),
            token_ids=tuple(req.generated),
            finish_reason=reason,
            weight_versions=tuple(req.versions),
            queued_seconds=admitted - req.submitted,
            generate_seconds=now - admitted,
            prompt_tokens=len(req.prompt_ids),
        )
        self._end_locked(req)

    def _fail_locked(self, req: _Request, error: BaseException) -> None:
        if req.finished:
            return
        req.error = error
        self._end_locked(req)

    def _end_locked(self, req: _Request) -> None:
        req.finished = True
        req.cache = None
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        req.done.set()
        self._cond.notify_all()

    def _cancel(self, req: _Request) -> bool:
        with self._cond:
            if req.finished:
                return False
            self._finish_locked(req, FinishReason.ABORTED)
            return True

    def _expire(self, req: _Request) -> None:
        with self._cond:
            self._expire_locked(req)

    def _expire_locked(self, req: _Request) -> None:
        if req.finished:
            return
        if req.admitted_at is None:
            why = f"engine paused ({self._mode.value})" if self._paused and self._mode else "engine busy"
            msg = f"request not admitted within its timeout of {req.timeout:.3g} s: {why}"
        else:
            msg = (
                f"request did not finish within its timeout of {req.timeout:.3g} s "
                f"({len(req.generated)} of {req.max_new_tokens} tokens generated)"
            )
        self._fail_locked(req, GenerationTimeout(msg, admitted=req.admitted_at is not None))

    def _loop(self) -> None:
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
                self._closed = True
                for r in list(self._waiting) + list(self._running):
                    self._fail_locked(r, EngineClosed("the generation loop died; see the engine log"))
            raise

    def _next_locked(self) -> _Request | None:
        """Admit what may be admitted and pick the next request to step; ``None`` once closed."""
        while True:
            if self._closed:
                return None
            now = time.monotonic()
            for r in [r for r in (*self._waiting, *self._running) if r.deadline <= now]:
                self._expire_locked(r)
            if not self._paused:
                while self._waiting and len(self._running) < self._max_running:
                    r = self._waiting.popleft()
                    r.admitted_at = now
                    self._running.append(r)
            frozen = self._paused and self._mode is PauseMode.KEEP
            if self._running and not frozen and self._writers == 0:
                self._rr %= len(self._running)
                req = self._running[self._rr]
                self._rr += 1
                return req
            pending = [r.deadline for r in (*self._waiting, *self._running)]
            self._cond.wait(_bounded(min(pending) - now + 0.001) if pending else None)

    def _step(self, req: _Request) -> None:
        """Run one decode step of ``req`` under the weights lock and record its token."""
        with self._weights:
            with self._cond:
                if req.finished or self._closed or (self._paused and self._mode is PauseMode.KEEP):
                    return
                self._stepping = req
                version = self._version
                epoch = self._cache_epoch
                cache = req.cache if req.cache_epoch == epoch else None
                start = req.cached_len if cache is not None else 0
                context = req.prompt_ids + req.generated
            error: Exception | None = None
            token = -1
            new_cache: Any = None
            try:
                token, new_cache = self._forward(context[start:], cache)
            except Exception as exc:
                error = exc
            with self._cond:
                self._stepping = None
                self._cond.notify_all()
                if req.finished:  # aborted, cancelled or expired during the step
                    return
                if error is not None:
                    log.exception("decode step of request %d failed", req.id, exc_info=error)
                    self._fail_locked(req, RuntimeError(f"decode step failed: {error}"))
                    return
                if epoch == self._cache_epoch:
                    req.cache, req.cache_epoch, req.cached_len = new_cache, epoch, len(context)
                else:  # flushed during the step: recompute next time
                    req.cache, req.cached_len = None, 0
                req.generated.append(token)
                if not req.versions or req.versions[-1] != version:
                    req.versions.append(version)
                if token in self._eos_ids:
                    self._finish_locked(req, FinishReason.STOP)
                elif len(req.generated) >= req.max_new_tokens:
                    self._finish_locked(req, FinishReason.LENGTH)

    def _forward(self, new_ids: list[int], cache: Any) -> tuple[int, Any]:
        """Feed ``new_ids`` after ``cache`` (``None``: from scratch).

        Returns:
            The greedy next token and the updated cache.
        """
        input_ids = torch.tensor([new_ids], dtype=torch.long, device=self._device)
        with torch.no_grad():
            out = self._model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = int(torch.argmax(out.logits[0, -1]).item())
        return token, out.past_key_values


def _bounded(seconds: float) -> float:
    """``seconds`` clipped to what ``threading`` waits accept (0 to ``threading.TIMEOUT_MAX``)."""
    return min(max(0.0, seconds), threading.TIMEOUT_MAX)


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    """Identity of the memory a tensor views: two names with the same key are one tied tensor."""
    if t.numel() == 0 or t.device.type == "meta":
        return ("id", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _collect_weights(
    model: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, ParamSpec], dict[str, str]]:
    """Canonical name -> tensor, canonical name -> spec, alias -> canonical, in ``state_dict`` order.

    The canonical name of a tied tensor is the first name
    ``named_parameters(remove_duplicate=False)`` yields for it; persistent
    buffers (part of ``state_dict``) count as weights, non-persistent ones not.
    """
    canonical_of: dict[tuple[object, ...], str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical_of.setdefault(_storage_key(p), name)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    entries = list(model.state_dict(keep_vars=True).items())
    seen = {name for name, _ in entries}
    entries += [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if n not in seen]
    for name, t in entries:
        key = _storage_key(t)
        canonical = canonical_of.setdefault(key, name)
        if canonical == name:
            tensors[name] = t.data
        else:
            aliases[name] = canonical
    for alias, canonical in aliases.items():  # a tied name ordered before its canonical one
        if canonical not in tensors:  # pragma: no cover - only for exotic modules
            raise RuntimeError(f"tied parameter {alias!r} -> {canonical!r} not found in state_dict")
    specs = {name: ParamSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    return tensors, specs, aliases


def _eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's plus the model's generation config's (an int or a list)."""
    ids: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return frozenset(ids)
