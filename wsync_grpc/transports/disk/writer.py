"""The disk transport's writing side: a trainer's tensors saved as the safetensors checkpoint engines read.

:func:`save_checkpoint` writes one file atomically (a reader never sees half a
file; one still reading the previous file keeps reading it), with tied tensors
written once, as a broadcast sends them. ``TrainerClient.save_and_sync`` writes
with it, then has every engine read the file (:mod:`wsync_grpc.trainer.disk`).

Units: sizes in bytes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from wsync_grpc.core.planning import unique_tensors

CHECKPOINT_FILE = "model.safetensors"
"""The file :func:`save_checkpoint` writes (a Hugging Face single-file checkpoint's name)."""


def save_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike[str]) -> Path:
    """Write ``named_tensors`` to ``directory/model.safetensors`` (created if needed); return the file.

    Tensors sharing memory (tied embeddings) are written once, under their
    first name, as :meth:`~wsync_grpc.trainer.client.TrainerClient.sync` sends
    them (:func:`~wsync_grpc.core.planning.unique_tensors`). Tensors are
    detached, made contiguous and moved to CPU. The file is written beside its
    final name and renamed into place, so an engine never reads half of it.

    Raises:
        ValueError: no tensors, or a name given twice.
        OSError: the directory cannot be written.
    """
    out = {meta.name: t.detach().to("cpu").contiguous() for meta, t in unique_tensors(named_tensors)}
    if not out:
        raise ValueError("nothing to save: no tensors given")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".wsync-", suffix=".safetensors.tmp", dir=d)
    os.close(fd)
    try:
        save_file(out, tmp)
        os.replace(tmp, d / CHECKPOINT_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return d / CHECKPOINT_FILE
