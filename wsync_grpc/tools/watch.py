"""``wsync watch``: one or more engines' status, live (state, version, the update in flight, last error).

Every ``--interval`` seconds it asks each engine for ``GetStatus`` and prints one line per
engine: for people by default, or one JSON object per line with ``--json`` (the ``GetStatus``
reply with a ``target`` field, for scripts), or, with ``--bars``, one progress bar per engine
(``tqdm``) that fills with the bytes of the update in flight. An engine that does not answer gets
a line that says so, and the others go on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from tqdm import tqdm
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.tools import options

DEFAULT_INTERVAL_S = 1.0
"""Time between two rounds, in seconds."""


def describe(target: str, st: pb.GetStatusResponse) -> str:
    """One line for people: state, admission, version, the update in flight (buckets and MB), last error."""
    state = pb.LifecycleState.Name(st.state).removeprefix("LIFECYCLE_STATE_")
    parts = [target, state, "paused" if st.paused else "serving", f"version={st.weight_version or '-'}"]
    if st.dirty:
        parts.append("DIRTY")
    if st.HasField("update"):
        u = st.update
        parts.append(
            f"update={u.weight_version} {u.buckets_received}/{u.buckets_expected} buckets "
            f"{u.bytes_received / 1e6:.1f}/{u.bytes_expected / 1e6:.1f} MB {u.elapsed_seconds:.1f} s"
        )
    if st.HasField("last_error"):
        parts.append(f"last_error={st.last_error.reason}")
    return "  ".join(parts)


def watch(
    targets: list[str],
    channel: Callable[[str], grpc.Channel],
    metadata: tuple[tuple[str, str | bytes], ...],
    *,
    interval_s: float,
    count: int,
    as_json: bool,
    timeout_s: float,
    out: TextIO = sys.stdout,
    bars: bool = False,
) -> int:
    """Print ``count`` rounds (0: until interrupted) of every target's status; 0 once done.

    Args:
        channel: opens the channel to a target (plaintext or TLS, as the CLI was told).
        metadata: the call metadata (token).
        interval_s: time between two rounds, in seconds.
        timeout_s: deadline of each GetStatus, in seconds.
        bars: one progress bar per engine instead of lines.
    """
    channels = {t: channel(t) for t in targets}
    stubs = {t: weight_sync_pb2_grpc.WeightSyncServiceStub(c) for t, c in channels.items()}
    shown = new_bars(list(stubs), out) if bars else {}

    def show(t: str, stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> None:
        if bars:
            update_bar(shown[t], t, stub, metadata, timeout_s)
        else:
            print(_line(t, stub, metadata, as_json, timeout_s), file=out, flush=True)

    rounds = 0
    try:
        while count == 0 or rounds < count:
            if rounds:
                time.sleep(interval_s)
            rounds += 1
            for t, stub in stubs.items():
                show(t, stub)
    except KeyboardInterrupt:
        pass
    finally:
        for bar in shown.values():
            bar.close()
        for c in channels.values():
            c.close()
    return 0


def new_bars(targets: list[str], out: TextIO) -> dict[str, tqdm[Any]]:
    """One empty byte progress bar per target, stacked in target order on ``out``."""
    return {t: tqdm(total=0, desc=t, position=i, file=out, unit="B", unit_scale=True) for i, t in enumerate(targets)}


def update_bar(
    bar: tqdm[Any],
    target: str,
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub,
    metadata: tuple[tuple[str, str | bytes], ...],
    timeout_s: float,
) -> None:
    """Fill ``bar`` with the bytes of ``target``'s update in flight; its state and version as description.

    Used by ``wsync watch --bars`` and ``wsync reload``; an engine that does not answer shows its code.
    """
    try:
        st = stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        call: Any = e
        bar.set_description_str(f"{target} {call.code().name}", refresh=False)
        bar.refresh()
        return
    state = pb.LifecycleState.Name(st.state).removeprefix("LIFECYCLE_STATE_")
    desc = f"{target} {state} version={st.weight_version or '-'}"
    if st.HasField("update"):
        u = st.update
        bar.total, bar.n = u.bytes_expected, u.bytes_received
        desc += f" update={u.weight_version} {u.buckets_received}/{u.buckets_expected} buckets"
    else:
        bar.total, bar.n = 0, 0
    if st.HasField("last_error"):
        desc += f" last_error={st.last_error.reason}"
    bar.set_description_str(desc, refresh=False)
    bar.refresh()


def _line(
    target: str,
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub,
    metadata: tuple[tuple[str, str | bytes], ...],
    as_json: bool,
    timeout_s: float,
) -> str:
    try:
        st = stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        call: Any = e
        if as_json:
            return json.dumps({"target": target, "error": call.code().name, "message": call.details()})
        return f"{target}  {call.code().name}: {call.details()}"
    if as_json:
        d = json_format.MessageToDict(st, preserving_proto_field_name=True)
        return json.dumps({"target": target, **d})
    return describe(target, st)


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """The ``wsync watch TARGET [TARGET ...]`` sub-command; ``common`` adds the token and TLS options."""
    w = sub.add_parser("watch", help="show engines' status live (state, version, update in flight, last error)")
    w.add_argument("targets", type=options.target, nargs="+", help="engine addresses host:port")
    w.add_argument("--interval", type=options.seconds, default=DEFAULT_INTERVAL_S, help="seconds between two rounds")
    w.add_argument("--count", type=options.count, default=0, help="rounds to print (default: until interrupted)")
    w.add_argument("--json", action="store_true", help="one JSON object per engine and round")
    w.add_argument("--bars", action="store_true", help="one progress bar per engine (bytes of the update in flight)")
    w.add_argument("--timeout", type=options.seconds, default=10.0, help="deadline of each GetStatus, in seconds")
    common(w)
    w.set_defaults(func=run)
