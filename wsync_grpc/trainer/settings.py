"""What a :class:`~wsync_grpc.trainer.client.TrainerClient` was configured with, shared by its parts.

:func:`client_settings` checks the constructor's arguments and resolves the
group name, device and backend into one :class:`ClientSettings`. The
client's parts (fleet, membership, planner, sync) hold that one object and
read it at every call, and the client's public attributes
(``rpc_timeout_s``, ``bucket_bytes``, ...) are descriptors over it
(``TrainerClient``'s own): assigning one applies from the next call, on
every part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from wsync_grpc.core.timeouts import Timeouts
from wsync_grpc.group.process_group import DEFAULT_GROUP_NAME, resolve_backend
from wsync_grpc.trainer.options import BackendName
from wsync_grpc.wire.convert import BACKENDS

AUTO_MASTER_ADDRESS = "auto"
"""``master_address`` that picks, at every group formation, the local address of the route to the first
engine (:func:`~wsync_grpc.group.routes.route_address`): the interface the engines are reached on."""


@dataclass
class ClientSettings:
    """The settings of one client (the constructor's arguments, resolved).

    Attributes:
        master_address: where engines reach the trainer's TCP store (an address of this host, or
            :data:`AUTO_MASTER_ADDRESS`).
        master_port: the store's TCP port; ``None`` picks a free one at every (re-)initialization.
        group_name: the group's name (store prefix).
        device: where the trainer's collectives run.
        backend: ``"gloo"`` or ``"nccl"``, resolved from ``device``.
        fixed_workers: workers per engine in the constructor's target order (the fleet copies each to its
            engine); ``None`` asks every engine.
        rpc_timeout_s: deadline of the control RPCs, in seconds.
        group_timeout_s: group join and per-collective timeout, in seconds.
        bucket_bytes: default bucket capacity of ``sync``, in bytes.
        alignment: byte alignment of tensors inside flat buckets.
        ramp_bytes: size of the first and last buckets, in bytes.
        solo_bytes: flattened layout: tensors of at least this many bytes travel alone, in bytes.
        digests: send each bucket's digest (:mod:`wsync_grpc.core.digests`), which every engine checks;
            :func:`client_settings` resolves ``None`` to whether ``device`` is the CPU.
    """

    master_address: str
    master_port: int | None
    group_name: str
    device: torch.device
    backend: BackendName
    fixed_workers: list[int] | None
    rpc_timeout_s: float
    group_timeout_s: float
    bucket_bytes: int
    alignment: int
    ramp_bytes: int
    solo_bytes: int
    digests: bool = True

    @property
    def timeouts(self) -> Timeouts:
        """The RPC and group timeouts as one :class:`~wsync_grpc.core.timeouts.Timeouts` (deadlines derive from it)."""
        return Timeouts(rpc_s=self.rpc_timeout_s, group_s=self.group_timeout_s)


def client_settings(
    targets: Sequence[str],
    *,
    master_address: str,
    master_port: int | None,
    group_name: str,
    backend: BackendName,
    device: torch.device | str | None,
    workers: Sequence[int] | None,
    rpc_timeout_s: float,
    group_timeout_s: float,
    bucket_bytes: int,
    alignment: int,
    ramp_bytes: int,
    solo_bytes: int,
    digests: bool | None = None,
) -> ClientSettings:
    """Check :class:`~wsync_grpc.trainer.client.TrainerClient`'s arguments and resolve them.

    ``group_name`` defaults to ``"weight_sync_group"``; ``device`` to the
    current CUDA device for ``backend="nccl"``, CPU otherwise; ``backend`` is
    resolved from the device; ``digests`` (``None``) to whether the device is the CPU.

    Raises:
        ValueError: no targets, duplicate targets, a ``workers`` list of the
            wrong length or with a count below 1, non-positive timeouts, a
            negative ``ramp_bytes`` or ``solo_bytes``, an unknown backend.
    """
    if not targets:
        raise ValueError("at least one engine target is needed")
    if not master_address:
        raise ValueError(f"master_address must be an address of this host or {AUTO_MASTER_ADDRESS!r}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"duplicate engine targets in {targets}")
    if workers is not None and (len(workers) != len(targets) or any(w < 1 for w in workers)):
        raise ValueError(f"workers must give a count >= 1 for each of the {len(targets)} targets")
    if rpc_timeout_s <= 0 or group_timeout_s <= 0:
        raise ValueError("timeouts must be positive")
    if ramp_bytes < 0:
        raise ValueError(f"ramp_bytes must not be negative, got {ramp_bytes}")
    if solo_bytes < 0:
        raise ValueError(f"solo_bytes must not be negative, got {solo_bytes}")
    if backend not in BACKENDS and backend != "":
        raise ValueError(f"unknown backend {backend!r}; use 'gloo', 'nccl' or ''")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    resolved = torch.device(device)
    if digests is None:  # hashing a CUDA bucket would first copy it to the host, on both sides of the wire
        digests = resolved.type == "cpu"
    return ClientSettings(
        master_address=master_address,
        master_port=master_port,
        group_name=group_name or DEFAULT_GROUP_NAME,
        device=resolved,
        backend=cast(BackendName, resolve_backend(backend, resolved)),
        fixed_workers=list(workers) if workers is not None else None,
        rpc_timeout_s=rpc_timeout_s,
        group_timeout_s=group_timeout_s,
        bucket_bytes=bucket_bytes,
        alignment=alignment,
        ramp_bytes=ramp_bytes,
        solo_bytes=solo_bytes,
        digests=digests,
    )
