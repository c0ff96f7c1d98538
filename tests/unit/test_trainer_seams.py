"""The trainer's seams: a weight source plans from metadata alone, a sender says where the engines' ranks start."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.planning import TensorMeta, plan_metadata
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.trainer.options import apply_mode_of, layout_of, pause_mode_of
from wsync_grpc.trainer.sender import BroadcastSender, Sender
from wsync_grpc.trainer.source import NamedTensors, WeightSource
from wsync_grpc.transports import transport_for
from wsync_grpc.transports.broadcast.sender import BroadcastSender as TransportBroadcastSender
from wsync_grpc.transports.broadcast.sender import PackBuffers
from wsync_grpc.transports.sending import ENGINE_READS, ONE_PROCESS, SendJob, SendSite
from wsync_grpc.transports.shared_memory.sender import SharedMemorySender


def test_named_tensors_send_tied_tensors_once_under_their_first_name() -> None:
    embed = torch.randn(8, 4)
    source: WeightSource = NamedTensors(
        [("model.embed_tokens.weight", embed), ("norm.weight", torch.ones(4)), ("lm_head.weight", embed)]
    )
    assert list(source.metadata()) == [
        TensorMeta("model.embed_tokens.weight", torch.float32, (8, 4)),
        TensorMeta("norm.weight", torch.float32, (4,)),
    ]


def test_a_view_with_another_shape_or_offset_is_not_a_tie() -> None:
    base = torch.randn(16)
    metas = NamedTensors([("a", base[:8]), ("b", base[8:]), ("c", base.view(4, 4)), ("d", base[:8])]).metadata()
    assert [m.name for m in metas] == ["a", "b", "c"]


def test_metadata_reads_no_bytes_and_buckets_ask_for_their_own_tensors_only() -> None:
    asked: list[str] = []
    tensors = {f"w{i}": torch.empty(256, 256, device="meta") for i in range(4)}  # no storage at all
    source = NamedTensors(tensors.items())
    buckets = plan_metadata(source.metadata(), bucket_bytes=2 * 256 * 256 * 4, alignment=256)
    assert [[t.name for t in b.tensors] for b in buckets] == [["w0", "w1"], ["w2", "w3"]]
    for b in buckets:
        got = source.bucket_tensors(b)
        asked += list(got)
        assert set(got) == {t.name for t in b.tensors}
    assert asked == list(tensors)


def test_a_name_given_twice_is_refused_when_planning() -> None:
    source = NamedTensors([("w", torch.zeros(2)), ("w", torch.ones(2))])
    with pytest.raises(ValueError, match="appears twice"):
        source.metadata()


def test_the_single_sender_holds_rank_zero_and_engines_follow_it() -> None:
    sender = BroadcastSender(PackBuffers(None, torch.device("cpu")))
    assert (sender.trainer_ranks, sender.rank) == (1, 0)


def test_options_are_converted_once_into_the_cores_enums() -> None:
    assert layout_of("individual") is Layout.INDIVIDUAL and apply_mode_of("streaming") is ApplyMode.STREAMING
    for convert, bad in ((layout_of, "flat"), (apply_mode_of, "lazy"), (pause_mode_of, "sleep")):
        with pytest.raises(ValueError, match="unknown"):
            convert(bad)


def test_each_transport_part_builds_its_own_trainer_half() -> None:
    site = SendSite(ONE_PROCESS, torch.device("cpu"))
    assert (ONE_PROCESS.trainer_ranks, ONE_PROCESS.rank) == (1, 0)
    assert isinstance(transport_for(Transport.BROADCAST).sender(site), TransportBroadcastSender)
    assert transport_for(Transport.DISK).sender(site) is ENGINE_READS
    cuda_ipc = transport_for(Transport.CUDA_IPC).sender(site)  # the colocated ring's sender, over GPU memory
    assert isinstance(cuda_ipc, SharedMemorySender) and cuda_ipc.segment is None  # nothing allocated until a send


def test_one_process_cannot_send_a_topology_of_several_ranks() -> None:
    sender = TransportBroadcastSender(SendSite(ONE_PROCESS, torch.device("cpu")))
    for topology in (SendTopology.gather(2), SendTopology.direct(2), SendTopology.direct(1)):
        job = SendJob(None, [], Layout.FLATTENED, lambda b: {}, topology, threading.Event())
        with pytest.raises(ValueError, match="cannot send"):
            sender.send(job)


def test_engines_that_read_the_bytes_take_none_from_the_trainer() -> None:
    planned = plan_metadata([TensorMeta("w", torch.float32, (4,))], bucket_bytes=1024, alignment=256)
    job = SendJob(None, planned, Layout.FLATTENED, lambda b: {}, SendTopology(), threading.Event())
    with pytest.raises(ValueError, match="sends none"):
        ENGINE_READS.send(job)
    assert ENGINE_READS.send(dataclasses.replace(job, buckets=[])) == 0.0


def test_the_deprecated_sender_is_still_the_ranks_and_the_broadcast_in_one() -> None:
    sender: Sender = BroadcastSender(PackBuffers(None, torch.device("cpu")))
    assert isinstance(sender, TransportBroadcastSender)
