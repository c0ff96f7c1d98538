"""``wsync reload``: every engine named loads one safetensors checkpoint from its disk, as one committed update.

The operator's and the script's ``update_weights_from_disk``: it drives a
:class:`~wsync_grpc.trainer.client.TrainerClient`'s
:meth:`~wsync_grpc.trainer.client.TrainerClient.sync_from_disk` (validated on
every engine before a byte is read; staged updates published on every engine
or on none), shows one progress bar per engine (bytes of the checkpoint read)
on stderr, and prints the result as JSON. Exit 0 once applied everywhere, 1
on a refusal or failure (the error names every engine, its code and reason).
With ``--adapter NAME`` the checkpoint is a PEFT directory loaded as that LoRA
adapter (:meth:`~wsync_grpc.trainer.client.TrainerClient.sync_adapter`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import grpc

from wsync_grpc.tools import options
from wsync_grpc.tools.watch import new_bars, update_bar
from wsync_grpc.trainer.client import TrainerClient
from wsync_grpc.trainer.results import SyncError, SyncResult

BAR_INTERVAL_S = 0.2
"""Time between two refreshes of the progress bars, in seconds."""


def reload(
    targets: list[str],
    checkpoint: str,
    version: str,
    *,
    apply_mode: str,
    flush_cache: bool,
    owner: str | None,
    timeout_s: float,
    token: str | None,
    credentials: grpc.ChannelCredentials | None,
    bars: bool = True,
    adapter: str = "",
) -> int:
    """Have every target load ``checkpoint`` as ``version``; print the result as JSON; 0 once applied.

    Args:
        adapter: load the PEFT directory ``checkpoint`` as this LoRA adapter (``""``: base weights).
        timeout_s: deadline of each control call, in seconds.
        token, credentials: as :class:`~wsync_grpc.trainer.client.TrainerClient`'s.
        bars: one progress bar per engine on stderr.
    """
    with TrainerClient(targets, rpc_timeout_s=timeout_s, token=token, credentials=credentials, owner=owner) as client:
        done = threading.Event()
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                if adapter:
                    result["ok"] = client.sync_adapter(checkpoint, adapter, version)
                else:
                    result["ok"] = client.sync_from_disk(
                        checkpoint,
                        version,
                        apply_mode=apply_mode,  # type: ignore[arg-type]
                        flush_cache=flush_cache,
                    )
            except (SyncError, ValueError, RuntimeError) as e:
                result["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="wsync-reload", daemon=True).start()
        _show(client, done, bars, timeout_s)
    if "error" in result:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    print(json.dumps(summary(result["ok"]), indent=2))
    return 0


def _show(client: TrainerClient, done: threading.Event, bars: bool, timeout_s: float) -> None:
    """One bar per engine, refreshed until ``done``."""
    if not bars:
        done.wait()
        return
    stubs = client.stubs
    shown = new_bars(list(stubs), sys.stderr)
    try:
        while not done.wait(BAR_INTERVAL_S):
            for t, stub in stubs.items():
                update_bar(shown[t], t, stub, client.call_metadata, timeout_s)
    finally:
        for bar in shown.values():
            bar.close()


def summary(r: SyncResult) -> dict[str, Any]:
    """What ``wsync reload`` prints: the update, its sizes (bytes), its phases and each engine's result (seconds)."""
    keys = ("update_id", "weight_version", "apply_mode", "bucket_count", "tensor_count", "payload_bytes")
    out: dict[str, Any] = {k: getattr(r, k) for k in keys}
    out["total_seconds"] = r.total_seconds
    out["phases"] = r.phases
    out["engines"] = {t: asdict(e) for t, e in r.engines.items()}
    return out


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """The ``wsync reload --checkpoint DIR --version V [--target T ...]`` sub-command."""
    r = sub.add_parser("reload", help="have engines load a safetensors checkpoint from their disk (one update)")
    r.add_argument(
        "--checkpoint",
        type=options.non_empty,
        required=True,
        help="checkpoint directory or .safetensors file, as engines see it",
    )
    r.add_argument(
        "--version", type=options.non_empty, required=True, help="the weight version the engines serve afterwards"
    )
    r.add_argument(
        "--target",
        type=options.target,
        action="append",
        help="engine address host:port (repeatable; default 127.0.0.1:50051)",
    )
    r.add_argument("--apply-mode", choices=("staged", "streaming"), default="staged", help="default staged")
    r.add_argument("--flush-cache", action="store_true", help="flush the engines' prefix/KV cache at apply")
    r.add_argument("--adapter", default="", help="load the PEFT directory --checkpoint as this LoRA adapter")
    r.add_argument("--owner", help="the caller's owner name (default: a fresh one)")
    r.add_argument("--no-bars", action="store_true", help="no progress bars on stderr")
    r.add_argument("--timeout", type=options.seconds, default=60.0, help="deadline of each control call, in seconds")
    common(r)
    r.set_defaults(func=run)
