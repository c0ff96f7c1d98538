"""wsync on Ray: engines as Ray actors in placement groups, and trainers that follow them (the ``ray`` extra).

The launcher room's Ray side (``wsync_grpc.launch`` is its process side): nothing in the library imports it.

- :class:`EngineActor` (:mod:`wsync_grpc.ray.actor`): one engine's process, owned by an actor; where it serves,
  whether it does. :class:`EngineSpec` says what it starts.
- :func:`launch_engines`, :func:`stop_engines` (:mod:`wsync_grpc.ray.placement`): ``n`` engine actors over a
  placement group, one bundle each, with Ray's ``max_restarts``.
- :class:`EngineHandle`, :class:`HandleResolver`, :func:`trainer_client` (:mod:`wsync_grpc.ray.handles`): what
  pickles and travels to a trainer, and a :class:`~wsync_grpc.trainer.client.TrainerClient` that finds an
  engine Ray restarted at its new address.

See the guide, ``docs/guides/ray.md``.
"""

from wsync_grpc.ray.actor import EngineActor, EngineHealth, EngineInfo, EngineSpec
from wsync_grpc.ray.handles import DEFAULT_RESOLVE_TIMEOUT_S, EngineHandle, HandleResolver, trainer_client
from wsync_grpc.ray.placement import DEFAULT_PLACEMENT_TIMEOUT_S, Strategy, launch_engines, stop_engines

__all__ = [
    "DEFAULT_PLACEMENT_TIMEOUT_S",
    "DEFAULT_RESOLVE_TIMEOUT_S",
    "EngineActor",
    "EngineHandle",
    "EngineHealth",
    "EngineInfo",
    "EngineSpec",
    "HandleResolver",
    "Strategy",
    "launch_engines",
    "stop_engines",
    "trainer_client",
]
