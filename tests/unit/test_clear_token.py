"""The CLI and ``TrainerClient`` refuse to send a token in clear to a target that is not on this host."""

from __future__ import annotations

import grpc
import pytest

from wsync_grpc.tools import cli
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.wire.targets import check_clear_token, target_host

REMOTE = "10.1.2.3:50051"


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("127.0.0.1:50051", "127.0.0.1"),
        ("[::1]:50051", "::1"),
        ("localhost:7", "localhost"),
        ("dns:///engine-3:50051", "engine-3"),
        ("dns://8.8.8.8/engine-3:50051", "engine-3"),
        ("ipv4:10.0.0.2:5", "10.0.0.2"),
        ("ipv6:[fe80::1]:5", "fe80::1"),
        ("unix:/tmp/wsync.sock", ""),
        ("engine", "engine"),
    ],
)
def test_the_host_of_a_target(target: str, host: str) -> None:
    assert target_host(target) == host


@pytest.mark.parametrize("target", ["127.0.0.1:1", "127.9.8.7:2", "[::1]:3", "localhost:4", "LOCALHOST:5", "unix:/s"])
def test_a_loopback_target_may_get_a_token_in_clear(target: str) -> None:
    check_clear_token(target)
    TrainerClient([target], token="secret").close()


@pytest.mark.parametrize("target", [REMOTE, "engine-3:50051", "dns:///engine-3:50051", "[2001:db8::1]:5"])
def test_the_trainer_client_refuses_a_token_in_clear_to_another_host(target: str) -> None:
    with pytest.raises(ValueError, match="refusing to send a token in clear") as e:
        TrainerClient([target], token="secret")
    assert target in str(e.value) and "TLS" in str(e.value)
    TrainerClient([target]).close()  # no token: nothing to protect
    TrainerClient([target], token="secret", credentials=grpc.ssl_channel_credentials()).close()


def test_an_engine_added_later_is_checked_too() -> None:
    with TrainerClient(["127.0.0.1:1"], token="secret") as client, pytest.raises(ValueError, match=REMOTE):
        client.add_engine(REMOTE)


@pytest.mark.parametrize(
    "argv", [["status"], ["leave", "--force"], ["watch"], ["reload", "--checkpoint", "/ckpt", "--version", "v"]]
)
def test_the_cli_refuses_a_token_in_clear_to_another_host(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WSYNC_TOKEN", "secret")
    command, *rest = argv
    target = [REMOTE] if command == "watch" else ["--target", REMOTE]
    assert cli.main([command, *target, *rest]) == 2
    err = capsys.readouterr().err
    assert f"refusing to send a token in clear to {REMOTE}" in err and "TLS" in err
    assert "secret" not in err
