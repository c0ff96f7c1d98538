"""A sharded trainer's rank as a Ray actor, for the Ray tests: FSDP2 over a toy policy with a synthetic model's
tensors, its group and its client formed through Ray (:mod:`wsync_grpc.ray.ranks`).

Ray's workers cannot import ``tests/``: a test registers this module with ``ray.cloudpickle.register_pickle_by_value``
so that :class:`Rank` travels by value; it refers to nothing else of ``tests/``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.ray import EngineHandle, TrainerRendezvous, join_trainer_group, sharded_trainer_client


class Policy(nn.Module):
    """Parameters named and shaped as the synthetic ``preset``'s tensors (float32, seed 0)."""

    def __init__(self, preset: str) -> None:
        super().__init__()
        synthetic.register_parameters(self, synthetic.build(preset, seed=0, dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        return torch.stack([(p - 0.1).square().mean() for p in self.parameters()]).sum()


class Rank:
    """One FSDP2 rank: joins the trainer's group through the rendezvous, builds its client from the handles."""

    def __init__(
        self, rendezvous: TrainerRendezvous, rank: int, handles: list[EngineHandle], preset: str, **options: Any
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        self.master = join_trainer_group(rendezvous, rank, timeout_s=60)
        self.model = Policy(preset)
        fully_shard(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.client = sharded_trainer_client(handles, master_address=self.master, **options)

    def where(self) -> dict[str, Any]:
        import ray

        return {"rank": self.client.rank, "master": self.master, "node": ray.get_runtime_context().get_node_id()}

    def train_step(self) -> float:
        loss = self.model()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.item())

    def sync(self, version: str, mode: str = "direct") -> dict[str, Any]:
        r = self.client.sync(self.model.named_parameters(), version, mode=mode)  # type: ignore[arg-type]
        return {"engines": sorted(r.engines), "excluded": sorted(r.excluded), "rejoined": list(r.rejoined)}

    def catch_up(self, mode: str = "direct") -> list[str]:
        r = self.client.catch_up(self.model.named_parameters(), mode=mode)  # type: ignore[arg-type]
        return sorted(r.engines) if r is not None else []

    def targets(self) -> list[str]:
        return list(self.client.client.targets)

    def sums(self) -> dict[str, str]:
        """Collective: the SHA-256 of every whole tensor (``full_tensor()`` on every rank)."""
        return {n: tensor_sha256(p.full_tensor()) for n, p in self.model.named_parameters()}  # type: ignore[operator]

    def close(self) -> None:
        self.client.close()
