"""Launching wsync engines as Ray actors over a placement group, and stopping them.

:func:`launch_engines` reserves one bundle per engine (``num_cpus`` CPUs, and ``num_gpus`` GPUs where the
cluster has them) in a placement group (``PACK``, ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``), starts
one :class:`~wsync_grpc.ray.actor.EngineActor` in each bundle with Ray's ``max_restarts``, waits until every
engine serves, and returns one :class:`~wsync_grpc.ray.handles.EngineHandle` per engine, in bundle order.
:func:`stop_engines` kills the actors (their engines end with them) and removes the placement group.

The actors are owned by the process that launched them (the driver, or an actor of the framework's): they
and their engines end when it does. Launched ``detached=True``, the actors and their placement group belong
to no process: they outlive the driver, under names (``f"{name}-{i}"``) in a Ray namespace, and another driver
finds them there (:func:`find_engines`) and takes the fleet over; :func:`stop_engines` ends them. A restarted
actor stays in its bundle: on the same node, or on the one the bundle is placed on again if its node was lost.

Units: times in seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from wsync_grpc.launch import DEFAULT_START_TIMEOUT_S, VLLM_START_TIMEOUT_S
from wsync_grpc.ray.actor import EngineActor, EngineInfo, EngineSpec
from wsync_grpc.ray.handles import EngineHandle

__all__ = ["DEFAULT_PLACEMENT_TIMEOUT_S", "Strategy", "find_engines", "launch_engines", "node_shares", "stop_engines"]

log = logging.getLogger(__name__)

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""How the bundles are placed over the nodes (Ray's placement group strategies)."""

DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
"""How long :func:`launch_engines` waits for the cluster to grant the placement group, in seconds."""


def launch_engines(
    n: int,
    spec: EngineSpec | None = None,
    *,
    strategy: Strategy = "PACK",
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    max_restarts: int = 0,
    name: str = "wsync-engine",
    token: str | None = None,
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
    start_timeout_s: float | None = None,
    detached: bool = False,
    namespace: str | None = None,
) -> list[EngineHandle]:
    """Start ``n`` engines as Ray actors, one per bundle of a new placement group; return their handles.

    Call it where Ray is initialized (a driver after ``ray.init``, or inside an actor); that process owns
    the actors. Returns once every engine serves.

    Args:
        n: how many engines (and bundles).
        spec: what each actor starts (:class:`~wsync_grpc.ray.actor.EngineSpec`); ``None``: ``wsync serve``
            with its defaults (the reference engine, SmolLM2).
        strategy: the placement group's strategy: ``"PACK"`` (default: as few nodes as possible),
            ``"SPREAD"`` (as many as possible), ``"STRICT_PACK"`` (one node) or ``"STRICT_SPREAD"`` (one
            node each).
        num_cpus: CPUs of each bundle (and its actor). vLLM engines on CPU whose bundles share a node bind their
            forwards to cores of their own (:func:`node_shares`, the actor's ``node_share``), where vLLM alone
            would bind them all to the same ones; engines of another call are not counted.
        num_gpus: GPUs of each bundle; ``None`` (default): 1 where the cluster has GPUs, else 0. Ray sets
            ``CUDA_VISIBLE_DEVICES`` in the actor, and its engine inherits it.
        max_restarts: how many times Ray restarts each actor that dies (``-1``: without end); each restart
            starts a new engine, on a new port.
        name: the engines' names are ``f"{name}-{i}"``.
        token: the engines require this token (``spec.token``), and the handles carry it for the trainer.
        placement_timeout_s: how long to wait for the placement group, in seconds.
        start_timeout_s: how long to wait for the engines to serve, in seconds; ``None``: ``spec``'s start
            timeout plus 60 s for the actors' workers to start.
        detached: the actors (``lifetime="detached"``, named ``f"{name}-{i}"``) and the placement group (named
            ``name``) outlive the process that launched them; :func:`find_engines` finds them from another
            driver, :func:`stop_engines` ends them. ``False`` (default): they end with the launching process.
        namespace: the Ray namespace of the detached actors' names (``None``: the caller's, as
            ``ray.init(namespace=...)`` set it; Ray gives an anonymous driver a random one, which no other
            driver can name). Ignored unless ``detached``.

    Raises:
        ValueError: ``n`` below 1, or a ``token`` that differs from ``spec.token``; detached engines named
            ``name`` already run in that namespace.
        TimeoutError: the placement group was not granted in time, or the engines did not serve in time (the
            placement group and any actor started are removed first).
        ray.exceptions.RayActorError: an engine failed to start (its actor's creation error holds the tail of
            the engine's output); the other actors and the placement group are removed first.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    spec = spec if spec is not None else EngineSpec()
    if token is not None:
        if spec.token not in (None, token):
            raise ValueError("token differs from spec.token")
        spec = dataclasses.replace(spec, token=token)
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    lifetime: dict[str, Any] = {}
    if detached:
        if _named(name, namespace):
            raise ValueError(f"detached engines named {name}-* run already in namespace {_namespace(namespace)!r}")
        lifetime = {"lifetime": "detached", "namespace": namespace}
    group = placement_group(
        [dict(bundle) for _ in range(n)],
        strategy=strategy,
        **({"name": name, "lifetime": "detached"} if detached else {}),
    )
    try:
        ray.get(group.ready(), timeout=placement_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        remove_placement_group(group)
        raise TimeoutError(
            f"the cluster did not grant {n} bundle(s) of {bundle} ({strategy}) within {placement_timeout_s:g} s"
        ) from exc
    remote = ray.remote(EngineActor)
    shares = node_shares(placement_group_table(group)["bundles_to_node_id"], n)
    actors = [
        remote.options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            **({"name": f"{name}-{i}", **lifetime} if detached else {}),
        ).remote(f"{name}-{i}", spec, shares[i])
        for i in range(n)
    ]
    wait_s = start_timeout_s if start_timeout_s is not None else _start_timeout(spec) + 60.0
    try:
        infos: list[EngineInfo] = ray.get([a.info.remote() for a in actors], timeout=wait_s)
    except BaseException as exc:
        _remove(actors, group)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise TimeoutError(f"{n} engine(s) did not serve within {wait_s:g} s") from exc
        raise
    log.info("launched %d engine(s) (%s): %s", n, strategy, ", ".join(f"{i.name} at {i.target}" for i in infos))
    return [
        EngineHandle(i.name, a, i.target, i.node_id, group, index, spec.token)
        for index, (a, i) in enumerate(zip(actors, infos, strict=True))
    ]


def node_shares(bundles_to_node: Mapping[int, str], n: int) -> list[tuple[int, int]]:
    """Each bundle's place among the bundles of its node: ``[(index, count)]`` in bundle order.

    Args:
        bundles_to_node: bundle index -> the id of the node it was placed on (Ray's
            ``placement_group_table(group)["bundles_to_node_id"]``).
        n: the bundles; one missing from ``bundles_to_node`` counts as alone on its node.

    Returns:
        ``n`` pairs: bundle ``i``'s position among the bundles on its node (in bundle order) and their count
        (the :class:`~wsync_grpc.ray.actor.EngineActor` argument ``node_share``).
    """
    nodes = [bundles_to_node.get(i, f"unplaced-{i}") for i in range(n)]
    return [(nodes[:i].count(node), nodes.count(node)) for i, node in enumerate(nodes)]


def find_engines(
    name: str = "wsync-engine",
    *,
    namespace: str | None = None,
    token: str | None = None,
    timeout_s: float = 60.0,
) -> list[EngineHandle]:
    """The handles of detached engines (``launch_engines(..., detached=True)``) found by their names: how a new
    driver takes over a fleet whose driver is gone.

    Looks up the actors named ``f"{name}-{i}"`` in ``namespace`` (``ray.get_actor``) and asks each where its
    engine serves now and its placement group; the handles come in index order, as :func:`launch_engines`
    returned them. A restarting actor is waited for.

    Args:
        name: the ``name`` the engines were launched with.
        namespace: their Ray namespace (``None``: the caller's).
        token: the engines' token, for the handles (a token is not stored with the names); ``None``: none.
        timeout_s: how long to wait for the actors' answers, in seconds.

    Returns:
        The handles; empty when no such actor exists.

    Raises:
        TimeoutError: an actor did not answer within ``timeout_s`` seconds.
        ray.exceptions.RayActorError: an actor died for good while asked.
    """
    found = _named(name, namespace)
    actors = [ray.get_actor(actor_name, namespace=namespace) for _, actor_name in found]
    try:
        infos: list[EngineInfo] = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
        groups: list[Any] = ray.get([a.placement_group.remote() for a in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"the engine actors named {name}-* did not answer within {timeout_s:g} s") from exc
    return [
        EngineHandle(info.name, actor, info.target, info.node_id, group, index, token)
        for (index, _), actor, info, group in zip(found, actors, infos, groups, strict=True)
    ]


def _namespace(namespace: str | None) -> str:
    return namespace if namespace is not None else str(ray.get_runtime_context().namespace)


def _named(name: str, namespace: str | None) -> list[tuple[int, str]]:
    """``(index, actor name)`` of the live actors named ``f"{name}-{index}"`` in ``namespace``, by index."""
    pattern = re.compile(re.escape(name) + r"-(\d+)")
    where = _namespace(namespace)
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        match = pattern.fullmatch(entry["name"])
        if match and entry["namespace"] == where:
            found.append((int(match.group(1)), str(entry["name"])))
    return sorted(found)


def _start_timeout(spec: EngineSpec) -> float:
    if spec.start_timeout_s is not None:
        return spec.start_timeout_s
    return VLLM_START_TIMEOUT_S if spec.vllm_model is not None else DEFAULT_START_TIMEOUT_S


def _remove(actors: Sequence[Any], group: Any) -> None:
    for a in actors:
        ray.kill(a, no_restart=True)
    remove_placement_group(group)


def stop_engines(handles: Sequence[EngineHandle], *, grace_s: float | None = 10.0) -> None:
    """Stop the handles' engines and kill their actors (no restart); remove their placement groups. Detached
    engines too (from :func:`launch_engines` or :func:`find_engines`): this is how they end.

    Args:
        handles: engines from :func:`launch_engines`.
        grace_s: ask every engine to stop gracefully first (SIGTERM, SIGKILL after the spec's grace), waiting
            at most this many seconds for all of them; ``None``: kill the actors at once (their engines get
            SIGKILL with them).
    """
    if grace_s is not None:
        refs = [h.actor.stop.remote() for h in handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:  # a dead actor: its engine ended with it
                log.debug("stopping an engine: %s", exc)
    groups = {}
    for h in handles:
        ray.kill(h.actor, no_restart=True)
        if h.placement_group is not None:
            groups[h.placement_group.id] = h.placement_group
    for group in groups.values():
        remove_placement_group(group)
