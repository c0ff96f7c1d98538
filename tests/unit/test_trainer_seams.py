"""The trainer's seams: a weight source plans from metadata alone, a sender says where the engines' ranks start."""

from __future__ import annotations

import pytest
import torch

from wsync_grpc.core.layout import ApplyMode, Layout
from wsync_grpc.core.planning import TensorMeta, plan_metadata
from wsync_grpc.trainer.options import apply_mode_of, layout_of, pause_mode_of
from wsync_grpc.trainer.sender import BroadcastSender
from wsync_grpc.trainer.source import NamedTensors, WeightSource
from wsync_grpc.transports.broadcast.sender import PackBuffers


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
