"""Engine handles: what a driver gives a trainer (or another actor) so that it can reach Ray-launched engines.

An :class:`EngineHandle` is small and pickles (through ``ray.put``, an actor's arguments, or ``pickle``).
Pickled, it carries exactly its fields: the engine's name, Ray's handle on its actor (the actor's id and
its methods' names: no state of the actor, no :class:`~wsync_grpc.ray.actor.EngineSpec`), the target the
engine served at when launched, the node it was launched on, its placement group (Ray's id and bundle specs)
and bundle index, and a token only if the user put one there (``launch_engines(token=...)``). Never a
private key (TLS keys stay files on the nodes). Its ``repr`` hides the token.

A trainer built from handles (:func:`trainer_client`) follows engines that Ray restarts: its
:attr:`~wsync_grpc.trainer.client.TrainerClient.resolver` is a :class:`HandleResolver`, which asks the
actor of a member that stopped answering where its engine serves now
(:data:`~wsync_grpc.trainer.roster.TargetResolver`). The trainer talks to the engines over ``wsync.v1``
(gRPC, protobuf), never through Ray.

Units: times in seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from wsync_grpc.ray.actor import EngineHealth, EngineInfo
from wsync_grpc.trainer import AUTO_MASTER_ADDRESS, TrainerClient

__all__ = ["DEFAULT_RESOLVE_TIMEOUT_S", "EngineHandle", "HandleResolver", "trainer_client"]

log = logging.getLogger(__name__)

DEFAULT_RESOLVE_TIMEOUT_S = 0.5
"""How long :class:`HandleResolver` waits for restarting actors to say where they serve, in seconds. Short: the
resolver runs inside the status probe before an update, and an engine's restart takes seconds (tens for vLLM), so
the update leaves a restarting engine out and publishes to the others at once; the next probe or ``catch_up``
finds the engine once its actor serves again. A longer wait takes it back into the same update instead, at the
price of every engine waiting (at most :data:`~wsync_grpc.trainer.roster.PROBE_TIMEOUT_S` is advised)."""

_RETRY_S = 0.1
"""Wait before asking again an actor that Ray reports restarting, in seconds."""


@dataclass(frozen=True)
class EngineHandle:
    """One engine launched as a Ray actor (:func:`~wsync_grpc.ray.placement.launch_engines`); picklable.

    Attributes:
        name: the engine's name.
        actor: Ray's handle on its :class:`~wsync_grpc.ray.actor.EngineActor`.
        target: the engine's ``host:port`` when it was launched (a restarted engine serves elsewhere:
            :meth:`current_target`).
        node_id: the Ray node it was launched on (hex).
        placement_group: the placement group it was launched in (``ray.util.placement_group.PlacementGroup``).
        bundle_index: its bundle in that group.
        token: the engines' token, when the user gave one (``launch_engines(token=...)``); else ``None``.
    """

    name: str
    actor: Any
    target: str
    node_id: str
    placement_group: Any
    bundle_index: int
    token: str | None = field(default=None, repr=False)

    def current_target(self, timeout_s: float = 30.0) -> str:
        """Where the engine serves now (a new port once Ray restarted its actor); waits for a restart under way.

        Raises:
            TimeoutError: the actor did not answer within ``timeout_s`` seconds (still restarting).
            ray.exceptions.ActorDiedError: the actor is dead for good (no restart left, or killed so).
        """
        return str(_ask(self.actor, "target", timeout_s))

    def info(self, timeout_s: float = 30.0) -> EngineInfo:
        """Where the actor runs and its engine serves now (:class:`~wsync_grpc.ray.actor.EngineInfo`).

        Raises:
            as :meth:`current_target`.
        """
        info: EngineInfo = _ask(self.actor, "info", timeout_s)
        return info

    def health(self, timeout_s: float = 30.0) -> EngineHealth:
        """The actor's view of its engine: running, answering the gRPC health check.

        Raises:
            as :meth:`current_target`.
        """
        health: EngineHealth = _ask(self.actor, "health", timeout_s)
        return health


def _ask(actor: Any, method: str, timeout_s: float) -> Any:
    """``ray.get(actor.<method>.remote())`` within ``timeout_s`` seconds, asking again while Ray restarts the actor.

    Raises:
        TimeoutError: no answer in time.
        ray.exceptions.ActorDiedError: the actor is dead for good.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the engine actor did not answer {method}() within {timeout_s:g} s")
        try:
            return ray.get(getattr(actor, method).remote(), timeout=left)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"the engine actor did not answer {method}() within {timeout_s:g} s") from exc
        except ray.exceptions.ActorUnavailableError:  # restarting: the call may not have run; ask again
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


class HandleResolver:
    """Where Ray-launched engines serve now: a :data:`~wsync_grpc.trainer.roster.TargetResolver` over handles.

    Called by the trainer with the members that did not answer; asks each one's actor for its target, all
    at once, within ``timeout_s`` seconds (an actor Ray is restarting answers once its new engine serves),
    and returns old -> new for those that serve elsewhere now. Actors dead for good, unknown targets and
    actors that do not answer in time are left out (the trainer leaves those members out, and asks again at
    its next probe).

    Args:
        handles: the engines' handles.
        timeout_s: the longest one call waits, in seconds.
    """

    def __init__(self, handles: Sequence[EngineHandle], timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S) -> None:
        self._by_target = {h.target: h for h in handles}
        self.timeout_s = timeout_s

    @property
    def targets(self) -> dict[str, EngineHandle]:
        """Each engine's last known target -> its handle."""
        return dict(self._by_target)

    def __call__(self, targets: list[str]) -> Mapping[str, str]:
        """Old target -> new target, for the engines of ``targets`` whose actors serve elsewhere now."""
        deadline = time.monotonic() + self.timeout_s
        asked = {t: self._by_target[t] for t in targets if t in self._by_target}
        pending = {t: h.actor.target.remote() for t, h in asked.items()}
        found: dict[str, str] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("%s: no answer from the engine actor within %g s", ", ".join(pending), self.timeout_s)
                break
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=left)
            for old in [t for t, ref in pending.items() if ref in ready]:
                ref = pending.pop(old)
                try:
                    found[old] = str(ray.get(ref))
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    time.sleep(_RETRY_S)
                    pending[old] = asked[old].actor.target.remote()
                except ray.exceptions.RayActorError as exc:
                    log.warning("%s: the engine actor is gone for good: %s", old, exc)
        moved = {old: new for old, new in found.items() if new != old}
        for old, new in moved.items():
            self._by_target[new] = self._by_target.pop(old)
        return moved


def handles_token(handles: Sequence[EngineHandle]) -> str | None:
    """The token every one of ``handles`` carries (``None``: none).

    Raises:
        ValueError: no handles; handles with different tokens.
    """
    if not handles:
        raise ValueError("no engine handles")
    tokens = {h.token for h in handles}
    if len(tokens) > 1:
        raise ValueError("the handles carry different tokens: pass token= yourself")
    return tokens.pop()


def trainer_client(
    handles: Sequence[EngineHandle],
    *,
    resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S,
    **kwargs: Any,
) -> TrainerClient:
    """A :class:`~wsync_grpc.trainer.client.TrainerClient` over the handles' engines that follows their restarts.

    The client's members are the handles' targets, in their order; its
    :attr:`~wsync_grpc.trainer.client.TrainerClient.resolver` is a :class:`HandleResolver`, so that an
    engine Ray restarted on a new port or node is found at the status probe of the next update under
    ``FleetPolicy.exclude(...)`` or at :meth:`~wsync_grpc.trainer.client.TrainerClient.catch_up`, and
    brought to the fleet's version there. Under the ``fail`` policy an update does not probe: call
    ``catch_up`` after a failure to follow restarted engines.

    Args:
        handles: the engines' handles, e.g. from :func:`~wsync_grpc.ray.placement.launch_engines`.
        resolve_timeout_s: how long the resolver waits for restarting actors, in seconds.
        kwargs: the client's keywords. ``master_address`` defaults to ``"auto"`` (the trainer's address on
            the route to the first engine, which the other nodes reach); ``token`` to the handles' token.

    Raises:
        ValueError: no handles; handles with different tokens; as :class:`TrainerClient` (a token without
            ``credentials`` to a non-loopback target, ...).
    """
    kwargs.setdefault("token", handles_token(handles))
    kwargs.setdefault("master_address", AUTO_MASTER_ADDRESS)
    client = TrainerClient([h.target for h in handles], **kwargs)
    client.resolver = HandleResolver(handles, resolve_timeout_s)
    return client
