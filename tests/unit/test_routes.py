"""Which local address reaches a peer (``master_address="auto"``, gloo's listening address)."""

from __future__ import annotations

import pytest

from wsync_grpc.group.routes import gloo_listen_address, local_address_to, own_address, route_address, target_host
from wsync_grpc.trainer import TrainerClient


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("10.0.0.2:50051", "10.0.0.2"),
        ("engine-1.example:50051", "engine-1.example"),
        ("[fd00::2]:50051", "fd00::2"),
        ("dns:///engine-1.example:50051", "engine-1.example"),
        ("dns://8.8.8.8/engine-1.example:50051", "engine-1.example"),
        ("dns:engine-1.example:50051", "engine-1.example"),
        ("ipv4:10.0.0.2:50051,10.0.0.3:50051", "10.0.0.2"),
        ("ipv6:[fd00::2]:50051", "fd00::2"),
        ("unix:/run/wsync.sock", "localhost"),
        ("engine-1", "engine-1"),
    ],
)
def test_the_host_of_a_grpc_target(target: str, host: str) -> None:
    assert target_host(target) == host


def test_a_target_without_a_host_is_refused() -> None:
    with pytest.raises(ValueError, match="no host"):
        target_host(":50051")


def test_an_address_of_this_host_is_reached_from_itself() -> None:
    assert local_address_to("127.0.0.1") == "127.0.0.1"
    assert local_address_to("127.0.0.5") == "127.0.0.1"  # the route's source: lo's first address
    assert own_address("127.0.0.5") == "127.0.0.5"  # but 127.0.0.5 is this host's own
    assert own_address("198.51.100.77") is None  # TEST-NET-2: nobody's
    assert route_address("127.0.0.1:50051") == "127.0.0.1"
    assert gloo_listen_address("127.0.0.1") == "127.0.0.1"
    assert gloo_listen_address("127.0.0.5") == "127.0.0.5"  # the store's host listens where the store does


def test_gloo_keeps_the_operators_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert gloo_listen_address("127.0.0.1") is None  # torch's device then takes GLOO_SOCKET_IFNAME


def test_a_name_that_does_not_resolve_has_no_route() -> None:
    assert local_address_to("no-such-host.invalid") is None
    with pytest.raises(ValueError, match="no route"):
        route_address("no-such-host.invalid:50051")


def test_an_empty_master_address_is_refused() -> None:
    with pytest.raises(ValueError, match="master_address"):
        TrainerClient(["127.0.0.1:50051"], master_address="")
