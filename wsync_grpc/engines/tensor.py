"""An engine that serves a dict of named tensors and nothing else.

:class:`TensorEngine` implements :class:`~wsync_grpc.core.engine.Engine`
for a model that is just its weights: no generation loop, so pause and resume
only toggle admission and count no requests. It is what ``wsync serve
--synthetic`` runs for tests and benchmarks (models of chosen sizes with
realistic LLM tensor shapes, see :mod:`wsync_grpc.engines.synthetic`), and the
smallest example of an adapter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch

from wsync_grpc.core.engine import ParamSpec, PauseMode, PauseOutcome


class TensorEngine:
    """Serves ``tensors`` (name -> tensor, all on ``device``).

    Args:
        tensors: the served tensors; the dict is used as is (no copy).
        aliases: alias -> canonical name for tied tensors.
        name: engine name for logs and status.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        aliases: Mapping[str, str] | None = None,
        name: str = "tensors",
    ) -> None:
        self._tensors = tensors
        self._aliases = dict(aliases or {})
        self._name = name
        self._specs = {n: ParamSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()}
        devices = {t.device for t in tensors.values()}
        self._device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._paused: PauseMode | None = None
        self.weight_version = ""
        self.cache_flushes = 0
        """How many times :meth:`flush_cache` ran."""

    @property
    def name(self) -> str:
        """The engine name."""
        return self._name

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The served tensors (live, not copies)."""
        return self._tensors

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """Canonical name -> spec, in insertion order."""
        return self._specs

    def aliases(self) -> Mapping[str, str]:
        """Alias -> canonical name."""
        return self._aliases

    def worker_devices(self) -> Sequence[torch.device]:
        """One worker, on the tensors' device."""
        return [self._device]

    def weights_lock(self) -> AbstractContextManager[object]:
        """The lock held while weights change."""
        return self._lock

    def load_weights(self, worker: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the served one of the same canonical name (dtype converted)."""
        n = 0
        with torch.no_grad():
            for name, t in tensors:
                self._tensors[name].copy_(t)
                n += 1
        return n

    def receive_target(self, worker: int, name: str) -> torch.Tensor | None:
        """The served tensor ``name`` itself (:class:`~wsync_grpc.core.engine.InPlaceReceive`): nothing reads it."""
        return self._tensors.get(name)

    def swap_weights(self, worker: int, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Serve the given tensors' memory from now on (:class:`~wsync_grpc.core.engine.StorageSwap`).

        The served tensor objects stay the same (``Tensor.set_``): what holds
        them, this engine's dict included, sees the new values. Views taken
        of a served tensor before the swap keep the old memory, which is
        returned for reuse only when the served tensor covered all of it.
        """
        old: list[torch.Tensor] = []
        with torch.no_grad():
            for name, t in tensors:
                served = self._tensors[name]
                storage = served.untyped_storage()
                whole = served.storage_offset() == 0 and storage.nbytes() == served.numel() * served.element_size()
                served.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
                if whole:
                    old.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        return old

    def get_weight(self, name: str) -> torch.Tensor:
        """The served tensor ``name`` (canonical or alias). Raises KeyError if unknown."""
        return self._tensors[self._aliases.get(name, name)]

    def set_weight_version(self, version: str) -> None:
        """Record the served weight version."""
        self.weight_version = version

    def pause(self, mode: PauseMode, timeout: float) -> PauseOutcome:
        """Stop admission; there are never requests in flight to abort, drain or freeze."""
        with self._state_lock:
            if self._paused is None or mode == PauseMode.ABORT:
                self._paused = mode
        return PauseOutcome()

    def resume(self) -> int:
        """Admit again; no request was frozen."""
        with self._state_lock:
            self._paused = None
        return 0

    def is_paused(self) -> bool:
        """Whether admission is paused."""
        return self._paused is not None

    def pause_mode(self) -> PauseMode | None:
        """The pause mode in force."""
        return self._paused

    def flush_cache(self) -> None:
        """Nothing is cached; counts the call."""
        self.cache_flushes += 1

    def request_counts(self) -> tuple[int, int]:
        """No requests: ``(0, 0)``."""
        return (0, 0)
