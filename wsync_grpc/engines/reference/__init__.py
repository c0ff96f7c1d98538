"""The reference engine: a Hugging Face causal LM served in-process, with wsync-controlled admission.

:class:`ReferenceEngine` implements :class:`wsync_grpc.core.engine.Engine`
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
  sees a mix of old and new weights, and is tagged with the weight version in
  force when it ran.
* :meth:`ReferenceEngine.pause` / :meth:`ReferenceEngine.resume` follow vLLM's
  ``/pause?mode=abort|wait|keep`` and ``/resume``.

Thread-safety: every public method may be called from any thread. Internal
lock order is ``weights_lock`` -> state condition -> tokenizer lock; the
state condition is never held while waiting for ``weights_lock``.

Modules:

* :mod:`~wsync_grpc.engines.reference.engine`: :class:`ReferenceEngine`, the
  adapter and generation API over the model, the admission and the scheduler.
* :mod:`~wsync_grpc.engines.reference.requests`: requests, results, errors,
  :class:`GenerationHandle`.
* :mod:`~wsync_grpc.engines.reference.admission`: the request queue and the
  pause state (the state condition); cancel, expiry, close.
* :mod:`~wsync_grpc.engines.reference.scheduler`: the generation thread, the
  decode loop and ``weights_lock``.
* :mod:`~wsync_grpc.engines.reference.prompts`: the tokenizer (chat template,
  decoding, end-of-sequence ids) behind its lock.
* :mod:`~wsync_grpc.engines.reference.weights`: canonical names, tied aliases,
  :class:`ParameterSummary`.
"""

from wsync_grpc.engines.reference.engine import ReferenceEngine
from wsync_grpc.engines.reference.requests import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TIMEOUT_S,
    EngineClosed,
    FinishReason,
    GenerationHandle,
    GenerationResult,
    GenerationTimeout,
)
from wsync_grpc.engines.reference.weights import ParameterSummary

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TIMEOUT_S",
    "EngineClosed",
    "FinishReason",
    "GenerationHandle",
    "GenerationResult",
    "GenerationTimeout",
    "ParameterSummary",
    "ReferenceEngine",
]
