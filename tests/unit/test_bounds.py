"""The server's bounds as plain values: caps on what callers choose, classes of calls, keepalive, loopback."""

from __future__ import annotations

import pytest

from wsync_grpc.core.timeouts import MAX_INTERVAL_S, ServerBounds
from wsync_grpc.service.auth import is_loopback
from wsync_grpc.service.call_limits import (
    DEFAULT_CALL_LIMITS,
    SPARE_THREADS,
    CallClass,
    CallLimits,
    call_classes,
    request_class,
)
from wsync_grpc.wire.keepalive import Keepalive


def test_durations_beyond_a_cap_are_clamped_and_those_within_kept() -> None:
    b = ServerBounds(max_timeout_s=30, max_lease_ttl_s=7, min_interval_s=0.2)
    assert (b.timeout(1e9), b.timeout(5)) == (30, 5)
    assert (b.lease_ttl(1e9), b.lease_ttl(3)) == (7, 3)
    assert (b.interval(1e-6), b.interval(1.0), b.interval(1e9)) == (0.2, 1.0, MAX_INTERVAL_S)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_timeout_s": 0},
        {"max_lease_ttl_s": -1},
        {"min_interval_s": 0},
        {"update_idle_s": 0},
        {"min_interval_s": 61},
    ],
)
def test_bounds_that_cannot_work_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ServerBounds(**kw)


@pytest.mark.parametrize(
    ("method", "classes"),
    [
        ("/wsync.v1.WeightSyncService/Complete", (CallClass.CONTROL,)),
        ("/wsync.v1.WeightSyncService/Prepare", (CallClass.CONTROL,)),
        ("/wsync.v1.WeightSyncService/KeepAlive", (CallClass.LEASE,)),
        ("/wsync.v1.WeightSyncService/Watch", (CallClass.WATCH, CallClass.LEASE)),
        ("/wsync.v1.GenerationService/Generate", (CallClass.SERVING,)),
        ("/grpc.health.v1.Health/Check", (CallClass.HEALTH,)),
        ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", (CallClass.REFLECTION,)),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", (CallClass.REFLECTION,)),
    ],
)
def test_every_method_has_its_class(method: str, classes: tuple[CallClass, ...]) -> None:
    assert call_classes(method) == classes


def test_a_held_watch_is_a_lease_and_an_observers_watch_is_not() -> None:
    class Req:
        def __init__(self, hold: bool) -> None:
            self.hold = hold

    watch = "/wsync.v1.WeightSyncService/Watch"
    assert request_class(watch, Req(True)) is CallClass.LEASE
    assert request_class(watch, Req(False)) is CallClass.WATCH


def test_limits_parse_class_n_and_keep_the_defaults_for_the_others() -> None:
    limits = CallLimits.parse(["serving=64", "reflection = 1"])
    assert limits.maxima[CallClass.SERVING] == 64 and limits.maxima[CallClass.REFLECTION] == 1
    assert limits.maxima[CallClass.CONTROL] == DEFAULT_CALL_LIMITS[CallClass.CONTROL]
    assert limits.pool_threads() == sum(limits.maxima.values()) + SPARE_THREADS
    for bad in ("serving", "serving=x", "everything=3", "watch=0"):
        with pytest.raises(ValueError):
            CallLimits.parse([bad])


def test_keepalive_options_carry_milliseconds_on_both_ends() -> None:
    k = Keepalive(interval_s=10, timeout_s=20)
    server, channel = dict(k.server_options()), dict(k.channel_options())
    for options in (server, channel):
        assert options["grpc.keepalive_time_ms"] == 10_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert server["grpc.http2.max_ping_strikes"] == 0 and k.bound_s == 30
    with pytest.raises(ValueError):
        Keepalive(timeout_s=0)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.2", False),
        ("engine-1", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
