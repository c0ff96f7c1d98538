"""Prepare a staged update's processed weights beside the served model, then swap them in between two steps.

vLLM's layerwise reload turns each layer's checkpoint tensors into what the
layer serves (fused ``qkv_proj``, tensor-parallel slices, on CPU the
oneDNN-prepacked linear kernels) on the live layers, so the engine cannot
run a step from its start to its end. For a staged update the same work can
run beside the live model while the engine keeps generating:
:class:`ShadowUpdate` gives every layer a *shadow*, a shallow copy of the
layer with fresh parameters shaped as vLLM recorded them at load time; loads
the received tensors into the shadows through the model's own
``load_weights`` (every live parameter's ``weight_loader`` is pointed at its
shadow for the duration), then runs each layer's own
``quant_method.process_weights_after_loading`` on its shadow. At Complete
:meth:`ShadowUpdate.swap` copies the shadows' parameters into the live ones
(same addresses) and hands over what processing built (e.g. the CPU
``cpu_linear`` kernel): a few milliseconds between two steps instead of a
whole reload.

Runs in a vLLM worker process; :meth:`ShadowUpdate.prepare` on a thread of
its own (the received tensors are read, nothing live is written),
:meth:`ShadowUpdate.swap` on the worker's main thread between two steps.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

log = logging.getLogger(__name__)

_MODULE_STATE = ("_parameters", "_buffers", "_modules")


class ShadowUpdate:
    """One staged update's processed weights, built beside the live model.

    Args:
        model: the worker's model (as vLLM loaded it; its load-time metadata recorded).
        vllm_config: the engine's config (vLLM's loaders read it).
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.layers: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        """``(live layer, its shadow)`` for every layer with parameters."""
        self._shadow_of: dict[int, torch.Tensor] = {}  # id(live parameter) -> its shadow (shared when tied)

    def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format ``(name, tensor)`` pairs into shadows and process them (off the step loop).

        Raises:
            Exception: whatever vLLM's loaders or processing raise; the live model is untouched.
        """
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for layer in self.model.modules():
                if any(True for _ in layer.parameters(recurse=False)):
                    self.layers.append((layer, self._shadow(layer)))
            with self._loads_into_shadows():
                load: Any = self.model.load_weights
                load(iter(tensors))
            for _, shadow in self.layers:
                method = getattr(shadow, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    method.process_weights_after_loading(shadow)

    def _shadow(self, layer: torch.nn.Module) -> torch.nn.Module:
        """A shallow copy of ``layer`` whose parameters are new tensors shaped as vLLM first loaded them."""
        shadow = copy.copy(layer)
        shadow._parameters = {}
        shadow._buffers = dict(layer._buffers)
        shadow._modules = {}
        recorded, _ = get_layerwise_info(layer).restore_metadata
        for name, live in layer.named_parameters(recurse=False):
            if id(live) not in self._shadow_of:
                meta = recorded.get(name)
                # Same class (vLLM's parameter types) and attributes (weight_loader...) as at
                # load time, its loader bound to the live layer again (vLLM's own restore).
                fresh = materialize_meta_tensor(meta) if meta is not None else live.detach().clone()
                fresh = restore_layer_refs(fresh, layer)
                loader = _unwrapped(getattr(fresh, "weight_loader", None))
                if loader is not None:
                    fresh.weight_loader = loader  # type: ignore[attr-defined]
                self._shadow_of[id(live)] = fresh
            shadow._parameters[name] = self._shadow_of[id(live)]  # type: ignore[assignment]
        return shadow

    @contextmanager
    def _loads_into_shadows(self) -> Iterator[None]:
        """Point every live parameter's ``weight_loader`` at its shadow while the model loads."""
        saved: dict[int, tuple[torch.Tensor, Any]] = {}
        for layer, _ in self.layers:
            for live in layer.parameters(recurse=False):
                if id(live) in saved:
                    continue  # tied: one parameter in two layers
                shadow = self._shadow_of[id(live)]
                own = _unwrapped(getattr(live, "weight_loader", None))
                saved[id(live)] = (live, own)
                live.weight_loader = _redirect(own or getattr(shadow, "weight_loader", None), shadow)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for param, old in saved.values():
                if old is None:
                    param.__dict__.pop("weight_loader", None)
                else:
                    param.weight_loader = old  # type: ignore[attr-defined]

    def swap(self) -> None:
        """Serve the shadows: copy their parameters into the live ones and hand over what processing built.

        Runs between two steps. Parameters keep their addresses; an attribute
        that processing replaced on a shadow (the CPU ``cpu_linear`` kernel)
        replaces the live layer's.
        """
        with torch.no_grad():
            for layer, shadow in self.layers:
                for name, live in list(layer.named_parameters(recurse=False)):
                    new = getattr(shadow, name)
                    if new.shape == live.shape:
                        live.data.copy_(new)
                    else:
                        live.data = new.detach()
                for key, value in shadow.__dict__.items():
                    if key not in _MODULE_STATE and layer.__dict__.get(key) is not value:
                        layer.__dict__[key] = value
        self.layers, self._shadow_of = [], {}


def _unwrapped(loader: Any) -> Any:
    """``loader`` without the wrappers a layerwise reload leaves on the metadata vLLM recorded."""
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _redirect(loader: Any, shadow: torch.Tensor) -> Any:
    """``loader`` called with ``shadow`` in place of the parameter it is given."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    target = loader or default_weight_loader

    def load(param: torch.nn.Parameter, *args: Any, **kwargs: Any) -> Any:
        return target(shadow, *args, **kwargs)

    return load
