"""The specs of the parameters an engine serves: what an update may carry, tensor by tensor.

:class:`ParamSpec` sits below the engine interface (:mod:`wsync_grpc.core.engine`, which names it
in :meth:`~wsync_grpc.core.engine.Engine.parameter_specs` and re-exports it) so that what only
describes tensors (LoRA adapters' specs, :mod:`wsync_grpc.core.lora`; the metadata validation,
:mod:`wsync_grpc.core.validation`) does not depend on the engine interface, which depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """One named tensor an update may carry.

    Attributes:
        name: canonical parameter name (Hugging Face naming).
        dtype: the dtype the engine serves it in.
        shape: its full (unsharded) shape, as the trainer sends it.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size in the served dtype, in bytes."""
        return self.numel * self.dtype.itemsize
