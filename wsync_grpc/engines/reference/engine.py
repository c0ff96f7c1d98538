"""The reference engine: a Hugging Face causal LM and its tokenizer behind :class:`Engine`.

:class:`ReferenceEngine` serves the model's weights to wsync (specs, aliases,
loads, version tags) and its generation API (prompts, submit, generate); the
queue and pause state are an :class:`~wsync_grpc.engines.reference.admission.Admission`,
the decode loop a :class:`~wsync_grpc.engines.reference.scheduler.Scheduler`, the
tokenizer a :class:`~wsync_grpc.engines.reference.prompts.PromptCodec`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from wsync_grpc.core.engine import ParamSpec, PauseMode, PauseOutcome
from wsync_grpc.core.lora import AdapterState, LinearShape, LoraSpec
from wsync_grpc.engines.reference.admission import Admission
from wsync_grpc.engines.reference.lora import LoraSlots
from wsync_grpc.engines.reference.prompts import PromptCodec, eos_token_ids
from wsync_grpc.engines.reference.requests import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TIMEOUT_S,
    GenerationHandle,
    GenerationResult,
)
from wsync_grpc.engines.reference.scheduler import Scheduler
from wsync_grpc.engines.reference.weights import ParameterSummary, collect_weights

log = logging.getLogger(__name__)


class ReferenceEngine:
    """A causal LM served in-process by one generation thread, admission controlled by wsync.

    Implements :class:`wsync_grpc.core.engine.Engine` (structurally). One
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

    Raises:
        ValueError: ``max_running`` < 1.

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
        self._name = name or type(model).__name__
        self._tensors, self._specs, self._aliases = collect_weights(model)
        self._lora = LoraSlots(model)
        first = next(iter(self._tensors.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        config = getattr(model, "config", None)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._eos_ids = eos_token_ids(model, tokenizer)
        self._codec = PromptCodec(tokenizer)
        self._admission = Admission(max_running, self._codec.decode)
        self._scheduler = Scheduler(self._admission, self._forward, self._eos_ids, self._name)
        log.info("reference engine %s serving %s on %s", self._name, self.parameter_summary(), self._device)

    @classmethod
    def from_pretrained(
        cls, model: str | None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> ReferenceEngine:
        """Load ``model`` with :func:`wsync_grpc.engines.models.load_causal_lm` and serve it.

        Args:
            model: ``None`` or ``"smollm2"`` for the embedded
                SmolLM2-135M-Instruct, else a local Hugging Face directory.
            dtype: the dtype to serve the parameters in.
            device: the device to serve them on (the engine's one worker).

        Raises:
            FileNotFoundError: no such model (see ``load_causal_lm``).
            NotACausalLM: not a causal LM, or weights missing, mismatched or unused (a ValueError).
            ImportError: the ``engine`` extra is not installed.
        """
        from wsync_grpc.engines.models import load_causal_lm

        lm, tokenizer, name = load_causal_lm(model, dtype)
        return cls(lm.to(device), tokenizer, name=name)

    # -- Engine: weights ---------------------------------------------------------

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

    def weights_lock(self) -> AbstractContextManager[None]:
        """Hold the lock every inference step runs under (reentrant; :meth:`Scheduler.weights_lock`).

        A holder waits for the step in progress, if any, then no step runs
        until it lets go; waiting holders go before the next step.
        """
        return self._scheduler.weights_lock()

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
        """The served tensor of canonical ``name`` (:class:`~wsync_grpc.core.engine.InPlaceReceive`).

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
        self._scheduler.set_weight_version(version)

    @property
    def weight_version(self) -> str:
        """The weight version the next steps are tagged with (``""`` until the first update)."""
        return self._scheduler.weight_version

    def parameter_summary(self) -> ParameterSummary:
        """Number of canonical tensors, elements and bytes of the served weights."""
        return ParameterSummary.of(self._specs)

    # -- LoraAdapters ---------------------------------------------------------------------

    def lora_linears(self) -> Mapping[str, LinearShape]:
        """Module name -> shape of every linear module of the model (what an adapter may target)."""
        return self._lora.linears

    def lora_max_rank(self) -> int:
        """The largest ``min(in_features, out_features)`` of the model's linear modules: an adapter of a higher
        rank is no more expressive than a full-rank update of every module it targets, only larger (PEFT itself
        would serve any rank, at the memory it claims)."""
        return max((min(s.in_features, s.out_features) for s in self._lora.linears.values()), default=0)

    def load_adapter(self, spec: LoraSpec, version: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Serve ``tensors`` as LoRA adapter ``spec`` with PEFT (:class:`LoraSlots`), replacing one of that name.

        Requests running with the replaced adapter recompute their context with
        the new one at their next step. The caller holds :meth:`weights_lock`.

        Raises:
            ValueError: tensors PEFT does not take; the old adapter keeps serving.
        """
        n = self._lora.load(spec, version, tensors)
        self._scheduler.flush_adapter(spec.name)
        return n

    def unload_adapter(self, name: str) -> tuple[str, int] | None:
        """Stop serving adapter ``name``; ``(its version, requests aborted)``, ``None`` if not served.

        The caller holds :meth:`weights_lock`.
        """
        version = self._lora.unload(name)
        return None if version is None else (version, self._scheduler.abort_adapter(name))

    def adapters(self) -> list[AdapterState]:
        """The adapters served, by name."""
        return self._lora.adapters()

    def adapter_tensors(self, name: str) -> Mapping[str, torch.Tensor]:
        """Adapter ``name``'s served tensors in PEFT's naming.

        Raises:
            UnknownAdapter: not served.
        """
        with self.weights_lock():
            return {n: t.detach().clone() for n, t in self._lora.tensors(name).items()}

    # -- Engine: admission -------------------------------------------------------

    def pause(self, mode: PauseMode, timeout: float) -> PauseOutcome:
        """Stop admission; abort, drain or freeze the requests in flight per ``mode`` (:meth:`Admission.pause`).

        Returns the requests aborted, drained or now frozen by this call. ``timeout``
        bounds the WAIT drain and the step KEEP waits for, in seconds.

        Raises:
            TimeoutError: the wait did not end within ``timeout``; the engine stays paused.
        """
        return self._admission.pause(mode, timeout)

    def resume(self) -> int:
        """Admit requests again (vLLM's ``/resume``); return how many frozen requests continue.

        Resuming a serving engine does nothing and returns 0.
        """
        return self._admission.resume()

    def is_paused(self) -> bool:
        """Whether admission is paused."""
        return self._admission.is_paused()

    def pause_mode(self) -> PauseMode | None:
        """The mode of the pause in force, or ``None`` when serving."""
        return self._admission.pause_mode()

    def flush_cache(self) -> None:
        """Drop every KV cache: each admitted request recomputes its whole context at its next step
        (:meth:`Scheduler.flush_cache`). The engine keeps no prefix cache."""
        self._scheduler.flush_cache()

    def request_counts(self) -> tuple[int, int]:
        """``(running, waiting)``: admitted requests (frozen ones included) and queued ones."""
        return self._admission.request_counts()

    # -- generation API -----------------------------------------------------------------

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of ``prompt``: the chat template's user turn plus generation prompt unless ``raw``."""
        return self._codec.encode(prompt, raw)

    def submit(
        self,
        prompt: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        raw: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
        adapter: str | None = None,
    ) -> GenerationHandle:
        """Queue a greedy generation request and return at once.

        Args:
            prompt: the user message (non-empty).
            max_new_tokens: at most this many tokens are generated (>= 1).
            raw: feed ``prompt`` as-is, without the chat template.
            timeout: bound of the whole request, admission wait included, in
                seconds; past it the request is cancelled and
                :meth:`GenerationHandle.result` raises :class:`GenerationTimeout`.
            adapter: the LoRA adapter to generate with (``None``: the base model);
                unloaded while the request runs, it ends the request (ABORTED).

        Raises:
            UnknownAdapter: ``adapter`` is not served.
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
        if adapter is not None:
            self._lora.version(adapter)  # refuse an unknown adapter now; each step checks again
        return self._admission.submit(ids, max_new_tokens, timeout, adapter)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        raw: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
        adapter: str | None = None,
    ) -> GenerationResult:
        """:meth:`submit` and wait for the result (same arguments and errors, plus those of
        :meth:`GenerationHandle.result`)."""
        return self.submit(prompt, max_new_tokens, raw=raw, timeout=timeout, adapter=adapter).result()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the generation thread: queued requests fail with :class:`EngineClosed`,
        admitted ones end with finish reason ABORTED. Idempotent.

        Args:
            timeout: how long to wait for a step in progress to end, in seconds.
        """
        self._scheduler.close(timeout)

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _check_worker(self, worker: int) -> None:
        if worker != 0:
            raise IndexError(f"worker {worker} out of range: the reference engine has one worker")

    def _forward(self, new_ids: list[int], cache: Any, adapter: str | None) -> tuple[int, Any, str]:
        """Feed ``new_ids`` after ``cache`` (``None``: from scratch) with ``adapter``; runs under :meth:`weights_lock`.

        Returns:
            The greedy next token, the updated cache and the adapter's version (``""`` for the base model).

        Raises:
            UnknownAdapter: the adapter is not served any more.
        """
        kwargs, version = self._lora.step_kwargs(adapter)
        input_ids = torch.tensor([new_ids], dtype=torch.long, device=self._device)
        with torch.no_grad():
            out = self._lora.model()(
                input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs
            )
        token = int(torch.argmax(out.logits[0, -1]).item())
        return token, out.past_key_values, version
