"""wsync on Ray: engines as Ray actors in placement groups, and trainers that follow them (the ``ray`` extra).

The launcher room's Ray side (``wsync_grpc.launch`` is its process side): nothing in the library imports it.

- :class:`EngineActor` (:mod:`wsync_grpc.ray.actor`): one engine's process, owned by an actor; where it serves,
  whether it does. :class:`EngineSpec` says what it starts.
- :func:`launch_engines`, :func:`stop_engines`, :func:`find_engines` (:mod:`wsync_grpc.ray.placement`): ``n``
  engine actors over a placement group, one bundle each, with Ray's ``max_restarts``; detached ones, found by
  name from another driver.
- :class:`EngineHandle`, :class:`HandleResolver`, :func:`trainer_client` (:mod:`wsync_grpc.ray.handles`): what
  pickles and travels to a trainer, and a :class:`~wsync_grpc.trainer.client.TrainerClient` that finds an
  engine Ray restarted at its new address.
- :class:`TrainerRendezvous`, :func:`join_trainer_group`, :func:`sharded_trainer_client`
  (:mod:`wsync_grpc.ray.ranks`): a sharded trainer's ranks as Ray actors, forming their process group through
  Ray (rank 0's address shared by Ray) and their :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient`.

See the guide, ``docs/guides/ray.md``.
"""

from wsync_grpc.ray.actor import EngineActor, EngineHealth, EngineInfo, EngineSpec
from wsync_grpc.ray.handles import DEFAULT_RESOLVE_TIMEOUT_S, EngineHandle, HandleResolver, trainer_client
from wsync_grpc.ray.placement import (
    DEFAULT_PLACEMENT_TIMEOUT_S,
    Strategy,
    find_engines,
    launch_engines,
    stop_engines,
)
from wsync_grpc.ray.ranks import DEFAULT_JOIN_TIMEOUT_S, TrainerRendezvous, join_trainer_group, sharded_trainer_client

__all__ = [
    "DEFAULT_JOIN_TIMEOUT_S",
    "DEFAULT_PLACEMENT_TIMEOUT_S",
    "DEFAULT_RESOLVE_TIMEOUT_S",
    "EngineActor",
    "EngineHandle",
    "EngineHealth",
    "EngineInfo",
    "EngineSpec",
    "HandleResolver",
    "Strategy",
    "TrainerRendezvous",
    "find_engines",
    "join_trainer_group",
    "launch_engines",
    "sharded_trainer_client",
    "stop_engines",
    "trainer_client",
]
