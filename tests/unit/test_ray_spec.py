"""What an engine actor is told to start (:class:`wsync_grpc.ray.EngineSpec`), and the launcher's wrapper that
ends an engine with the process that starts it (``wsync_grpc.launch.ending_with_parent``)."""

from __future__ import annotations

import sys

import pytest

from wsync_grpc.launch import cli_command, ending_with_parent

pytest.importorskip("ray", reason="the ray extra is not installed")

from wsync_grpc.ray import EngineSpec


@pytest.mark.parametrize("args", [("--port", "50051"), ("--host=0.0.0.0",), ("--port-file", "p")])
def test_the_spec_refuses_the_options_the_actor_sets(args: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="the engine actor sets them"):
        EngineSpec(serve_args=("--synthetic", "tiny", *args))


def test_vllm_options_are_the_actors_only_for_a_vllm_engine() -> None:
    with pytest.raises(ValueError, match=r"\['--http-port'\]"):
        EngineSpec(serve_args=("--http-port", "8000"), vllm_model="/models/smollm2")
    assert EngineSpec(serve_args=("--metrics-port", "9100"), vllm_model="/models/smollm2").vllm_model
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineSpec(vllm_model="/models/smollm2", tensor_parallel_size=0)


def test_the_token_stays_out_of_the_specs_repr() -> None:
    spec = EngineSpec(serve_args=("--synthetic", "tiny"), token="s3cret-token")
    assert "s3cret-token" not in repr(spec) and "--synthetic" in repr(spec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_the_wrapper_execs_the_command_it_is_given() -> None:
    command = cli_command("serve", "--synthetic", "tiny")
    wrapped = ending_with_parent(command)
    assert wrapped[0] == sys.executable and wrapped[-len(command) :] == command
    assert "PR_SET_PDEATHSIG" in wrapped[4] and "os.execv" in wrapped[4]


def test_the_trainer_helpers_refuse_bad_arguments_before_touching_ray() -> None:
    from wsync_grpc.ray import TrainerRendezvous, join_trainer_group, sharded_trainer_client

    with pytest.raises(ValueError, match="world_size must be at least 1"):
        TrainerRendezvous.create(0)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        join_trainer_group(TrainerRendezvous(actor=None, world_size=2), 2)
    with pytest.raises(ValueError, match="no engine handles"):
        sharded_trainer_client([], master_address="10.0.0.1")


def test_bundles_on_one_node_are_numbered_apart_and_alone_ones_keep_vllms_choice() -> None:
    """``node_shares``: each bundle's place among its node's bundles (an engine actor binds vLLM's forward by it)."""
    from wsync_grpc.ray.placement import node_shares

    assert node_shares({0: "a", 1: "b", 2: "a", 3: "a"}, 4) == [(0, 3), (0, 1), (1, 3), (2, 3)]
    assert node_shares({0: "a"}, 1) == [(0, 1)]
    assert node_shares({0: "a"}, 2) == [(0, 1), (0, 1)]  # a bundle not placed (yet) counts alone
