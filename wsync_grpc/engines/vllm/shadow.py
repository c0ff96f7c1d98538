"""Prepare a staged update's processed weights beside the served model, then swap them in between two steps.

vLLM's layerwise reload turns each layer's checkpoint tensors into what the
layer serves (fused ``qkv_proj``, tensor-parallel slices, on CPU the
oneDNN-prepacked linear kernels) on the live layers, so the engine cannot
run a step from its start to its end. For a staged update the same work can
run beside the live model while the engine keeps generating:
:class:`ShadowUpdate` gives every layer a *shadow*, a shallow copy of the
layer with fresh parameters shaped as vLLM recorded them at load time; loads
each bucket's received tensors into the shadows as the bucket arrives,
through the model's own ``load_weights`` (every live parameter's
``weight_loader`` is pointed at its shadow for the duration), and runs a
layer's own ``quant_method.process_weights_after_loading`` on its shadow as
soon as the shadow's parameters are whole (counted as vLLM's layerwise
reload counts them, with its ``CopyCounter``). At Complete
:meth:`ShadowUpdate.swap` copies the shadows' parameters into the live ones
(same addresses) and hands over what processing built (e.g. the CPU
``cpu_linear`` kernel): a few milliseconds between two steps instead of a
whole reload.

Runs in a vLLM worker process; :meth:`ShadowUpdate.begin`, ``add`` and
``finish`` on a thread of its own (the received tensors are read, nothing live is written),
:meth:`ShadowUpdate.swap` on the worker's main thread between two steps.

The memory of the shadow parameters that nothing serves after a swap (those
copied into the live parameters, their storage held by no kernel) is kept in
:class:`SpareShadows` for the next staged update: a fresh copy of the model's
parameters would otherwise be written for the first time, a page fault every
4 KiB, while the buckets arrive.
"""

from __future__ import annotations

import copy
import functools
import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from vllm.model_executor.model_loader.reload.meta import CopyCounter, materialize_meta_tensor
from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

log = logging.getLogger(__name__)

_MODULE_STATE = ("_parameters", "_buffers", "_modules")


def _storage_holders(t: torch.Tensor) -> int:
    """How many tensors (and kernels holding one) share ``t``'s storage, ``t`` included.

    Read from the storage's reference count (``torch._C._storage_Use_Count``),
    so that a handle a C++ kernel keeps (a closure over ``t``, an unpacked
    weight kept by reference) counts too; the count of a tensor held once is
    subtracted. Where torch offers no such count, 2 (nothing is taken to be
    free).
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return 2
    return int(use_count(t.untyped_storage()._cdata)) - _held_once(use_count) + 1


@functools.cache
def _held_once(use_count: Any) -> int:
    """``use_count`` of a storage one tensor holds (read once per process)."""
    one = torch.empty(1)
    return int(use_count(one.untyped_storage()._cdata))


class SpareShadows:
    """Shadow parameter memory kept from one staged update for the next (a worker holds one).

    A shadow parameter whose values a swap copied into the live parameter
    and whose storage nothing else holds afterwards (no kernel built from it,
    see :func:`_storage_holders`) is kept, keyed by its live parameter; the
    next :class:`ShadowUpdate` loads into it instead of into new memory.
    Costs one copy of those parameters between updates (``nbytes``), kept
    through reloads of the live model (a streaming apply, vLLM's own flow):
    an entry whose live parameter was replaced or freed is never taken, so
    a staged update after a streaming one loads into written memory wherever
    the reload kept the parameter (a new allocation for the others).
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of parameter memory kept."""
        return sum(t.untyped_storage().nbytes() for _, t in self._kept.values())

    def keep(self, live: torch.Tensor, shadow: torch.Tensor) -> None:
        """Keep ``shadow``'s memory for ``live``'s next shadow."""
        self._kept[id(live)] = (weakref.ref(live), shadow.detach())

    def take(self, live: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
        """The memory kept for ``live``, if it has ``like``'s shape, strides, dtype and device; it is no longer kept."""
        entry = self._kept.pop(id(live), None)
        if entry is None or entry[0]() is not live:
            return None
        t = entry[1]
        same = t.shape == like.shape and t.stride() == like.stride() and t.dtype == like.dtype
        return t if same and t.device == like.device else None


class ShadowUpdate:
    """One staged update's processed weights, built beside the live model as its buckets arrive.

    :meth:`begin` gives every layer its shadow; :meth:`add` loads one
    bucket's tensors into the shadows and processes each layer whose
    parameters are then whole (a parameter two layers share, such as an LM
    head tied to the embeddings, has one shadow: both layers are whole once
    it is); :meth:`finish` processes the layers that received only part of
    their padded parameters and leaves out those that received nothing, so
    that what is left after the last byte is one bucket's loads and those
    layers.

    Args:
        model: the worker's model (as vLLM loaded it; its load-time metadata recorded).
        vllm_config: the engine's config (vLLM's loaders read it).
        spare: memory kept from the last swap, taken for the shadows and given
            back at :meth:`swap`; ``None`` to allocate every shadow afresh.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, spare: SpareShadows | None = None) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.spare = spare
        self.layers: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        """``(live layer, its shadow)`` for every layer with parameters."""
        self._shadow_of: dict[int, torch.Tensor] = {}  # id(live parameter) -> its shadow (shared when tied)
        self.reused_bytes = 0
        """Bytes of shadow memory taken from ``spare`` (already written once) rather than allocated."""
        self._loaded: dict[int, int] = {}  # id(shadow parameter) -> checkpoint elements copied into it
        self._processed: set[int] = set()  # id(shadow layer)

    def begin(self) -> None:
        """Give every layer with parameters its shadow (memory for a whole copy of the model's parameters)."""
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for layer in self.model.modules():
                if any(True for _ in layer.parameters(recurse=False)):
                    self.layers.append((layer, self._shadow(layer)))

    def add(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format ``(name, tensor)`` pairs into the shadows; process the layers now whole.

        Runs off the step loop (the received tensors are read, nothing live is written).

        Raises:
            Exception: whatever vLLM's loaders or processing raise; the live model is untouched.
        """
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            with self._loads_into_shadows():
                load: Any = self.model.load_weights
                load(iter(tensors))
            for _, shadow in self.layers:
                if id(shadow) not in self._processed and self._whole(shadow):
                    self._process(shadow)

    def finish(self) -> None:
        """Process every layer not processed yet; the shadows are then ready for :meth:`swap`.

        A layer none of whose parameters received a byte (an update of some
        tensors only) is left out of the swap: the live layer keeps serving
        what it serves, as vLLM's own reload keeps a layer it loaded nothing
        into (``finalize_layerwise_processing`` places its kernel tensors
        back). Its shadow was never written, so swapping it in would serve
        uninitialised memory. A layer that received part of its parameters
        (padding left out) is processed, as vLLM's reload processes it.

        Raises:
            Exception: whatever vLLM's processing raises; the live model is untouched.
        """
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            kept = []
            for live, shadow in self.layers:
                if id(shadow) not in self._processed:
                    if self._untouched(shadow):
                        continue
                    self._process(shadow)
                kept.append((live, shadow))
            self.layers = kept

    def _untouched(self, shadow: torch.nn.Module) -> bool:
        """Whether no checkpoint element was copied into any of ``shadow``'s parameters."""
        return all(self._loaded.get(id(p), 0) == 0 for p in shadow.parameters(recurse=False))

    def _whole(self, shadow: torch.nn.Module) -> bool:
        """Whether every checkpoint element of ``shadow``'s parameters was copied in (padding excluded)."""
        params = list(shadow.parameters(recurse=False))
        return all(self._loaded.get(id(p), 0) >= get_tensor_load_numel(p) for p in params)

    def _process(self, shadow: torch.nn.Module) -> None:
        self._processed.add(id(shadow))
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
                if meta is not None:
                    fresh = materialize_meta_tensor(meta)  # allocated, not yet written
                    kept = self.spare.take(live, fresh) if self.spare is not None else None
                    if kept is not None:
                        fresh.data = kept
                        self.reused_bytes += kept.untyped_storage().nbytes()
                else:
                    fresh = live.detach().clone()
                fresh = restore_layer_refs(fresh, layer)
                loader = _unwrapped(getattr(fresh, "weight_loader", None))
                if loader is not None:
                    fresh.weight_loader = loader
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
                live.weight_loader = self._redirect(own or getattr(shadow, "weight_loader", None), shadow)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for param, old in saved.values():
                if old is None:
                    param.__dict__.pop("weight_loader", None)
                else:
                    param.weight_loader = old  # type: ignore[attr-defined]

    def _redirect(self, loader: Any, shadow: torch.Tensor) -> Any:
        """``loader`` called with ``shadow`` in place of the parameter it is given, counting what it copies."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        target = loader or default_weight_loader
        cap = get_tensor_load_numel(shadow)

        def load(param: torch.nn.Parameter, *args: Any, **kwargs: Any) -> Any:
            with CopyCounter() as counter:
                out = target(shadow, *args, **kwargs)
            self._loaded[id(shadow)] = min(cap, self._loaded.get(id(shadow), 0) + int(counter.copied_numel))
            return out

        return load

    def swap(self) -> None:
        """Serve the shadows: copy their parameters into the live ones and hand over what processing built.

        Runs between two steps. Parameters keep their addresses where
        processing kept their shape and dtype (the values are copied); one
        that processing replaced (an emptied prepacked weight, a bias made
        float32) is replaced on the live layer too. An attribute that
        processing replaced on a shadow (the CPU ``cpu_linear`` kernel)
        replaces the live layer's. With :class:`SpareShadows`, the copied
        shadows that nothing holds afterwards are kept for the next update.
        """
        copied: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live parameter, the shadow copied into it)
        with torch.no_grad():
            for layer, shadow in self.layers:
                for name, live in list(layer.named_parameters(recurse=False)):
                    new = getattr(shadow, name)
                    if new.shape == live.shape and new.dtype == live.dtype:
                        live.data.copy_(new)
                        mine = self._shadow_of.get(id(live))
                        if new is mine and mine is not None:
                            copied.append((live, mine))
                    else:
                        live.data = new.detach()
                for key, value in shadow.__dict__.items():
                    if key not in _MODULE_STATE and layer.__dict__.get(key) is not value:
                        layer.__dict__[key] = value
        self.layers = []  # the shadow layers go; what they built now lives in the live layers
        if self.spare is not None:
            for target, kept in copied:
                if _storage_holders(kept) == 1:
                    self.spare.keep(target, kept)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("swapped; %d bytes of shadows reused, %d kept spare", self.reused_bytes, self.spare.nbytes)
        self._shadow_of, self._loaded, self._processed = {}, {}, set()


def _unwrapped(loader: Any) -> Any:
    """``loader`` without the wrappers a layerwise reload leaves on the metadata vLLM recorded."""
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader
