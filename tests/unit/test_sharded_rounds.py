"""The sharded trainer's rank protocol as one table of rounds: every command has one round with both halves,
declared once. The rounds themselves run between real trainer ranks in
``tests/integration/test_sharded_trainer.py``."""

from __future__ import annotations

import inspect

import pytest

from wsync_grpc.trainer.sharded import rounds
from wsync_grpc.trainer.sharded.follower import FollowedCall
from wsync_grpc.trainer.sharded.ranks import Command
from wsync_grpc.trainer.sharded.rounds import ROUNDS, Round

LEADS: dict[Command, list[str]] = {
    Command.JOIN: ["ranks", "port", "world_size"],
    Command.GATHER: ["ranks", "source", "bucket"],
    Command.DIGESTS: ["ranks", "job"],
    Command.RINGS: ["ranks", "job", "own"],
    Command.SEND: ["ranks", "job", "own", "waiting"],
    Command.SENT: ["ranks", "stop"],
    Command.OUTCOME: ["ranks", "outcome"],
    Command.AGAIN: ["ranks"],
}
"""What each round's leader half takes (what its leader has at hand)."""


def test_every_command_has_exactly_one_round_with_both_halves() -> None:
    commands = [c for c in Command if c is not Command.NONE]  # NONE is a follower's slot, never led
    assert sorted(ROUNDS) == sorted(commands)
    declared = Round.__subclasses__()
    assert sorted(r.command for r in declared) == sorted(commands), "one round class per command"
    for command, r in ROUNDS.items():
        cls = type(r)
        assert r.command is command and cls in declared
        assert "lead" in vars(cls) and "follow" in vars(cls), f"{cls.__name__} lacks a half"
        assert list(inspect.signature(r.follow).parameters) == ["call", "arg", "arg2"]
        assert list(inspect.signature(cls.lead).parameters)[1:] == LEADS[command]
        assert getattr(rounds, command.name) is r, f"the round of {command.name} is rounds.{command.name}"


def test_a_round_without_both_halves_is_refused_where_it_is_declared() -> None:
    with pytest.raises(TypeError, match="lacks lead"):

        class HalfRound(Round):  # pragma: no cover - refused as it is declared
            command = Command.SENT

            def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
                pass


def test_a_ranks_ring_handle_travels_as_the_contracts_message_cuda_ipc_included() -> None:
    """The RINGS exchange carries each rank's handle as a serialized ``wsync.v1.SharedMemoryHandle``: every field
    comes back, a GPU ring's ``cuda_ipc`` too; anything else is a ``ValueError``."""
    from wsync_grpc.core.header import CudaIpcMemory, SharedMemoryHandle

    memfd = SharedMemoryHandle("wsync-shm-abc", b"\x01" * 32, "boot", 1 << 20, 2, True)
    gpu = SharedMemoryHandle(
        "wsync-shm-def", b"\x02" * 32, "boot", 1 << 20, 2, False, CudaIpcMemory("GPU-uuid", b"\x03" * 64, 0, 2 << 20)
    )
    for h in (memfd, gpu):
        assert rounds.decode_handle(rounds.encode_handle(h)) == h
    with pytest.raises(ValueError, match="SharedMemoryHandle"):
        rounds.decode_handle(b"\xff\xff not a message")
