"""The reference engine's LoRA adapters, served with PEFT beside the base weights.

Every adapter is a PEFT LoRA adapter injected into the engine's model
(``peft.get_peft_model`` at the first load, ``add_adapter`` afterwards); a
decode step names the adapter of its request through PEFT's mixed-batch
``adapter_names`` (``"__base__"`` for the base model). Each load goes into a
fresh PEFT slot and only then replaces the adapter of that name, so a load
that fails leaves the old one serving; the replaced slot is deleted. When the
last adapter goes, PEFT's modules are removed again (``PeftModel.unload``):
the base model is back as it was, its parameters the same tensors throughout.

The base parameters are never copied or renamed: the engine's served tensors
(full-weight updates, checksums) stay valid while adapters come and go.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wsync_grpc.core.lora import AdapterState, LinearShape, LoraSpec, adapted_modules

log = logging.getLogger(__name__)

BASE = "__base__"
"""PEFT's name for "no adapter" in ``adapter_names``."""


class UnknownAdapter(LookupError):
    """A request named an adapter the engine does not serve (NOT_FOUND on the wire)."""


@dataclass
class _Slot:
    """One served adapter: its PEFT slot and what :meth:`LoraSlots.adapters` reports."""

    slot: str
    state: AdapterState


class LoraSlots:
    """The adapters of one model. Not thread-safe: the engine calls it under its weights lock.

    Args:
        model: the engine's causal LM (its linear modules are what adapters may target).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._base = model
        self._peft: Any = None
        self._served: dict[str, _Slot] = {}
        self._next = 0
        self.linears: dict[str, LinearShape] = {
            name: LinearShape(m.in_features, m.out_features)
            for name, m in model.named_modules()
            if type(m) is torch.nn.Linear
        }
        """Module name -> shape of every plain linear module of the base model."""

    def model(self) -> torch.nn.Module:
        """The module to run a step with: the base model, or PEFT's wrapper around it while adapters are served."""
        return self._base if self._peft is None else self._peft  # type: ignore[no-any-return]

    def step_kwargs(self, name: str | None) -> tuple[dict[str, Any], str]:
        """The forward's extra arguments for a request naming adapter ``name`` (``None``: base), and its version.

        Raises:
            UnknownAdapter: ``name`` is not served (any more).
        """
        if name is None:
            return ({"adapter_names": [BASE]} if self._peft is not None else {}), ""
        served = self._served.get(name)
        if served is None:
            raise UnknownAdapter(f"adapter {name!r} is not served")
        return {"adapter_names": [served.slot]}, served.state.version

    def version(self, name: str) -> str:
        """The version of adapter ``name``.

        Raises:
            UnknownAdapter: not served.
        """
        return self.step_kwargs(name)[1]

    def load(self, spec: LoraSpec, version: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Serve ``tensors`` as adapter ``spec`` (replacing one of that name); return how many were loaded.

        Raises:
            ValueError: a tensor PEFT does not expect, or one it expects missing; nothing changed.
        """
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        slot = f"wsync{self._next}"
        self._next += 1
        # A regex was matched at Prepare (RE2, bounded time): PEFT gets the modules it matched, never the
        # regex, which it would match again with Python's re (unbounded backtracking).
        targets = list(spec.target_modules) or adapted_modules([n for n, _ in tensors])
        alpha: Any = int(spec.alpha) if spec.alpha.is_integer() else spec.alpha  # PEFT types it int, uses alpha / r
        config = LoraConfig(r=spec.rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
        if self._peft is None:
            self._peft = get_peft_model(self._base, config, adapter_name=slot)
        else:
            self._peft.add_adapter(slot, config)
        self._peft.eval()
        try:
            with torch.no_grad():
                result: Any = set_peft_model_state_dict(self._peft, dict(tensors), adapter_name=slot)
            missing = [k for k in result.missing_keys if f".{slot}." in k]
            if result.unexpected_keys or missing:
                raise ValueError(
                    f"adapter {spec.name!r}: unexpected tensors {list(result.unexpected_keys)[:3]}, "
                    f"missing {missing[:3]}"
                )
        except BaseException:
            self._delete(slot)
            raise
        old = self._served.get(spec.name)
        targets_shown = (spec.target_regex,) if spec.target_regex else spec.target_modules
        state = AdapterState(spec.name, version, spec.rank, spec.alpha, targets_shown, len(tensors))
        self._served[spec.name] = _Slot(slot, state)
        if old is not None:
            self._delete(old.slot)
        log.info("adapter %s version %s served (%d tensors, rank %d)", spec.name, version, len(tensors), spec.rank)
        return len(tensors)

    def unload(self, name: str) -> str | None:
        """Stop serving adapter ``name``; its version, or ``None`` if it was not served."""
        served = self._served.pop(name, None)
        if served is None:
            return None
        self._delete(served.slot)
        log.info("adapter %s version %s unloaded", name, served.state.version)
        return served.state.version

    def adapters(self) -> list[AdapterState]:
        """The adapters served, by name."""
        return [self._served[n].state for n in sorted(self._served)]

    def tensors(self, name: str) -> Mapping[str, torch.Tensor]:
        """Adapter ``name``'s tensors in PEFT's naming (for checks and tests).

        Raises:
            UnknownAdapter: not served.
        """
        from peft import get_peft_model_state_dict

        served = self._served.get(name)
        if served is None:
            raise UnknownAdapter(f"adapter {name!r} is not served")
        out: dict[str, torch.Tensor] = get_peft_model_state_dict(self._peft, adapter_name=served.slot)
        return out

    def _delete(self, slot: str) -> None:
        """Remove PEFT slot ``slot``; with the last one, PEFT's modules go too."""
        if self._peft is None:
            return
        remaining = [s for s in self._peft.peft_config if s != slot]
        if not remaining:
            self._peft.unload()  # the base model back, with its own modules and parameters
            self._peft = None
            return
        self._peft.delete_adapter(slot)
        self._peft.set_adapter(remaining[0])  # PEFT keeps a deleted active adapter's name otherwise
        self._peft.eval()
