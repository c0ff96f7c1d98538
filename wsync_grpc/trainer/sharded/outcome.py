"""A collective call's outcome as trainer rank 0 shares it with the other ranks: JSON, never pickle.

Rank 0 runs the update against the engines; every other rank returns the same
:class:`~wsync_grpc.trainer.results.SyncResult` or raises the same
:class:`~wsync_grpc.trainer.results.SyncError` (same stage, failures, per-engine results), rebuilt
here from plain JSON values.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import grpc

from wsync_grpc.trainer.results import ClientError, DeltaSummary, EngineFailure, EngineSyncResult, SyncError, SyncResult

__all__ = ["decode_outcome", "encode_error", "encode_result"]


def encode_result(result: SyncResult | None) -> bytes:
    """``result`` (``None``: the call had nothing to do, e.g. a catch-up with no engine behind) as the JSON
    bytes :func:`decode_outcome` turns back into it."""
    if result is None:
        return json.dumps({"ok": True, "result": None}).encode()
    fields = dataclasses.asdict(dataclasses.replace(result, excluded={}))
    fields["excluded"] = {t: _failure(f) for t, f in result.excluded.items()}
    return json.dumps({"ok": True, "result": fields}).encode()


def _failure(f: EngineFailure) -> dict[str, Any]:
    return {
        "target": f.target,
        "rpc": f.rpc,
        "code": f.code.name if f.code is not None else None,
        "reason": f.reason,
        "message": f.message,
        "metadata": dict(f.metadata),
    }


def encode_error(exc: BaseException) -> bytes:
    """What rank 0's call raised, as JSON bytes: a :class:`SyncError` whole, anything else by type and message."""
    if isinstance(exc, SyncError):
        return json.dumps(
            {
                "ok": False,
                "kind": "SyncError",
                "message": str(exc),
                "stage": exc.stage,
                "update_id": exc.update_id,
                "weight_version": exc.weight_version,
                "failures": {t: _failure(f) for t, f in exc.failures.items()},
                "results": {t: dataclasses.asdict(r) for t, r in exc.results.items()},
                "cancelled": exc.cancelled,
                "broadcast_started": exc.broadcast_started,
            }
        ).encode()
    kind = "ValueError" if isinstance(exc, ValueError) else "ClientError"
    return json.dumps({"ok": False, "kind": kind, "message": f"{type(exc).__name__}: {exc}"}).encode()


def _decode_failure(f: dict[str, Any]) -> EngineFailure:
    return EngineFailure(**{**f, "code": grpc.StatusCode[f["code"]] if f["code"] else None})


def decode_outcome(payload: bytes) -> SyncResult | None:
    """The result rank 0 shared (``None``: the call had nothing to do), or its error raised here.

    Raises:
        SyncError: rank 0's update failed (as rank 0 raised it).
        ValueError: rank 0 refused the call's arguments.
        ClientError: anything else rank 0 raised (its type and message in the message).
    """
    d = json.loads(payload)
    if d["ok"]:
        r = d["result"]
        if r is None:
            return None
        engines = {t: EngineSyncResult(**e) for t, e in r.pop("engines").items()}
        excluded = {t: _decode_failure(f) for t, f in r.pop("excluded").items()}
        delta = r.pop("delta", None)
        summary = None if delta is None else DeltaSummary(**{**delta, "whole_targets": tuple(delta["whole_targets"])})
        return SyncResult(**r, engines=engines, excluded=excluded, delta=summary)
    if d["kind"] == "SyncError":
        failures = {t: _decode_failure(f) for t, f in d["failures"].items()}
        raise SyncError(
            f"trainer rank 0: {d['message']}",
            stage=d["stage"],
            update_id=d["update_id"],
            weight_version=d["weight_version"],
            failures=failures,
            results={t: EngineSyncResult(**e) for t, e in d["results"].items()},
            cancelled=d["cancelled"],
            broadcast_started=d["broadcast_started"],
        )
    if d["kind"] == "ValueError":
        raise ValueError(f"trainer rank 0: {d['message']}")
    raise ClientError(f"trainer rank 0: {d['message']}")
