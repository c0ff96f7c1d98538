"""The trainer's own ranks, kept in lockstep over a small gloo control group of their own.

A sharded trainer (FSDP2, ZeRO-3, Megatron) runs one process per rank, and every rank calls the
client collectively. Trainer rank 0 talks to the engines; the other ranks follow it. They agree on
what was called before anything moves (:meth:`TrainerRanks.agree`), then rank 0 leads one *round*
at a time (:meth:`TrainerRanks.lead`): a round is one ``all_gather`` of a short ``int64`` vector in
which rank 0 names a command (gather bucket k, the outcome) and every other
rank reports whether its part of the previous command failed. What each round does, on rank 0 and
on the others, is declared in :mod:`wsync_grpc.trainer.sharded.rounds`; this module is the means
(the control group's collectives), not the protocol. The rounds run on a process group of
their own (``torch.distributed.new_group(backend="gloo")`` over the trainer group's ranks), never on
the group the model trains on, so they neither interleave with the model's collectives nor depend on
its backend, and they fail on the group timeout the client was given, not the training group's.

A rank that dies closes its gloo connections, so the next round fails at once on every other rank
(:class:`TrainerRankLost`); ranks on the same host as the survivor are named by pid.

Units: times in seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wsync_grpc.core.timeouts import Timeouts
from wsync_grpc.trainer.results import ClientError

__all__ = ["Command", "RanksDisagree", "TrainerRankFailed", "TrainerRankLost", "TrainerRanks"]

log = logging.getLogger(__name__)

_WIDTH = 4
"""Ints per rank in a round: command, argument, argument, status."""

_DEFAULT_ROUND_S = Timeouts().round_s
"""A round's bound under the default timeouts, in seconds."""

_RELEASE_TAG = 4242
"""Tag of rank 0's point-to-point word to each follower at the end of its direct sends."""


class Command(enum.IntEnum):
    """What trainer rank 0 asks of the others in one round (each command's round, both halves:
    :data:`wsync_grpc.trainer.sharded.rounds.ROUNDS`)."""

    NONE = 0
    """A follower's slot: it commands nothing."""
    GATHER = 1
    """Gather bucket ``arg`` (``full_tensor()`` of its sharded tensors, collectively) and drop it."""
    OUTCOME = 2
    """The call is over: its outcome follows, ``arg`` bytes broadcast from rank 0."""
    JOIN = 3
    """Join the weight-sync group being formed: store port ``arg``, world size ``arg2``."""
    SEND = 4
    """Direct mode: send your own buckets of the update now."""
    SENT = 5
    """Direct mode: every rank has sent its buckets (each reports whether its sends failed)."""
    DIGESTS = 6
    """Direct mode, before Prepare: hash your own buckets and exchange their digests."""
    AGAIN = 7
    """The update runs again over fewer engines (a fleet policy left some out): forget this call's failures."""
    RINGS = 8
    """Direct mode through shared memory, before Prepare: open your ring for your own buckets and exchange the
    handles."""


class TrainerRankLost(ClientError):
    """A round with the trainer's other ranks failed: a rank died or its connection broke.

    Attributes:
        lost: the trainer ranks known to be gone (same-host ranks whose process ended); empty when
            none could be named (a rank on another host).
    """

    def __init__(self, message: str, lost: Sequence[int]) -> None:
        super().__init__(message)
        self.lost = list(lost)


class TrainerRankFailed(ClientError):
    """Trainer ranks reported that their part of a command failed (their own error is raised on them).

    Attributes:
        ranks: the trainer ranks that failed.
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class RanksDisagree(ValueError):
    """The trainer's ranks did not make the same call with the same arguments (raised on every rank)."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie counts as ended)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    except IndexError:  # pragma: no cover - an unexpected /proc format
        return True
    return fields[0] not in ("Z", "X")


def _host_id() -> int:
    """This host's name as a signed 63-bit integer (ranks on the same host compare equal)."""
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:8], "big") >> 1


def digest(value: Any) -> list[int]:
    """Four ``int64`` of the SHA-256 of ``value``'s canonical JSON (what the ranks compare)."""
    raw = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return [int.from_bytes(raw[i : i + 8], "big", signed=True) for i in range(0, 32, 8)]


class TrainerRanks:
    """This process's place among the trainer's ranks, and the rounds that keep them in lockstep.

    Collective: every rank of ``group`` constructs it, in the same order relative to its other
    collectives (it creates the control group and exchanges each rank's host and pid).

    Args:
        group: the trainer's process group (the ranks that train the model); ``None`` = the default
            group (``torch.distributed.group.WORLD``). ``torch.distributed`` must be initialized.
        timeout_s: how long a round waits for the slowest rank, in seconds (the control group's
            timeout); a rank that never makes the call fails the others after it. It must outlast what rank 0
            may wait for between two rounds (:attr:`Timeouts.round_s <wsync_grpc.core.timeouts.Timeouts.round_s>`,
            the default from the default timeouts; :class:`~wsync_grpc.trainer.sharded.client.ShardedTrainerClient`
            passes its own).

    Raises:
        ValueError: ``torch.distributed`` is not initialized, or this process is not in ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = _DEFAULT_ROUND_S) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a sharded trainer needs torch.distributed initialized (init_process_group) on every rank")
        group = group if group is not None else dist.group.WORLD
        assert group is not None
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the trainer group it was given")
        members = dist.get_process_group_ranks(group)
        self.timeout_s = timeout_s
        self._ctl = dist.new_group(
            ranks=members,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
        self.rank: int = dist.get_rank(self._ctl)
        """This process's trainer rank (0 talks to the engines)."""
        self.size: int = dist.get_world_size(self._ctl)
        """How many ranks the trainer has."""
        self._peers = self._gather([os.getpid(), _host_id(), 0, 0], "introduce")
        self._pending = 0  # a follower's status for the next round (0: its part succeeded)

    @property
    def leader(self) -> bool:
        """Whether this is trainer rank 0, the one that talks to the engines."""
        return self.rank == 0

    # ------------------------------------------------------------------ rounds

    def _lost(self, grace_s: float = 1.0) -> list[int]:
        """The ranks on this host whose process has ended, waiting up to ``grace_s`` seconds for one to show.

        A killed process closes its sockets (which is how the survivor noticed) a moment before it
        shows as ended.
        """
        host = _host_id()
        deadline = time.monotonic() + grace_s
        while True:
            lost = [
                r for r, (pid, h, _a, _b) in enumerate(self._peers) if r != self.rank and h == host and not _alive(pid)
            ]
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.05)

    def broken(self, what: str, e: BaseException) -> TrainerRankLost:
        """The error to raise when ``e`` broke a collective among the trainer's ranks (naming the ranks gone)."""
        lost = self._lost()
        who = f"trainer rank {', '.join(map(str, lost))} is gone" if lost else "a trainer rank failed or is unreachable"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return TrainerRankLost(f"{who} (trainer rank {self.rank}, {what}): {first[:300]}", lost)

    def _gather(self, values: Sequence[int], what: str) -> list[list[int]]:
        """``all_gather`` of ``values`` (:data:`_WIDTH` ints) over the control group: every rank's, in rank order.

        Raises:
            TrainerRankLost: the round failed (a rank gone, or the timeout passed).
        """
        mine = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.empty(_WIDTH, dtype=torch.int64) for _ in range(dist.get_world_size(self._ctl))]
        try:
            dist.all_gather(out, mine, group=self._ctl)
        except RuntimeError as e:  # DistBackendError, a gloo IoException or timeout
            raise self.broken(what, e) from e
        return [[int(v) for v in t.tolist()] for t in out]

    def agree(self, what: str, parts: dict[str, Any]) -> None:
        """Check that every rank makes the same call with the same arguments, before anything moves.

        Args:
            what: the call, with its sequence number (e.g. ``"sync #3"``): a rank in another call
                or out of order differs here.
            parts: named parts of the call to compare (e.g. ``"version"``, ``"tensors"``): each is
                compared by digest, and the error names the parts that differ.

        Raises:
            RanksDisagree: some rank differs (raised on every rank).
            TrainerRankLost: the round failed.
        """
        names = ["call", *parts]
        values = [what, *parts.values()]
        per_rank = [self._gather(digest(v), f"agreeing on {what}") for v in values]
        bad: dict[int, list[str]] = {}
        for name, got in zip(names, per_rank, strict=True):
            for r in range(1, self.size):
                if got[r] != got[0]:
                    bad.setdefault(r, []).append(name)
        if bad:
            lines = "; ".join(f"rank {r} differs from rank 0 in: {', '.join(n)}" for r, n in sorted(bad.items()))
            raise RanksDisagree(
                f"the trainer's ranks made different calls at {what} (every rank must call the same methods "
                f"in the same order with the same tensors and arguments): {lines}"
            )

    def lead(self, command: Command, arg: int = 0, arg2: int = 0) -> None:
        """Rank 0: ask every other rank for ``command`` (they are in :meth:`follow`).

        Raises:
            TrainerRankFailed: a rank reported that its part of the previous command failed.
            TrainerRankLost: the round failed.
        """
        assert self.leader
        got = self._gather([int(command), arg, arg2, 0], command.name.lower())
        failed = [r for r, v in enumerate(got) if r and v[3]]
        if failed:
            raise TrainerRankFailed(f"trainer rank {', '.join(map(str, failed))} failed (see its own error)", failed)

    def follow(self) -> tuple[Command, int, int]:
        """A rank other than 0: wait for rank 0's next command; reports this rank's pending status.

        Returns:
            The command and its two arguments.

        Raises:
            TrainerRankLost: the round failed (rank 0 gone, or no command within the timeout).
        """
        assert not self.leader
        got = self._gather([0, 0, 0, self._pending], "waiting for trainer rank 0")
        self._pending = 0
        cmd, arg, arg2, _ = got[0]
        return Command(cmd), arg, arg2

    def report_failure(self) -> None:
        """A follower: its part of the last command failed; rank 0 hears it in the next round."""
        self._pending = 1

    def exchange(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload``, in rank order, on every rank (collective: every rank calls it).

        Two collectives over the control group: the lengths (one round), then the bytes.

        Raises:
            TrainerRankLost: a collective failed.
        """
        lengths = [v[0] for v in self._gather([len(payload), 0, 0, 0], what)]
        width = max(lengths)
        mine = torch.zeros(width, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8) for _ in lengths]
        try:
            dist.all_gather(out, mine, group=self._ctl)
        except RuntimeError as e:
            raise self.broken(what, e) from e
        return [bytes(t[:n].numpy().tobytes()) for t, n in zip(out, lengths, strict=True)]

    def watch_leader(self, stop: threading.Event) -> threading.Thread:
        """A follower in the direct mode: set ``stop`` as soon as rank 0 dies or its sends fail.

        Posts a receive of rank 0's word (:meth:`release_followers`) and waits for it in a helper
        thread: a receive that breaks (rank 0 gone) or a word saying rank 0's sends failed sets
        ``stop``, which ends this rank's sends at their next wait. Returns the thread.
        """
        word = torch.zeros(1, dtype=torch.int64)
        work = dist.irecv(word, group=self._ctl, group_src=0, tag=_RELEASE_TAG)
        assert work is not None  # this rank is a member of the control group

        def run() -> None:
            try:
                work.wait()
            except RuntimeError as e:
                log.warning("trainer rank %d: trainer rank 0 is gone during the sends: %s", self.rank, e)
                stop.set()
                return
            if int(word.item()) != 1:
                stop.set()

        t = threading.Thread(target=run, name="wsync-watch-leader", daemon=True)
        t.start()
        return t

    def release_followers(self, ok: bool) -> None:
        """Rank 0 in the direct mode, its own sends over: tell every follower whether they succeeded.

        Followers whose own sends are still running go on when ``ok`` and stop when not. Errors (a
        follower gone) are logged, not raised: the rounds that follow say more.
        """
        word = torch.tensor([1 if ok else 0], dtype=torch.int64)
        for r in range(1, self.size):
            try:
                dist.send(word, group=self._ctl, group_dst=r, tag=_RELEASE_TAG)
            except RuntimeError as e:
                log.warning("could not tell trainer rank %d that rank 0's sends ended: %s", r, e)

    def broadcast(self, data: torch.Tensor, what: str) -> None:
        """Broadcast ``data`` from trainer rank 0 over the control group, in place (collective: every rank
        calls it, the followers with a tensor of the same size to receive into).

        Raises:
            TrainerRankLost: the broadcast failed.
        """
        try:
            dist.broadcast(data, group=self._ctl, group_src=0)
        except RuntimeError as e:
            raise self.broken(what, e) from e

    def close(self) -> None:
        """Destroy the control group (idempotent; not collective)."""
        ctl, self._ctl = self._ctl, None  # type: ignore[assignment]
        if ctl is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # already gone with the default group
                dist.destroy_process_group(ctl)
