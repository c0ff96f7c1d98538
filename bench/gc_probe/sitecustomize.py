"""A probe of garbage-collection pauses for the vLLM tail case (:mod:`bench.vllm_tail_case`).

On ``PYTHONPATH`` of an engine (and so of vLLM's engine core and worker processes, which inherit it),
Python imports this module at start-up; with ``WSYNC_BENCH_GC_LOG`` set to a directory it appends
one line per collection of the oldest generation, and per other collection of at least
:data:`SLOW_S`, to ``<dir>/gc-<pid>.log``: ``start duration generation collected comm thread``
(``start``: ``CLOCK_MONOTONIC`` seconds, which every process of the host shares). Without the
variable it does nothing. Being a ``sitecustomize``, it hides any other one later on the path, in
those processes only.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

SLOW_S = 0.02
"""Collections of the younger generations at least this long are logged too, in seconds."""
ENV = "WSYNC_BENCH_GC_LOG"


def install(directory: str) -> Callable[[str, dict[str, Any]], None]:
    """Log this process's collections into ``directory`` (see the module's docstring); the callback
    installed (remove it from ``gc.callbacks`` to stop)."""
    started: dict[int, float] = {}
    path = os.path.join(directory, f"gc-{os.getpid()}.log")

    def callback(phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            started[me] = time.monotonic()
            return
        t0 = started.pop(me, None)
        if t0 is None:
            return
        took = time.monotonic() - t0
        if info["generation"] < 2 and took < SLOW_S:
            return
        try:
            with open(f"/proc/{os.getpid()}/comm") as f:
                comm = f.read().strip().replace(" ", "_")
            with open(path, "a") as f:
                name = threading.current_thread().name.replace(" ", "_")
                f.write(f"{t0:.6f} {took:.6f} {info['generation']} {info['collected']} {comm} {name}\n")
        except OSError:
            pass

    gc.callbacks.append(callback)
    return callback


if os.environ.get(ENV):
    install(os.environ[ENV])
