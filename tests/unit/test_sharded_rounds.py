"""The sharded trainer's rank protocol as one table of rounds: every command has one round with both halves,
and a follower's loop is a dispatch over that table (no ``torch.distributed`` here: the ranks are faked)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, cast

import pytest
import torch

from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.planning import PieceMeta, TensorMeta
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.trainer.request import BroadcastRequest
from wsync_grpc.trainer.results import EngineSyncResult, SyncError, SyncResult
from wsync_grpc.trainer.settings import client_settings
from wsync_grpc.trainer.sharded import rounds
from wsync_grpc.trainer.sharded.follower import FollowedCall, Follower
from wsync_grpc.trainer.sharded.outcome import encode_error, encode_result
from wsync_grpc.trainer.sharded.ranks import Command, TrainerRanks
from wsync_grpc.trainer.sharded.rounds import ROUNDS, Round, decode_digests, follow, own_digests

ENGINE = EngineSyncResult("127.0.0.1:1", "u1", "v1", 3, 272, 538_000_000, 0.1, 0.5, 0.2, 0.9, True, 0.05)
RESULT = SyncResult(
    "u1", "v1", "flattened", "staged", 3, 272, 538_000_000, 538_000_128, 0.0, 0.01, 0.1, 0.5, 0.02, 0.3, 0.1,
    0.9, {ENGINE.target: ENGINE},
)  # fmt: skip
LEADS: dict[Command, list[str]] = {
    Command.JOIN: ["ranks", "port", "world_size"],
    Command.GATHER: ["ranks", "source", "bucket"],
    Command.DIGESTS: ["ranks", "job"],
    Command.SEND: ["ranks", "job", "buffers", "waiting"],
    Command.SENT: ["ranks", "stop"],
    Command.OUTCOME: ["ranks", "outcome"],
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


class FakeRanks:
    """The rounds' view of :class:`TrainerRanks` on a follower (rank 1 of 2): rank 0's commands, scripted,
    ending with the outcome ``shared`` (its length the command's argument)."""

    rank = 1
    size = 2
    leader = False
    timeout_s = 5.0

    def __init__(self, *script: tuple[Command, int, int], shared: bytes = b"") -> None:
        self.shared = shared
        self._script = iter([*script, (Command.OUTCOME, len(shared), 0)])
        self.failures = 0
        self.exchanged: list[bytes] = []

    def follow(self) -> tuple[Command, int, int]:
        return next(self._script)

    def report_failure(self) -> None:
        self.failures += 1

    def broadcast(self, data: torch.Tensor, what: str) -> None:
        assert data.numel() == len(self.shared), what
        data.copy_(torch.frombuffer(bytearray(self.shared), dtype=torch.uint8))

    def exchange(self, payload: bytes, what: str) -> list[bytes]:
        self.exchanged.append(payload)
        return [b"", payload]  # rank 0's share: no bucket of its own here


class FakeSource:
    """Two whole tensors (``b`` this follower's, in the direct mode); gathering fails when asked to."""

    def __init__(self, direct: bool = False, fail: bool = False) -> None:
        self.direct = direct
        self.fail = fail
        self.tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float32)}
        self.asked: list[int] = []

    def metadata(self) -> list[TensorMeta] | list[PieceMeta]:
        if self.direct:
            return [PieceMeta(n, t.dtype, tuple(t.shape), r, None) for r, (n, t) in enumerate(self.tensors.items())]
        return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        self.asked.append(bucket.index)
        if self.fail:
            raise RuntimeError("gather broke")
        return {s.name: self.tensors[s.name] for s in bucket.tensors}


def _call(ranks: FakeRanks, source: FakeSource | None = None) -> FollowedCall:
    """What a follower holds while it follows one update of ``source`` (planned as rank 0 plans it)."""
    settings = client_settings(
        ["127.0.0.1:1"],
        master_address="127.0.0.1",
        master_port=None,
        group_name="",
        backend="",
        device=None,
        workers=None,
        rpc_timeout_s=5.0,
        group_timeout_s=5.0,
        bucket_bytes=1 << 20,
        alignment=256,
        ramp_bytes=0,
        solo_bytes=1 << 20,
    )
    follower = Follower(cast(TrainerRanks, ranks), settings, keep_buffers=None)
    source = source or FakeSource()
    topology = SendTopology.direct(2) if source.direct else SendTopology.gather(2)
    request = BroadcastRequest.create("v1", "flattened", "staged", 1 << 20, topology=topology)
    return follower.call(source, request)


def test_the_follower_dispatches_every_command_to_its_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop asks the table, command by command, and ends at the round that returns the outcome."""
    seen: list[tuple[Command, int, int]] = []
    for command, r in ROUNDS.items():

        def half(call: FollowedCall, arg: int, arg2: int, command: Command = command) -> Any:
            seen.append((command, arg, arg2))
            return RESULT if command is Command.OUTCOME else None

        monkeypatch.setattr(r, "follow", half)
    led = [(c, i, 10 * i) for i, c in enumerate(c for c in ROUNDS if c is not Command.OUTCOME)]
    shared = encode_result(RESULT)
    assert follow(_call(FakeRanks(*led, shared=shared))) is RESULT
    assert seen == [*led, (Command.OUTCOME, len(shared), 0)]


def test_a_command_without_a_round_stops_the_follower() -> None:
    with pytest.raises(AssertionError, match="unexpected command"):
        follow(_call(FakeRanks((Command.NONE, 0, 0))))


def test_the_outcome_round_returns_rank_0s_result() -> None:
    ranks = FakeRanks((Command.SENT, 0, 0), shared=encode_result(RESULT))
    assert follow(_call(ranks)) == RESULT and ranks.failures == 0


def test_a_gather_that_fails_is_reported_and_raised_after_rank_0s_result() -> None:
    source = FakeSource(fail=True)
    ranks = FakeRanks((Command.GATHER, 0, 0), (Command.SENT, 0, 0), shared=encode_result(RESULT))
    with pytest.raises(RuntimeError, match="gather broke"):
        follow(_call(ranks, source))
    assert source.asked == [0] and ranks.failures == 1


def test_rank_0s_error_is_raised_on_the_follower_with_its_own_as_the_cause() -> None:
    error = SyncError(
        "boom",
        stage="send",
        update_id="u1",
        weight_version="v1",
        failures={},
        results={},
        cancelled={},
        broadcast_started=True,
    )
    ranks = FakeRanks((Command.GATHER, 0, 0), shared=encode_error(error))
    with pytest.raises(SyncError, match="trainer rank 0: boom") as got:
        follow(_call(ranks, FakeSource(fail=True)))
    assert isinstance(got.value.__cause__, RuntimeError)


def test_the_digests_round_hashes_the_followers_own_buckets_and_takes_part_in_the_exchange() -> None:
    ranks = FakeRanks((Command.DIGESTS, 0, 0), shared=encode_result(RESULT))
    call = _call(ranks, FakeSource(direct=True))
    assert sorted(b.src for b in call.buckets) == [0, 1]
    assert follow(call) == RESULT
    (mine,) = ranks.exchanged
    want = own_digests(call.buckets, Layout.FLATTENED, call.source.bucket_tensors, 1)
    assert decode_digests(mine) == want and list(want) == [b.index for b in call.buckets if b.src == 1]
