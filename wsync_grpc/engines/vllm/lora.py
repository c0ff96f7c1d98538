"""LoRA adapters on a vLLM engine, loaded through vLLM's own LoRA support so that the OpenAI API's ``model`` names them.

The servicer validates an adapter update against the base checkpoint
(:func:`~wsync_grpc.core.lora.adapter_param_specs`) and reads its PEFT
directory in the front process; :class:`VllmLoras` then writes exactly those
validated tensors as a PEFT directory of its own (so a trainer overwriting
its directory later cannot change what vLLM reloads after an LRU eviction)
and hands it to vLLM's ``OpenAIServingModels.load_lora_adapter``, the code
behind ``/v1/load_lora_adapter``. Each version gets a fresh ``lora_int_id``
(vLLM reuses a name's id for an in-place reload and keeps prefix-cache
blocks of the old weights, vllm#42125), loaded as ``name@version`` and then
served under the name, so that every answer's ``model`` field names the
adapter version that computed it; the requests still running with the old
id are aborted (vLLM cannot switch a running request's adapter), the old id
is removed from the engine and the prefix cache reset, so no token after the
replacement is computed with the old adapter. Needs vLLM started
with ``--enable-lora`` (and ``--max-lora-rank`` at least the adapters' rank).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from wsync_grpc.core.engine import ParamSpec
from wsync_grpc.core.lora import AdapterState, LinearShape, LoraSpec

log = logging.getLogger(__name__)


def lora_linears(specs: Mapping[str, ParamSpec]) -> dict[str, LinearShape]:
    """Module name -> shape of the checkpoint's linear layers an adapter may target (embeddings and head excluded)."""
    return {
        name.removesuffix(".weight"): LinearShape(spec.shape[1], spec.shape[0])
        for name, spec in specs.items()
        if name.endswith(".weight") and len(spec.shape) == 2 and "embed_tokens" not in name and "lm_head" not in name
    }


def served_name(name: str, version: str) -> str:
    """``name@version``: what vLLM answers made with adapter ``name`` at ``version`` carry in their ``model`` field.

    Requests name the adapter alone; the answer names the exact version that
    computed it (as OpenAI answers name the model snapshot behind an alias).
    """
    return f"{name}@{version}"


class VllmLoras:
    """The adapters of one vLLM engine (front process, on the engine client's loop).

    Args:
        client: vLLM's engine client (``add_lora``/``remove_lora``, ``reset_prefix_cache``).
        model: the base model's name in vLLM (``--model``), written into each adapter's config.

    Attributes:
        serving_models: vLLM's ``OpenAIServingModels`` of the API server, once it exists; adapters load
            through it so that the OpenAI ``model`` field resolves them.
    """

    def __init__(self, client: Any, model: str) -> None:
        self.client = client
        self.serving_models: Any = None
        self._model = model
        self._dir = Path(tempfile.mkdtemp(prefix="wsync-lora-"))
        self._served: dict[str, tuple[AdapterState, Path]] = {}
        self._retired: Path | None = None
        self._next = 0

    @property
    def enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (started with ``--enable-lora``, with an API server)."""
        return getattr(self.client.vllm_config, "lora_config", None) is not None and self.serving_models is not None

    @property
    def max_rank(self) -> int:
        """``--max-lora-rank``; 0 when LoRA is off."""
        config = getattr(self.client.vllm_config, "lora_config", None)
        return 0 if config is None else int(config.max_lora_rank)

    async def load(self, spec: LoraSpec, version: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Serve ``tensors`` as adapter ``spec`` at ``version`` (replacing one of that name); tensors loaded.

        Loaded by vLLM's ``load_lora_adapter`` under a fresh LoRA id as
        ``name@version`` (:func:`served_name`, what answers report in their
        ``model`` field), then the name is pointed at it in one step (no request
        finds the name missing); requests still running with the old id are
        aborted, the old id removed, the prefix cache reset.

        Raises:
            ValueError: vLLM refused the adapter; the old one, if any, keeps serving untouched.
        """
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        path = self._write(spec, tensors)
        models = self.serving_models
        versioned = served_name(spec.name, version)
        answer = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=versioned, lora_path=str(path)))
        if not isinstance(answer, str):  # an ErrorResponse
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"vLLM refused adapter {spec.name!r}: {getattr(answer, 'error', answer)}")
        async with models.lora_resolver_lock[spec.name]:
            old = models.lora_requests.get(spec.name)
            models.lora_requests[spec.name] = models.lora_requests.pop(versioned)
        if old is not None:
            await self._retire(int(old.lora_int_id))
        await self.client.reset_prefix_cache()
        targets = (spec.target_regex,) if spec.target_regex else spec.target_modules
        previous = self._served.get(spec.name)
        self._served[spec.name] = (AdapterState(spec.name, version, spec.rank, spec.alpha, targets, len(tensors)), path)
        if previous is not None:
            self._forget(previous[1])
        return len(tensors)

    async def unload(self, name: str) -> tuple[str, int] | None:
        """Stop serving adapter ``name``: ``(its version, requests aborted)``, or ``None`` if not served."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        served = self._served.pop(name, None)
        if served is None:
            return None
        lora_id = self._lora_id(name)
        await self.serving_models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        aborted = 0 if lora_id is None else await self._retire(lora_id)
        self._forget(served[1])
        return served[0].version, aborted

    async def _retire(self, lora_id: int) -> int:
        """Abort the requests running with LoRA id ``lora_id`` and remove it from the engine; requests aborted."""
        states = self.client.output_processor.request_states
        running = [rid for rid, st in states.items() if st.lora_request and st.lora_request.lora_int_id == lora_id]
        if running:
            await self.client.abort(running, internal=True)
        await self.client.remove_lora(lora_id)
        return len(running)

    def _forget(self, path: Path) -> None:
        """Delete the directory of a version no longer served, one replacement later.

        A request that resolved the old version just before it was replaced
        may still ask a worker to load it from its path.
        """
        if self._retired is not None:
            shutil.rmtree(self._retired, ignore_errors=True)
        self._retired = path

    def _lora_id(self, name: str) -> int | None:
        """vLLM's LoRA id of adapter ``name`` in the serving models; ``None`` when it has none."""
        request = self.serving_models.lora_requests.get(name)
        return None if request is None else int(request.lora_int_id)

    def adapters(self) -> list[AdapterState]:
        """The adapters served, by name."""
        return [self._served[n][0] for n in sorted(self._served)]

    def _write(self, spec: LoraSpec, tensors: Sequence[tuple[str, torch.Tensor]]) -> Path:
        """The validated tensors as a PEFT directory of the engine's own."""
        path = self._dir / f"{spec.name}-{self._next}"
        self._next += 1
        path.mkdir()
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self._model,
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "target_modules": spec.target_regex or list(spec.target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors}, str(path / "adapter_model.safetensors"))
        return path
