"""Prompts and generated text of the reference engine: the tokenizer, one caller at a time.

:class:`PromptCodec` turns a user prompt into token ids (through the chat
template) and generated token ids back into text, serialising every use of
the tokenizer with its own lock (the innermost in the engine's lock order).
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class PromptCodec:
    """A Hugging Face tokenizer behind a lock.

    Args:
        tokenizer: the model's tokenizer; its chat template, if it has one,
            is applied to prompts unless ``raw``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._lock = threading.Lock()

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of ``prompt``: the chat template's user turn plus generation prompt unless ``raw``."""
        with self._lock:
            if raw or not self._has_chat_template:
                ids = self._tokenizer(prompt)["input_ids"]
            else:
                text = self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
                )
                ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens skipped."""
        with self._lock:
            text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return str(text)


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
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
