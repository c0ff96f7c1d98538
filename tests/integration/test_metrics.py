"""Prometheus metrics scraped over HTTP from a real engine after real syncs (good, refused, cancelled).

The engine runs as ``wsync serve --synthetic tiny --metrics-port P``; the trainer's own registry
(``TrainerClient.metrics_registry``) is read in-process, and each sync's phase split is checked to
add up to its total.
"""

from __future__ import annotations

import json
import random
import string
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import ENV, ROOT, free_port
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.server import build_server
from wsync_grpc.testing import EngineProcess, spawn_engine
from wsync_grpc.trainer import SyncError, SyncResult, TrainerClient

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(all_: Samples, name: str, **labels: str) -> float:
    return all_.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[EngineProcess, int]]:
    """An engine with metrics on a free port, logging JSON lines (``WSYNC_LOG_FORMAT=json``) to engine.log."""
    port = free_port()
    e = spawn_engine(
        ["--synthetic", "tiny", "--dtype", "bfloat16", "--grace", "1", "--metrics-port", str(port)],
        port_file=tmp_path / "engine.port",
        log=tmp_path / "engine.log",
        env={**ENV, "WSYNC_LOG_FORMAT": "json"},
        cwd=ROOT,
    )
    yield e, port
    e.stop()


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return samples(r.read().decode())


@pytest.mark.timeout(180)
def test_metrics_after_good_refused_and_cancelled_syncs(engine: tuple[EngineProcess, int]) -> None:
    proc, port = engine
    model = synthetic.build("tiny", seed=1, dtype=torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    results: list[SyncResult] = []
    with TrainerClient([proc.target], rpc_timeout_s=30) as client:
        results.append(client.sync(model.items(), "v1"))
        results.append(client.sync(model.items(), "v2", apply_mode="streaming"))
        with pytest.raises(SyncError) as refused:  # a tensor the engine does not have
            client.sync([*model.items(), ("model.nope.weight", torch.zeros(4))], "bad")
        assert refused.value.failures[proc.target].code == grpc.StatusCode.INVALID_ARGUMENT

        def cancel_once_prepared(phase: str) -> None:
            if phase == "prepared":
                client.cancel("metrics test")

        with pytest.raises(SyncError):
            client.sync(model.items(), "cancelled", on_phase=cancel_once_prepared)
        results.append(client.sync(model.items(), "v3"))
        m = scrape(port)
        trainer = samples(generate_latest(client.metrics_registry).decode())

    # Updates by outcome and reason; a refused Prepare is no update, only a refused RPC.
    assert value(m, "wsync_updates_total", outcome="applied", reason="") == 3
    assert value(m, "wsync_updates_total", outcome="cancelled", reason="UPDATE_CANCELLED") == 1
    assert value(m, "wsync_update_duration_seconds_count", outcome="applied") == 3
    assert value(m, "wsync_update_duration_seconds_count", outcome="cancelled") == 1
    for phase, count in {"prepare": 3, "receive": 3, "verify": 2, "apply": 3}.items():
        assert value(m, "wsync_update_phase_duration_seconds_count", phase=phase) == count, phase
        assert value(m, "wsync_update_phase_duration_seconds_sum", phase=phase) >= 0
    assert value(m, "wsync_received_bytes_total") >= 3 * nbytes
    assert value(m, "wsync_rpcs_total", method="Prepare", code="INVALID_ARGUMENT") == 1
    assert value(m, "wsync_rpcs_total", method="Prepare", code="OK") == 4
    assert value(m, "wsync_rpcs_total", method="Complete", code="OK") == 5  # staged: two each
    assert value(m, "wsync_rpcs_total", method="Cancel", code="OK") >= 1
    assert value(m, "wsync_rpcs_total", method="Init", code="OK") >= 2  # re-formed after the cancel
    # Gauges, read from the engine's status at the scrape.
    assert value(m, "wsync_lifecycle_state", state="READY") == 1
    assert value(m, "wsync_lifecycle_state", state="FAILED") == 0
    assert value(m, "wsync_owner_present") == 1 and value(m, "wsync_updates_in_flight") == 0
    assert value(m, "wsync_paused") == 0 and value(m, "wsync_dirty") == 0
    assert value(m, "wsync_weight_version_info", weight_version="v3") == 1
    assert value(m, "wsync_receive_buffer_bytes") > 0  # CPU workers keep their buffers

    # The trainer's registry: the same phases, and the failures by stage.
    assert value(trainer, "wsync_trainer_syncs_total", outcome="applied", stage="") == 3
    assert value(trainer, "wsync_trainer_syncs_total", outcome="failed", stage="prepare") == 1
    failed = {dict(labels)["stage"]: v for (name, labels), v in trainer.items() if name == "wsync_trainer_syncs_total"}
    assert sum(failed.values()) == 3 + 2, failed  # the cancelled one at its broadcast or its verification
    for phase in ("plan", "init", "prepare", "pack", "broadcast", "verify", "apply", "total"):
        assert value(trainer, "wsync_trainer_sync_phase_duration_seconds_count", phase=phase) == 3, phase
    for r in results:  # disjoint phases that add up to the total, each covering what it names
        assert sum(r.phases.values()) == pytest.approx(r.total_seconds, rel=1e-9), (r.phases, r.total_seconds)
        assert all(v >= 0 for v in r.phases.values()), r.phases
        assert r.phases["broadcast"] >= r.broadcast_seconds, r.phases
        assert r.phases["verify"] == r.verify_seconds and (r.verify_seconds > 0) == (r.apply_mode == "staged")


def test_engine_logs_are_json_lines_with_log_format_json(engine: tuple[EngineProcess, int], tmp_path: Path) -> None:
    proc, _port = engine
    with TrainerClient([proc.target], rpc_timeout_s=30) as client:
        client.sync(synthetic.build("tiny", seed=2, dtype=torch.bfloat16).items(), "json-logged")
    proc.stop()
    lines = [ln for ln in (tmp_path / "engine.log").read_text().splitlines() if ln.startswith("{")]
    records = [json.loads(ln) for ln in lines]
    assert len(records) >= 4
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"] == "wsync_grpc.service.session" and "applied" in r["message"] for r in records)


def test_rpcs_refused_by_the_token_check_are_counted() -> None:
    """The RPC counter sits before the token check: UNAUTHENTICATED calls show up by method and code."""
    srv = build_server(TensorEngine(synthetic.build("tiny")), token="s3cret", metrics_port=0)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as e:
                    stub.GetStatus(pb.GetStatusRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=(("authorization", "Bearer s3cret"),))
        m = scrape(srv.metrics_http.server_port)
        assert value(m, "wsync_rpcs_total", method="GetStatus", code="UNAUTHENTICATED") == 2
        assert value(m, "wsync_rpcs_total", method="GetStatus", code="OK") == 1
    finally:
        srv.stop(1)


def rpc_series(m: Samples) -> set[frozenset[tuple[str, str]]]:
    """The label sets of every ``wsync_rpcs_total`` series."""
    return {labels for (name, labels) in m if name == "wsync_rpcs_total"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_made_up_method_names_add_at_most_one_unknown_series(token: str | None) -> None:
    """10k random method names (under wsync.v1's service and elsewhere) leave the series bounded.

    With a token, the token check answers every path (UNAUTHENTICATED), so the counter sees each
    made-up name; without one, gRPC answers UNIMPLEMENTED. Either way: one ``unknown`` series at most.
    """
    rng = random.Random(7)
    srv = build_server(TensorEngine(synthetic.build("tiny")), token=token, metrics_port=0)
    auth = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
            stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=auth)
            before = rpc_series(scrape(srv.metrics_http.server_port))
            paths = [
                rng.choice(["/wsync.v1.WeightSyncService/", "/wsync.v1.Made", "/x.Y/", "/"])
                + "".join(rng.choices(string.ascii_letters + string.digits + "._", k=rng.randint(1, 40)))
                for _ in range(10_000)
            ]
            codes = set()
            for chunk in range(0, len(paths), 500):
                calls = [ch.unary_unary(p).future(b"", timeout=30) for p in paths[chunk : chunk + 500]]
                for c in calls:
                    with pytest.raises(grpc.RpcError) as e:
                        c.result()
                    codes.add(e.value.code())  # type: ignore[attr-defined]
            assert codes == {grpc.StatusCode.UNAUTHENTICATED if token else grpc.StatusCode.UNIMPLEMENTED}
        m = scrape(srv.metrics_http.server_port)
        after = rpc_series(m)
        added = after - before
        code = "UNAUTHENTICATED" if token else "UNIMPLEMENTED"
        assert added == {frozenset({("method", "unknown"), ("code", code)})}, sorted(map(sorted, added))[:5]
        assert value(m, "wsync_rpcs_total", method="unknown", code=code) == 10_000
        assert value(m, "wsync_rpcs_total", method="GetStatus", code="OK") == 1
    finally:
        srv.stop(1)
