"""What a :class:`~wsync_grpc.trainer.client.TrainerClient` is configured with, declared once and shared by its parts.

:class:`Settings` declares every setting once: its name, type and default (a
dataclass field) and its meaning and unit (the docstring under the field). The
rest reads that declaration:

- the client's constructor has one keyword per setting, typed and defaulted from
  it (``device``, ``backend``, ``workers`` and ``digests`` default to a value
  :func:`client_settings` resolves: :attr:`SettingSpec.given`);
- :func:`client_settings` checks the constructor's keywords and resolves the
  group name, device, backend and digests into one :class:`ClientSettings`, which
  the client's parts (fleet, membership, planner, sync) hold and read at every call;
- :func:`setting_attributes` gives the client one public attribute per setting
  (``rpc_timeout_s``, ``bucket_bytes``, ...), a descriptor over its
  ``ClientSettings``: assigning one applies from the next call, on every part;
- the rank program :mod:`wsync_grpc.tools.fsdp_rank` takes its options for them
  from :func:`add_setting_options` (defaults and help from here).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Protocol, TypeVar, cast

import torch

from wsync_grpc.core.planning import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, DEFAULT_RAMP_BYTES, DEFAULT_SOLO_BYTES
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S, Timeouts
from wsync_grpc.group.process_group import DEFAULT_GROUP_NAME, resolve_backend
from wsync_grpc.trainer.options import BackendName
from wsync_grpc.wire.convert import BACKENDS

AUTO_MASTER_ADDRESS = "auto"
"""``master_address`` that picks, at every group formation, the local address of the route to the first
engine (:func:`~wsync_grpc.group.routes.route_address`): the interface the engines are reached on."""

_SPEC = "wsync.setting"
"""The key of a setting's :class:`SettingSpec` in its field's metadata."""

_SAME: Any = object()
"""``given`` of a setting whose constructor keyword defaults to the field's own default."""


@dataclass(frozen=True)
class SettingSpec:
    """How the client's constructor and attributes show one setting (its field's metadata).

    Attributes:
        keyword: the constructor's keyword for it (its own name, except ``workers`` for ``fixed_workers``).
        given: the keyword's default, where it is not the field's: a value :func:`client_settings` resolves
            (``None`` for ``device``, ``""`` for ``backend``...).
        assignable: whether assigning the client's attribute is allowed (it applies from the next call);
            a setting read once, at construction, is read-only.
    """

    keyword: str
    given: Any
    assignable: bool


def setting(*, keyword: str | None = None, given: Any = _SAME, assignable: bool = True) -> dict[str, Any]:
    """The metadata of a field of :class:`Settings`: its :class:`SettingSpec` (``keyword`` = the field's name)."""
    return {_SPEC: (keyword, given, assignable)}


def spec(f: Field[Any]) -> SettingSpec:
    """The :class:`SettingSpec` of one field of :class:`Settings`."""
    keyword, given, assignable = f.metadata[_SPEC]
    return SettingSpec(keyword or f.name, f.default if given is _SAME else given, assignable)


@dataclass(eq=False, repr=False, match_args=False)
class Settings:
    """Every setting of a :class:`~wsync_grpc.trainer.client.TrainerClient`, declared once.

    Each is a keyword of the client's constructor with the default shown here (unless said otherwise) and a
    public attribute of the client: assigning one applies from the next call, on every part of the client. The
    defaults are those of a client given none, on the CPU. Units: sizes in bytes, times in seconds.
    """

    master_address: str = field(default="127.0.0.1", metadata=setting())
    """Where engines reach the trainer's TCP store: an address of this host (rank 0 serves the store, listening
    on this address only); the default serves engines on this host.

    ``"auto"`` (:data:`AUTO_MASTER_ADDRESS`): at every group formation, the local address of the route to the
    first engine (:func:`~wsync_grpc.group.routes.route_address`), i.e. the interface the engines are reached
    on; engines on another network than the first one's need an explicit address."""

    master_port: int | None = field(default=None, metadata=setting())
    """The store's TCP port; ``None`` picks a free port at every (re-)initialization."""

    group_name: str = field(default=DEFAULT_GROUP_NAME, metadata=setting())
    """The group's name (store prefix), as in SGLang's ``InitWeightsUpdateGroupReqInput.group_name``;
    ``""`` = the default."""

    device: torch.device = field(default=torch.device("cpu"), metadata=setting(given=None))
    """Where the trainer's collectives run.

    The constructor's ``None`` (default) is the CPU, or the current CUDA device for ``backend="nccl"``."""

    backend: BackendName = field(default="gloo", metadata=setting(given=""))
    """The backend in use, ``"gloo"`` or ``"nccl"`` (sent explicitly to every engine).

    The constructor's ``""`` (default) resolves it from ``device``: NCCL when it is CUDA, gloo otherwise
    (engines choose by their devices the same way)."""

    fixed_workers: list[int] | None = field(default=None, metadata=setting(keyword="workers", assignable=False))
    """Workers per engine, in the constructor's target order (its ``workers``: each is copied to its engine,
    read-only after); ``None`` asks every engine (``GetStatus().engine.workers``)."""

    rpc_timeout_s: float = field(default=DEFAULT_RPC_TIMEOUT_S, metadata=setting())
    """Deadline of the control RPCs, in seconds."""

    group_timeout_s: float = field(default=DEFAULT_GROUP_TIMEOUT_S, metadata=setting())
    """Group join and per-collective timeout, in seconds; a broadcast blocked on a dead engine fails after it."""

    bucket_bytes: int = field(default=DEFAULT_BUCKET_BYTES, metadata=setting())
    """Bucket capacity of a sync, in bytes (:meth:`~wsync_grpc.trainer.client.TrainerClient.sync` may pass its
    own)."""

    alignment: int = field(default=DEFAULT_ALIGNMENT, metadata=setting())
    """Byte alignment of tensors inside flat buckets, in bytes."""

    ramp_bytes: int = field(default=DEFAULT_RAMP_BYTES, metadata=setting())
    """Size of the first and last buckets, in bytes (32 MiB); 0 fills every bucket up to ``bucket_bytes``.

    Buckets double from it up to ``bucket_bytes`` and halve back down to it at the end, so that the first pack
    and the last apply, which overlap nothing, are short."""

    solo_bytes: int = field(default=DEFAULT_SOLO_BYTES, metadata=setting())
    """Flattened layout: a tensor of at least this many bytes travels alone, in bytes (16 MiB); 0 packs every
    tensor.

    Such a tensor is broadcast from the tensor itself (no packing) and, with streaming apply on an engine that
    allows it, received straight into the served tensor (no unpacking)."""

    shared_memory_zero_copy: bool = field(default=True, metadata=setting())
    """Shared-memory syncs of a trainer of one process: a bucket whose tensors already live in this process's shared
    memory (``Module.share_memory()``; CPU, contiguous, in the wire dtype) is not packed into the ring, and the
    engine workers read it from those storages (:mod:`~wsync_grpc.transports.shared_memory.storages`; one copy in
    all). ``False``: every bucket is packed into the ring, and no update offers the path (for engines of a wsync
    without it, which refuse an update that does). Sets
    :attr:`SharedMemorySender.storages <wsync_grpc.transports.shared_memory.sender.SharedMemorySender.storages>`
    before every update."""

    digests: bool = field(default=True, metadata=setting(given=None))
    """Send each bucket's digest (XXH3-128 of its bytes on the wire), which every engine worker checks.

    A bucket corrupted or replaced on the way fails the update (``DATA_LOSS BUCKET_DIGEST_MISMATCH``) and
    nothing of it is used. The trainer hashes each bucket while it is on the wire and declares the digest with
    an ``Update`` right after (a sharded trainer's direct send: before Prepare, every rank hashing its own
    buckets). Hashing reads every byte once more on each side, on the host, and an engine receives a verified
    bucket into a buffer, never straight into the served tensor. The constructor's ``None`` (default): on when
    ``device`` is the CPU (gloo), off for CUDA buckets (NCCL), which would first be copied to the host on both
    sides. ``True``/``False``: always/never. Unverified buckets give ``EngineSyncResult.buckets_verified == 0``."""

    delta: bool = field(default=False, metadata=setting())
    """Sync deltas by default (:meth:`~wsync_grpc.trainer.client.TrainerClient.sync`'s ``delta`` when it passes
    ``None``): only the elements whose value in the wire dtype changed since the last sync, to engines serving
    it; whole updates otherwise (:mod:`wsync_grpc.trainer.delta`). The client then keeps a copy of what it last
    sent and of the sync before, in the wire dtype (2 bytes per parameter each for bfloat16)."""

    delta_anchor_every: int = field(default=0, metadata=setting())
    """With deltas: send a whole update after this many deltas in a row (an anchor); 0 never does."""

    delta_fallback: bool = field(default=True, metadata=setting())
    """With deltas: a single-process client times its syncs and sends whole updates, as with deltas off, while a
    delta, diff included, has taken longer than a whole sync on its fleet (a fast wire, such as loopback), trying
    a delta again now and then (:class:`~wsync_grpc.trainer.delta.DeltaCosts`); ``False``: a delta whenever the
    engines serve the base."""


@dataclass
class ClientSettings(Settings):
    """The settings of one client, resolved (:func:`client_settings`): what its parts hold and read at every call."""

    @property
    def timeouts(self) -> Timeouts:
        """The RPC and group timeouts as one :class:`~wsync_grpc.core.timeouts.Timeouts` (deadlines derive from it)."""
        return Timeouts(rpc_s=self.rpc_timeout_s, group_s=self.group_timeout_s)


SETTINGS: tuple[Field[Any], ...] = fields(Settings)
"""The declaration's fields, in order."""

KEYWORDS: dict[str, Field[Any]] = {spec(f).keyword: f for f in SETTINGS}
"""The constructor's keyword of each setting -> its field."""


@functools.cache
def setting_docs() -> dict[str, str]:
    """Field name -> the docstring written under it in :class:`Settings` (read from the source; ``{}`` without it)."""
    try:
        source = textwrap.dedent(inspect.getsource(Settings))
    except (OSError, TypeError):
        return {}
    body = cast(ast.ClassDef, ast.parse(source).body[0]).body
    docs = {}
    for stmt, doc in itertools.pairwise(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(doc, ast.Expr)):
            continue
        if isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
            docs[stmt.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def setting_help(name: str) -> str:
    """The first paragraph of setting ``name``'s docstring, as plain text (no reST roles or literals)."""
    first = setting_docs().get(name, "").split("\n\n")[0]
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`.]+)`", r"\1", " ".join(first.split()))
    return text.replace("``", "")


def setting_keywords(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor's setting keywords among ``arguments`` (e.g. the constructor's ``locals()``)."""
    return {k: v for k, v in arguments.items() if k in KEYWORDS}


def client_settings(targets: Sequence[str], /, **given: Any) -> ClientSettings:
    """Check :class:`~wsync_grpc.trainer.client.TrainerClient`'s setting keywords and resolve them.

    ``given``: the constructor's keyword of each setting (:attr:`SettingSpec.keyword`); one not given takes
    its default from :class:`Settings`. ``group_name`` ``""`` resolves to ``"weight_sync_group"``; ``device``
    ``None`` to the current CUDA device for ``backend="nccl"``, CPU otherwise; ``backend`` ``""`` is resolved
    from the device; ``digests`` ``None`` to whether the device is the CPU.

    Raises:
        TypeError: a keyword that is no setting's.
        ValueError: no targets, duplicate targets, a ``workers`` list of the
            wrong length or with a count below 1, non-positive timeouts, a
            negative ``ramp_bytes`` or ``solo_bytes``, an unknown backend.
    """
    unknown = sorted(set(given) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"client_settings() got unexpected keyword arguments {unknown}")
    v = {f.name: given[k] if k in given else spec(f).given for k, f in KEYWORDS.items()}
    workers, backend, device = v["fixed_workers"], v["backend"], v["device"]
    if not targets:
        raise ValueError("at least one engine target is needed")
    if not v["master_address"]:
        raise ValueError(f"master_address must be an address of this host or {AUTO_MASTER_ADDRESS!r}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"duplicate engine targets in {targets}")
    if workers is not None and (len(workers) != len(targets) or any(w < 1 for w in workers)):
        raise ValueError(f"workers must give a count >= 1 for each of the {len(targets)} targets")
    if v["rpc_timeout_s"] <= 0 or v["group_timeout_s"] <= 0:
        raise ValueError("timeouts must be positive")
    if v["ramp_bytes"] < 0:
        raise ValueError(f"ramp_bytes must not be negative, got {v['ramp_bytes']}")
    if v["solo_bytes"] < 0:
        raise ValueError(f"solo_bytes must not be negative, got {v['solo_bytes']}")
    if backend not in BACKENDS and backend != "":
        raise ValueError(f"unknown backend {backend!r}; use 'gloo', 'nccl' or ''")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    resolved = torch.device(device)
    if v["digests"] is None:  # hashing a CUDA bucket would first copy it to the host, on both sides of the wire
        v["digests"] = resolved.type == "cpu"
    v["group_name"] = v["group_name"] or DEFAULT_GROUP_NAME
    v["device"] = resolved
    v["backend"] = resolve_backend(backend, resolved)
    v["fixed_workers"] = list(workers) if workers is not None else None
    return ClientSettings(**v)


class _HasSettings(Protocol):
    _settings: ClientSettings


class SettingAttribute:
    """One public attribute of a client over the same-named field of its ``_settings`` (:func:`setting_attributes`).

    Reading it reads the field; assigning it (an assignable setting) sets the field, which every part of the
    client reads from its next call.
    """

    def __init__(self, f: Field[Any]) -> None:
        self.name = f.name
        self.assignable = spec(f).assignable
        self.__doc__ = setting_docs().get(f.name, "")

    def __get__(self, obj: _HasSettings | None, owner: type[Any] | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._settings, self.name)

    def __set__(self, obj: _HasSettings, value: Any) -> None:
        if not self.assignable:
            raise AttributeError(f"{self.name} is read at construction only")
        setattr(obj._settings, self.name, value)


_C = TypeVar("_C", bound=type[Settings])


def setting_attributes(cls: _C) -> _C:
    """Class decorator: one :class:`SettingAttribute` per field of :class:`Settings`, over ``self._settings``.

    The class derives from :class:`Settings`, so that type checkers see each attribute with its declared type.
    """
    for f in SETTINGS:
        setattr(cls, f.name, SettingAttribute(f))
    return cls


def add_setting_options(
    parser: argparse.ArgumentParser, *names: str, defaults: Mapping[str, object] | None = None
) -> None:
    """Add one ``--name-with-dashes`` option per setting in ``names``: its type, default and help from
    :class:`Settings` (int, float and str settings); ``defaults`` gives a program's own default for some
    of them (named in the help beside the declaration's).

    Raises:
        TypeError: a setting with no command-line form (not int, float or str).
    """
    own = dict(defaults or {})
    for name in names:
        f = next(f for f in SETTINGS if f.name == name)
        kind = type(f.default)
        if f.default is MISSING or kind not in (int, float, str):
            raise TypeError(f"setting {name} has no command-line form")
        value = own.get(name, f.default)
        default = f"default {value}" if kind is not str else f"default {value!r}"
        if name in own:
            default += f"; the client's is {f.default}"
        text = f"{setting_help(name)} ({default})".replace("%", "%%")  # argparse formats help with %
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=value, help=text)
