"""Deprecated names of the trainer's sender, kept for one release: :class:`Sender` and :class:`BroadcastSender`.

The trainer's senders are the transports' trainer halves now
(:mod:`wsync_grpc.transports.sending`): each transport part builds its own
(:meth:`TransportPart.sender <wsync_grpc.transports.TransportPart.sender>`), and the trainer's ranks are
:class:`~wsync_grpc.transports.sending.TrainerPeers` (``TrainerClient(peers=...)``). What was one object
before (the ranks and the broadcast) is two:

- ``Sender`` -> :class:`~wsync_grpc.transports.sending.TrainerPeers` plus
  :class:`~wsync_grpc.transports.sending.TransportSender` (this protocol is both, as the deprecated
  ``TrainerClient(sender=...)`` keyword still takes);
- ``BroadcastSender(buffers)`` -> :class:`~wsync_grpc.transports.broadcast.sender.BroadcastSender`
  (``BroadcastSender(SendSite(ONE_PROCESS, device), buffers)``).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

from typing import Protocol

from wsync_grpc.transports.broadcast.sender import BroadcastSender as _BroadcastSender
from wsync_grpc.transports.broadcast.sender import Corruption, PackBuffers
from wsync_grpc.transports.sending import ONE_PROCESS, SENDING_RANK, SendSite, TrainerPeers, TransportSender

__all__ = ["SENDING_RANK", "BroadcastSender", "Sender"]


class Sender(TrainerPeers, TransportSender, Protocol):
    """Deprecated: the trainer's ranks and its broadcast in one object, what the deprecated
    ``TrainerClient(sender=...)`` factory returns. See the module's docstring for the new names."""


class BroadcastSender(_BroadcastSender):
    """Deprecated: one trainer process at group rank 0 broadcasting every bucket whole, as one object
    (:class:`Sender`). Use :class:`~wsync_grpc.transports.broadcast.sender.BroadcastSender`.

    Args:
        buffers: the two flat pack buffers the flattened layout packs into (kept between updates or not).
        corrupt: a test hook: flip a byte of one bucket after hashing it
            (:class:`~wsync_grpc.transports.broadcast.sender.Corruption`); ``None`` (always, outside tests).
    """

    trainer_ranks = ONE_PROCESS.trainer_ranks
    """One trainer rank: rank 0."""
    rank = ONE_PROCESS.rank
    """This process joins as rank 0."""

    def __init__(self, buffers: PackBuffers, *, corrupt: Corruption | None = None) -> None:
        super().__init__(SendSite(ONE_PROCESS, buffers.device), buffers, corrupt=corrupt)

    def forming(self, port: int, world_size: int) -> None:
        """Nothing: this process is the trainer's only rank."""

    def repeating(self) -> None:
        """Nothing: this process is the trainer's only rank."""
