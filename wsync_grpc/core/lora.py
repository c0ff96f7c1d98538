"""LoRA adapters in domain terms: their spec, their tensors' names and shapes, and the checks before a load.

An adapter update (``PrepareHeader.adapter``) carries a LoRA adapter's
tensors in PEFT's naming (``base_model.model.<module>.lora_A.weight``, shape
``(rank, in_features)``; ``...lora_B.weight``, shape ``(out_features, rank)``),
as ``peft.get_peft_model_state_dict`` returns them and
``adapter_model.safetensors`` stores them. :func:`adapter_param_specs` derives
every tensor an adapter of a given :class:`LoraSpec` must carry from the base
model's linear modules, so that the same
:class:`~wsync_grpc.core.validation.UpdateValidator` checks an adapter's
buckets (or its file's headers) before anything is loaded, and
:func:`lora_spec_from_config` reads a PEFT ``adapter_config.json`` (already
parsed as JSON: never a pickle) and refuses what the engines do not serve.

A ``target_modules`` regex (PEFT's one-string form, matched whole against
module names as PEFT's ``re.fullmatch``) is matched with Google RE2
(:func:`target_pattern`), in time linear in the name's length: Python's
``re`` backtracks, and a pattern such as ``(.|.)*!`` would hold the GIL (the
whole engine) for hours. Patterns RE2 does not accept (lookarounds,
backreferences) are refused. Pure: no I/O.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import re2
import torch

from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.params import ParamSpec

PEFT_PREFIX = "base_model.model."
"""The prefix of every tensor name in a PEFT LoRA state dict (``PeftModel`` wraps the base model)."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""What an adapter name may be (``AdapterSpec.name``)."""

LORA_DTYPE = torch.float32
"""The dtype engines keep adapters in (PEFT's default, whatever the base model's dtype)."""

MAX_TARGET_REGEX_CHARS = 1024
"""Longest ``target_modules`` regex, in characters (PEFT's own patterns are tens of characters)."""


@functools.lru_cache(maxsize=64)
def target_pattern(regex: str) -> Any:
    """``regex`` compiled by RE2 (a ``re2._Regexp``: its ``fullmatch`` runs in linear time); cached.

    Raises:
        InvalidArgument: TARGET_REGEX_TOO_LONG (over :data:`MAX_TARGET_REGEX_CHARS`), BAD_TARGET_REGEX
            (not a regular expression both RE2 and Python's ``re`` accept: lookarounds, backreferences...).
            The message names what is wrong, never the pattern's text.
    """
    if len(regex) > MAX_TARGET_REGEX_CHARS:
        raise InvalidArgument(
            "TARGET_REGEX_TOO_LONG",
            f"the target_modules regex has {len(regex)} characters; at most {MAX_TARGET_REGEX_CHARS} are accepted",
        )
    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    try:
        compiled = re2.compile(regex, options)
    except re2.error as e:
        raw = e.args[0] if e.args else b""
        what = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)).split(":", 1)[0]
        raise InvalidArgument(
            "BAD_TARGET_REGEX",
            f"the target_modules regex is not one RE2 matches in bounded time ({what[:80]}); lookarounds and "
            "backreferences are not supported: list the module names instead",
        ) from None
    try:
        re.compile(regex)  # the engines hand it on (PEFT, vLLM), which compile it with Python's re
    except re.error as e:
        raise InvalidArgument(
            "BAD_TARGET_REGEX", f"the target_modules regex is not a Python regular expression ({e.msg[:80]})"
        ) from None
    return compiled


@dataclass(frozen=True)
class LinearShape:
    """One linear module of the base model an adapter may target.

    Attributes:
        in_features: its input size.
        out_features: its output size.
    """

    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter's name and shape (the fields of PEFT's ``LoraConfig`` that engines serve).

    Attributes:
        name: what generation requests call it by.
        rank: ``LoraConfig.r``.
        alpha: ``LoraConfig.lora_alpha``; the update is scaled by ``alpha / rank``.
        target_modules: ``LoraConfig.target_modules`` as a list (names matched as the last parts of module names).
        target_regex: ``LoraConfig.target_modules`` when it is one string: a regular expression that must
            match whole module names (matched with RE2, :func:`target_pattern`); then ``target_modules`` is empty.
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()
    target_regex: str = ""

    def targets(self, module: str) -> bool:
        """Whether this adapter adapts the module named ``module`` (PEFT's matching rule), in bounded time.

        Raises:
            InvalidArgument: see :func:`target_pattern`.
        """
        if self.target_regex:
            return target_pattern(self.target_regex).fullmatch(module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid adapter name.

    Raises:
        InvalidArgument: BAD_ADAPTER_NAME.
    """
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            "BAD_ADAPTER_NAME",
            f"adapter name {name[:80]!r} must be 1-64 letters, digits, '.', '-' or '_'",
        )
    return name


def check_spec(spec: LoraSpec) -> LoraSpec:
    """Return ``spec`` if its fields are complete and sane.

    Raises:
        InvalidArgument: BAD_ADAPTER_NAME, BAD_ADAPTER_CONFIG (rank 0, alpha not positive, no target),
            and for a ``target_regex`` the reasons of :func:`target_pattern`.
    """
    check_name(spec.name)
    if spec.rank < 1 or not spec.alpha > 0 or not (spec.target_modules or spec.target_regex):
        raise InvalidArgument(
            "BAD_ADAPTER_CONFIG",
            f"adapter {spec.name!r}: rank ({spec.rank}) and alpha ({spec.alpha}) must be positive and "
            "target_modules non-empty",
            adapter=spec.name,
        )
    if spec.target_regex:
        target_pattern(spec.target_regex)
    return spec


def adapter_param_specs(linears: Mapping[str, LinearShape], spec: LoraSpec, max_rank: int = 0) -> dict[str, ParamSpec]:
    """Every tensor an adapter of ``spec`` carries for the base model whose linear modules are ``linears``.

    Args:
        linears: module name (e.g. ``"model.layers.0.self_attn.q_proj"``) -> its shape, for every
            linear module of the base model.
        max_rank: the highest rank the engine serves (vLLM's ``--max-lora-rank``); 0: any.

    Returns:
        PEFT name -> spec (served in :data:`LORA_DTYPE`), ``lora_A`` then ``lora_B`` per targeted module.

    Raises:
        InvalidArgument: BAD_ADAPTER_CONFIG, ADAPTER_RANK_TOO_LARGE, or NO_TARGET_MODULES when no
            linear module matches.
    """
    check_spec(spec)
    if max_rank and spec.rank > max_rank:
        raise InvalidArgument(
            "ADAPTER_RANK_TOO_LARGE",
            f"adapter {spec.name!r} has rank {spec.rank}; this engine serves ranks up to {max_rank}",
            adapter=spec.name,
        )
    out: dict[str, ParamSpec] = {}
    for module, shape in linears.items():
        if spec.targets(module):
            a, b = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
            out[a] = ParamSpec(a, LORA_DTYPE, (spec.rank, shape.in_features))
            out[b] = ParamSpec(b, LORA_DTYPE, (shape.out_features, spec.rank))
    if not out:
        # What the targets are is not repeated: they may come from a file (adapter_config.json).
        targets = "its target_modules regex" if spec.target_regex else f"its {len(spec.target_modules)} target_modules"
        raise InvalidArgument(
            "NO_TARGET_MODULES",
            f"adapter {spec.name!r}: no linear module of the base model matches {targets}",
            adapter=spec.name,
        )
    return out


def adapted_modules(names: Sequence[str]) -> list[str]:
    """The module names an adapter's tensors adapt (``base_model.model.<module>.lora_A.weight`` -> ``<module>``).

    What an engine hands on to a library that would match a ``target_modules`` regex with
    Python's ``re`` (PEFT): the modules already matched, in bounded time, by :meth:`LoraSpec.targets`.
    """
    out: set[str] = set()
    for n in names:
        for suffix in (".lora_A.weight", ".lora_B.weight"):
            if n.startswith(PEFT_PREFIX) and n.endswith(suffix):
                out.add(n[len(PEFT_PREFIX) : -len(suffix)])
    return sorted(out)


_UNSUPPORTED: Mapping[str, Any] = {
    "use_dora": False,
    "use_rslora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "bias": "none",
}
"""PEFT ``LoraConfig`` fields engines serve only at their default value (other values change the math)."""


def lora_spec_from_config(name: str, config: Mapping[str, Any]) -> LoraSpec:
    """The :class:`LoraSpec` of a PEFT ``adapter_config.json`` (parsed), named ``name``.

    Error messages name the fields at fault, never their values (the file's content).

    Raises:
        InvalidArgument: NOT_A_LORA_ADAPTER (another PEFT method), UNSUPPORTED_ADAPTER (DoRA,
            rsLoRA, bias, modules_to_save, per-layer ranks...), BAD_ADAPTER_CONFIG.
    """
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument("NOT_A_LORA_ADAPTER", f"adapter {name!r} is not a LoRA adapter (its peft_type)")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}, []) and not (key == "bias" and value == "none"):
            raise InvalidArgument(
                "UNSUPPORTED_ADAPTER",
                f"adapter {name!r} sets {key} to other than {default!r}, which engines do not serve",
            )
    targets = config.get("target_modules")
    try:
        rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
    except (TypeError, ValueError):
        raise InvalidArgument("BAD_ADAPTER_CONFIG", f"adapter {name!r}: r and lora_alpha must be numbers") from None
    if isinstance(targets, str):
        return check_spec(LoraSpec(name, rank, alpha, target_regex=targets))
    if not isinstance(targets, Sequence) or not all(isinstance(t, str) for t in targets):
        raise InvalidArgument("BAD_ADAPTER_CONFIG", f"adapter {name!r}: target_modules must be names or a regex")
    return check_spec(LoraSpec(name, rank, alpha, tuple(sorted(targets))))


@dataclass(frozen=True)
class AdapterState:
    """One LoRA adapter an engine serves (``wsync.v1.AdapterInfo``).

    Attributes:
        name, rank, alpha, target_modules: its :class:`LoraSpec` fields
            (``target_modules`` holds the regex when the adapter was configured with one).
        version: the version it was loaded as.
        tensor_count: its lora_A/lora_B tensors.
    """

    name: str
    version: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    tensor_count: int


@runtime_checkable
class LoraAdapters(Protocol):
    """Optional: an engine that serves LoRA adapters beside its base weights, named by generation requests.

    Loading or replacing an adapter is an update (``PrepareHeader.adapter``):
    its tensors are validated against :meth:`lora_linears` before anything
    changes and handed to :meth:`load_adapter` at Complete.
    """

    def lora_linears(self) -> Mapping[str, LinearShape]:
        """Module name -> shape of every linear module of the base model an adapter may target."""
        ...

    def lora_max_rank(self) -> int:
        """The highest adapter rank the engine serves (vLLM's ``--max-lora-rank``); 0: any."""
        ...

    def load_adapter(self, spec: LoraSpec, version: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Serve ``tensors`` (PEFT names, see :func:`adapter_param_specs`) as adapter ``spec``.

        Replaces an adapter of the same name: from this call on no token is
        computed with the old one (requests running with it recompute their
        context with the new one). The caller holds :meth:`~wsync_grpc.core.engine.Engine.weights_lock`.

        Returns:
            The number of tensors loaded.

        Raises:
            ValueError: tensors that do not fit ``spec`` (the old adapter, if any, keeps serving).
        """
        ...

    def unload_adapter(self, name: str) -> tuple[str, int] | None:
        """Stop serving adapter ``name``; ``(its version, requests aborted)``, or ``None`` if not served."""
        ...

    def adapters(self) -> list[AdapterState]:
        """The adapters served, by name."""
        ...
