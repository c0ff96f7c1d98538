"""A fleet on Ray: 3 engines and 2 FSDP2 trainer ranks as Ray actors; train, sync, lose an engine, go on.

    python examples/ray_fleet.py                  # starts a local Ray cluster of its own
    python examples/ray_fleet.py --address auto   # or joins a running one (wsync installed on every node)

The driver launches three ``wsync serve --synthetic tiny`` engines as actors over a placement group
(``wsync_grpc.ray.launch_engines``, Ray restarts each once), and two trainer ranks as actors of its own
(``Rank`` below, as a framework's worker would be): they form their gloo group through Ray (rank 0's address
goes through a ``TrainerRendezvous``), shard a toy policy with the engines' tensor names and shapes with
FSDP2, and build their ``ShardedTrainerClient`` from the engines' handles. Then, as a framework does: a
train step on every rank, a sync on every rank, three times. It kills one engine's actor (``ray.kill``):
the next sync, under ``FleetPolicy.exclude``, leaves it out; Ray restarts it on a new port, and ``catch_up``
finds it there (its actor says where) and brings it to the fleet's version. Each engine's weights are
checked against the trainer's, bit for bit. Everything it started ends with it.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import ray
import torch
from torch import nn

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.ray import (
    EngineHandle,
    EngineSpec,
    TrainerRendezvous,
    join_trainer_group,
    launch_engines,
    sharded_trainer_client,
    stop_engines,
)
from wsync_grpc.trainer import FleetPolicy

PRESET = "tiny"
"""The engines' synthetic model (20 tensors, 0.6 MB in float32); the trainer's policy has its names and shapes."""
RANKS = 2
ENGINES = 3
STEPS = 3


class Policy(nn.Module):
    """A toy policy whose parameters are the engines' tensors (Llama names and shapes of ``PRESET``)."""

    def __init__(self) -> None:
        super().__init__()
        synthetic.register_parameters(self, synthetic.build(PRESET, seed=0, dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        return torch.stack([(p - 0.1).square().mean() for p in self.parameters()]).sum()


class Rank:
    """One trainer rank, as a framework's own actor: its FSDP2 model, its optimizer, its wsync client."""

    def __init__(self, rendezvous: TrainerRendezvous, rank: int, handles: list[EngineHandle]) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        master = join_trainer_group(rendezvous, rank)  # rank 0's address, shared through Ray
        self.model = Policy()
        fully_shard(self.model)  # every parameter becomes a DTensor, Shard(0) over the two ranks
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        # resolve_timeout_s: how long a sync waits for a restarting engine before leaving it out.
        self.client = sharded_trainer_client(
            handles, master_address=master, policy=FleetPolicy.exclude(min_engines=2), resolve_timeout_s=1.0
        )
        self.master = master

    def address(self) -> str:
        return self.master

    def train_step(self) -> float:
        loss = self.model()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.item())

    def sync(self, version: str) -> dict[str, list[str]]:
        r = self.client.sync(self.model.named_parameters(), version, mode="direct")
        return {"engines": sorted(r.engines), "excluded": sorted(r.excluded), "rejoined": sorted(r.rejoined)}

    def catch_up(self) -> list[str]:
        r = self.client.catch_up(self.model.named_parameters(), mode="direct")
        return sorted(r.engines) if r is not None else []

    def check(self) -> list[str]:
        """Collective: the whole tensors; rank 0 compares every engine's version and checksums with them."""
        whole = {n: tensor_sha256(p.full_tensor()) for n, p in self.model.named_parameters()}  # type: ignore[operator]
        if self.client.rank != 0:
            return []
        problems = []
        for target, sums in self.client.checksums().items():
            served = {c.name: c.sha256 for c in sums.checksums}
            differ = [n for n, s in whole.items() if served.get(n) != s]
            if differ:
                problems.append(f"{target}: {len(differ)} tensors differ from the trainer's")
        return problems

    def versions(self) -> dict[str, str]:
        """Rank 0 (not collective): each engine's weight version, at the targets rank 0's roster knows now."""
        return {t: s.weight_version for t, s in self.client.status().items()}

    def close(self) -> None:
        self.client.close()


def on_both(ranks: list[ray.actor.ActorHandle], method: str, *args: object) -> list[object]:
    """Call ``method`` on every rank at once (the client's calls are collective) and wait for all."""
    return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=300)


def wait_gone(target: str, timeout_s: float = 10.0) -> None:
    """Until nothing accepts a connection at ``target`` (its engine ended with its actor)."""
    host, port = target.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except OSError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{target} still answers {timeout_s:g} s after its actor was killed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a running Ray cluster (e.g. 'auto'); default: start a local one")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:  # a small local cluster: 80 MiB of object store (Ray's default takes 30% of the RAM), no dashboard
        ray.init(
            num_cpus=ENGINES + RANKS,
            object_store_memory=80 * 1024**2,
            include_dashboard=False,
            log_to_driver=False,
        )
    print(f"ray: {len(ray.nodes())} node(s), {ray.cluster_resources().get('CPU', 0):g} CPUs")
    spec = EngineSpec(serve_args=("--synthetic", PRESET, "--dtype", "float32", "--grace", "1"), insecure=True)
    handles = launch_engines(ENGINES, spec, strategy="SPREAD", max_restarts=1, name="ray-fleet")
    ranks: list[ray.actor.ActorHandle] = []
    try:
        for h in handles:
            print(f"engine {h.name}: {h.target} on node {h.node_id[:8]}")
        rendezvous = TrainerRendezvous.create(RANKS)
        actor = ray.remote(num_cpus=1)(Rank)
        ranks = [actor.remote(rendezvous, r, handles) for r in range(RANKS)]
        addresses = on_both(ranks, "address")
        print(f"trainer: {RANKS} FSDP2 ranks, their group formed through Ray (rank 0 at {addresses[0]})")

        for step in range(1, STEPS + 1):
            losses = on_both(ranks, "train_step")
            r = on_both(ranks, "sync", f"step-{step}")[0]
            print(f"step {step}: loss {losses[0]:.4f}, synced into {len(r['engines'])} engines")  # type: ignore[index,arg-type]

        victim = handles[-1]
        old = victim.current_target()
        ray.kill(victim.actor, no_restart=False)  # Ray restarts it (max_restarts=1), on a new port
        wait_gone(old)
        print(f"killed {victim.name} (ray.kill): {old} gone")

        step = STEPS + 1
        losses = on_both(ranks, "train_step")
        r = on_both(ranks, "sync", f"step-{step}")[0]
        print(
            f"step {step}: loss {losses[0]:.4f}, synced into {len(r['engines'])} engines, "  # type: ignore[arg-type]
            f"left out {', '.join(r['excluded'])}"  # type: ignore[index]
        )
        start = time.monotonic()
        new = victim.current_target(timeout_s=120)
        print(f"restarted by Ray: {victim.name} serves at {new} (was {old}) after {time.monotonic() - start:.1f} s")
        caught = on_both(ranks, "catch_up")[0]
        print(f"catch_up: {', '.join(caught)} brought to step-{step}")  # type: ignore[arg-type]

        problems = on_both(ranks, "check")[0]
        versions = ray.get(ranks[0].versions.remote(), timeout=60)  # rank 0's roster: the engines' current targets
        assert set(versions.values()) == {f"step-{step}"}, versions  # type: ignore[union-attr]
        assert not problems, problems
        print(f"checked: {len(versions)} engines serve step-{step}, bit-exact with the trainer")  # type: ignore[arg-type]
        on_both(ranks, "close")
    finally:
        for r in ranks:
            ray.kill(r)
        stop_engines(handles, grace_s=5)
        ray.shutdown()
    print("done")


if __name__ == "__main__":
    main()
