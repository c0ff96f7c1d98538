"""Generation load during weight syncs, on the real reference engine (``wsync serve --model DIR``).

An engine process serves a tiny random Llama (weight set A) with SmolLM2's
tokenizer. Client threads in this process generate continuously with one
fixed prompt over gRPC while a :class:`~wsync_grpc.trainer.client.TrainerClient`
syncs the engine 24 times, alternating weight set B and A, with every pause
mode around the syncs (WAIT, ABORT, KEEP, none) and streaming apply among
them. Every response is then checked token by token against greedy decoding
computed locally with the same weights:

- a response tagged with one weight version is exactly (or, if aborted, a
  prefix of) the reference output of the weight set that version names;
- a response tagged with several versions (KEEP across an update, an update
  applied between two decode steps, streaming apply's own freeze) is a
  sequence of segments, each produced greedily by one weight set from the
  context so far: nothing in it was produced by a mix of weights, and it spans
  only consecutive versions of syncs that do not drain or abort;
- every request completes or is reported ABORTED, never an error, and the
  number of ABORTED replies equals the sum of the Pause replies'
  ``aborted_requests``; every KEEP pause's ``frozen_requests`` is what the
  matching Resume continued.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import duration_pb2
from support import ENV, ROOT, build_tiny_llama
from wsync.v1 import generation_pb2, generation_pb2_grpc, weight_sync_pb2_grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines.reference import ReferenceEngine
from wsync_grpc.testing import EngineProcess, spawn_engine
from wsync_grpc.trainer import ApplyMode, PauseModeName, PauseResult, ResumeResult, TrainerClient
from wsync_grpc.wire.status import error_reason

pytest.importorskip("transformers")

PROMPT = "Tell me a story about a lighthouse."
MAX_NEW_TOKENS = 40
CLIENTS = 3
START_TIMEOUT_S = 120.0

SCHEDULE: list[tuple[PauseModeName | None, ApplyMode]] = [
    ("wait", "staged"),
    ("abort", "staged"),
    ("keep", "staged"),
    (None, "streaming"),  # the servicer freezes the engine itself
    ("abort", "streaming"),
    (None, "staged"),  # applied between two decode steps
]
"""One cycle of syncs: (pause mode around the sync, or None; apply mode)."""


@dataclasses.dataclass(frozen=True)
class Sync:
    version: str
    weights: str  # "A" or "B"
    pause: PauseModeName | None
    apply: ApplyMode
    pause_reply: PauseResult | None
    resume_reply: ResumeResult | None


@dataclasses.dataclass
class Outcome:
    response: generation_pb2.GenerateResponse | None = None
    error: str = ""


class Greedy:
    """Greedy decoding with the reference engine's own step (KV cache, ``logits_to_keep=1``)."""

    def __init__(self, model: Any, eos: frozenset[int], prompt_ids: list[int]) -> None:
        self.model = model
        self.eos = eos
        self.prompt_ids = list(prompt_ids)
        self._from_prompt: list[int] = []  # greedy tokens after the prompt alone, computed lazily

    def _decode(self, context: list[int], n: int, target: list[int] | None = None) -> list[int]:
        """Up to ``n`` greedy tokens after ``context``, from scratch; stops after EOS, or after the
        first token that differs from ``target``."""
        out: list[int] = []
        cache: Any = None
        new = list(context)
        with torch.no_grad():
            for i in range(n):
                r = self.model(input_ids=torch.tensor([new]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                token = int(torch.argmax(r.logits[0, -1]).item())
                cache = r.past_key_values
                out.append(token)
                if token in self.eos or (target is not None and token != target[i]):
                    break
                new = [token]
        return out

    def run(self, n: int) -> list[int]:
        """Up to ``n`` greedy tokens after the prompt."""
        done = bool(self._from_prompt) and self._from_prompt[-1] in self.eos
        if len(self._from_prompt) < n and not done:
            self._from_prompt = self._decode(self.prompt_ids, n)
        return self._from_prompt[:n]

    def matched(self, context: list[int], target: list[int]) -> int:
        """How many leading tokens of ``target`` greedy decoding produces after ``context``."""
        got = self.run(len(target)) if context == self.prompt_ids else self._decode(context, len(target), target)
        n = 0
        while n < min(len(got), len(target)) and got[n] == target[n]:
            n += 1
        return n


def explain(tokens: list[int], prompt_ids: list[int], sets: list[Greedy]) -> bool:
    """Whether ``tokens`` splits into ``len(sets)`` non-empty segments, segment j greedy under ``sets[j]``.

    Each segment continues the context so far (prompt plus the tokens before
    it) from scratch, as the engine does after a weight update with
    ``flush_cache``.
    """

    def fits(start: int, j: int) -> bool:
        if start == len(tokens):
            return False  # every version named produced at least one token
        common = sets[j].matched(prompt_ids + tokens[:start], tokens[start:])
        if j == len(sets) - 1:
            return start + common == len(tokens)
        # Longest first: the switch is usually where the old weights' greedy path was left.
        return any(fits(end, j + 1) for end in range(start + common, start, -1))

    return fits(0, 0)


def _start_engine(model_dir: Path, tmp: Path) -> EngineProcess:
    args = ["--model", str(model_dir), "--grace", "1"]
    log = tmp / "engine.log"
    return spawn_engine(args, port_file=tmp / "engine.port", log=log, env=ENV, cwd=ROOT, timeout_s=START_TIMEOUT_S)


@dataclasses.dataclass
class Fixture:
    target: str
    log: Path
    models: dict[str, Any]  # "A" / "B" -> model
    greedy: dict[str, Greedy]
    prompt_ids: list[int]
    reference: dict[str, tuple[int, ...]]  # "A" / "B" -> greedy tokens of PROMPT
    texts: dict[str, str]


@pytest.fixture(scope="module")
def served_tiny_llama(
    tmp_path_factory: pytest.TempPathFactory,
    smollm2_tokenizer: Any,
) -> Iterator[Fixture]:
    tmp = tmp_path_factory.mktemp("gen-under-sync")
    models = {
        "A": build_tiny_llama(len(smollm2_tokenizer), seed=0),
        "B": build_tiny_llama(len(smollm2_tokenizer), seed=1),
    }
    model_dir = tmp / "tiny-llama-A"
    models["A"].save_pretrained(model_dir)
    smollm2_tokenizer.save_pretrained(model_dir)
    reference: dict[str, tuple[int, ...]] = {}
    texts: dict[str, str] = {}
    prompt_ids: list[int] = []
    eos: frozenset[int] = frozenset()
    for name, model in models.items():
        with ReferenceEngine(model, smollm2_tokenizer, name=f"local-{name}") as local:
            r = local.generate(PROMPT, MAX_NEW_TOKENS, timeout=60)
            reference[name], texts[name] = r.token_ids, r.text
            prompt_ids = local.encode_prompt(PROMPT)
            eos = local._eos_ids
    assert reference["A"][0] != reference["B"][0], "weight sets A and B must differ from the first token"
    greedy = {name: Greedy(m, eos, prompt_ids) for name, m in models.items()}
    for name in models:  # the helper reproduces the engine's decoding
        assert tuple(greedy[name].run(MAX_NEW_TOKENS)) == reference[name]
    engine = _start_engine(model_dir, tmp)
    assert engine.log is not None
    try:
        yield Fixture(engine.target, engine.log, models, greedy, prompt_ids, reference, texts)
    finally:
        engine.stop(10)


def generate(stub: generation_pb2_grpc.GenerationServiceStub) -> generation_pb2.GenerateResponse:
    req = generation_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, timeout=duration_pb2.Duration(seconds=60)
    )
    reply: generation_pb2.GenerateResponse = stub.Generate(req, timeout=90)
    return reply


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def start_on_a(fx: Fixture, gen_stub: generation_pb2_grpc.GenerationServiceStub) -> str:
    """Make sure the engine serves weight set A and return the version it reports for it."""
    with grpc.insecure_channel(fx.target) as ch:
        version = (
            weight_sync_pb2_grpc.WeightSyncServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10).weight_version
        )
    if version != "":
        version = f"A-start-{time.monotonic_ns()}"
        with TrainerClient([fx.target], group_timeout_s=30, rpc_timeout_s=30) as trainer:
            trainer.resume(force=True)
            trainer.sync(fx.models["A"].state_dict().items(), version, flush_cache=True)
    # The engine's own output under A is the local reference.
    first = generate(gen_stub)
    assert tuple(first.token_ids) == fx.reference["A"] and first.text == fx.texts["A"]
    assert list(first.weight_versions) == [version]
    return version


@pytest.mark.timeout(300)
def test_generation_under_syncs_never_mixes_weights(served_tiny_llama: Fixture) -> None:
    run_syncs_under_load(served_tiny_llama, cycles=4)


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_generation_under_syncs_never_mixes_weights_soak(served_tiny_llama: Fixture) -> None:
    run_syncs_under_load(served_tiny_llama, cycles=40)


def run_syncs_under_load(fx: Fixture, cycles: int) -> None:
    """``cycles`` times through SCHEDULE, alternating weight sets B and A, under generation load."""
    channel = grpc.insecure_channel(fx.target)
    gen_stub = generation_pb2_grpc.GenerationServiceStub(channel)
    start = start_on_a(fx, gen_stub)

    stop = threading.Event()
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            o = Outcome()
            try:
                o.response = generate(gen_stub)
            except grpc.RpcError as e:
                o.error = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
            with lock:
                outcomes.append(o)

    threads = [threading.Thread(target=client, name=f"gen-client-{i}", daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()

    syncs: list[Sync] = []
    weights_of = {start: "A"}
    with TrainerClient([fx.target], group_timeout_s=30, rpc_timeout_s=30) as trainer:
        trainer.init()
        stub = trainer.stubs[fx.target]

        def running() -> int:
            return int(stub.GetStatus(pb.GetStatusRequest(), timeout=10).engine.running_requests)

        try:
            for i in range(cycles * len(SCHEDULE)):
                pause, apply = SCHEDULE[i % len(SCHEDULE)]
                name = "B" if i % 2 == 0 else "A"
                version = f"{name}-{i + 1}"
                weights_of[version] = name
                # Sync while requests are decoding (not just admitted).
                assert wait_until(lambda: running() >= 1, 20), "the clients stopped generating"
                time.sleep(0.02 * (i % 3))
                pause_reply = trainer.pause(pause, timeout=30)[fx.target] if pause else None
                # Small buckets: a streaming update is applied in several steps (the embedding alone
                # is one bucket), so a decode step between two of them would see a mix.
                trainer.sync(
                    fx.models[name].state_dict().items(),
                    version,
                    apply_mode=apply,
                    flush_cache=True,
                    bucket_bytes=64 << 10,
                )
                resume_reply = trainer.resume()[fx.target] if pause else None
                syncs.append(Sync(version, name, pause, apply, pause_reply, resume_reply))
                time.sleep(0.05 * (i % 4))  # sometimes let requests finish between syncs
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert not any(t.is_alive() for t in threads), "a generation request hung"
        status = trainer.status()[fx.target]
        assert status.weight_version == syncs[-1].version and status.updates_completed == len(syncs)
        assert status.state is State.READY and not status.paused and not status.dirty
    channel.close()

    # Every request completed or was reported aborted; none failed.
    errors = [o.error for o in outcomes if o.error]
    assert not errors, errors[:5]
    responses = [o.response for o in outcomes if o.response is not None]
    assert len(responses) >= len(syncs), f"only {len(responses)} generations ran during {len(syncs)} syncs"

    # Each response is explained by the weight sets its versions name, segment by segment.
    order = [start, *(s.version for s in syncs)]
    straddles_ok = {s.version for s in syncs if s.pause not in ("wait", "abort")}
    spanning: dict[str, int] = {}
    for r in responses:
        versions = list(r.weight_versions)
        tokens = list(r.token_ids)
        aborted = r.finish_reason == generation_pb2.FINISH_REASON_ABORTED
        assert aborted or r.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
        if not versions:
            assert aborted and not tokens, r
            continue
        assert all(v in weights_of for v in versions), versions
        idx = [order.index(v) for v in versions]
        assert idx == sorted(set(idx)), f"versions out of order: {versions}"
        # The request was in flight across every sync from its first version to its last (it may
        # have made no step under an intermediate one): each of them must keep requests in flight.
        for crossed in order[idx[0] + 1 : idx[-1] + 1]:
            assert crossed in straddles_ok, f"a request straddled the {crossed} sync, which drains or aborts: {r}"
            spanning[crossed] = spanning.get(crossed, 0) + 1
        sets = [fx.greedy[weights_of[v]] for v in versions]
        assert explain(tokens, fx.prompt_ids, sets), f"tokens not produced by {versions} in order: {r}"
        if len(versions) == 1:
            ref = fx.reference[weights_of[versions[0]]]
            if aborted:
                assert tuple(tokens) == ref[: len(tokens)]
            else:
                assert tuple(tokens) == ref and r.text == fx.texts[weights_of[versions[0]]]

    # Aborts: what the clients saw is what the Pause replies counted.
    aborted_seen = sum(r.finish_reason == generation_pb2.FINISH_REASON_ABORTED for r in responses)
    aborted_counted = sum(s.pause_reply.aborted_requests for s in syncs if s.pause_reply is not None)
    assert aborted_seen == aborted_counted
    for s in syncs:
        if s.pause == "keep":
            assert s.pause_reply is not None and s.resume_reply is not None
            assert s.resume_reply.resumed_requests == s.pause_reply.frozen_requests, s
            assert spanning.get(s.version, 0) <= s.pause_reply.frozen_requests, s
        if s.pause == "wait":
            assert s.pause_reply is not None and s.pause_reply.aborted_requests == 0
    print(
        f"{len(responses)} generations during {len(syncs)} syncs: {aborted_seen} aborted, "
        f"{sum(len(r.weight_versions) > 1 for r in responses)} across versions {spanning}, "
        f"frozen {[s.pause_reply.frozen_requests for s in syncs if s.pause == 'keep' and s.pause_reply]}, "
        f"drained {[s.pause_reply.drained_requests for s in syncs if s.pause == 'wait' and s.pause_reply]}"
    )
    # The run exercised what it claims to (in-flight requests at every kind of sync).
    assert aborted_counted > 0, "no ABORT pause caught a request in flight"
    assert sum(s.pause_reply.frozen_requests for s in syncs if s.pause == "keep" and s.pause_reply) > 0
    assert sum(s.pause_reply.drained_requests for s in syncs if s.pause == "wait" and s.pause_reply) > 0
    assert spanning, "no request straddled a KEEP, streaming or unpaused sync"
    seen = {weights_of[v] for r in responses for v in r.weight_versions}
    assert seen == {"A", "B"}


def check_response(fx: Fixture, r: generation_pb2.GenerateResponse, weights_of: dict[str, str]) -> None:
    """``r``'s tokens are explained segment by segment by the weight sets its versions name."""
    versions = list(r.weight_versions)
    if not versions:
        assert r.finish_reason == generation_pb2.FINISH_REASON_ABORTED and not r.token_ids, r
        return
    sets = [fx.greedy[weights_of[v]] for v in versions]
    assert explain(list(r.token_ids), fx.prompt_ids, sets), f"tokens not produced by {versions} in order: {r}"


def long_request(tokens: int = 450) -> generation_pb2.GenerateRequest:
    """Up to as long as the tiny model's context allows (450: about a second of decoding unloaded)."""
    return generation_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=tokens, timeout=duration_pb2.Duration(seconds=90)
    )


@pytest.mark.timeout(120)
def test_streaming_apply_freezes_requests_left_running_by_a_timed_out_drain(served_tiny_llama: Fixture) -> None:
    """Pause WAIT that times out leaves the engine paused with requests still decoding; a streaming
    update must still freeze them, or their steps would run on half-applied weights."""
    fx = served_tiny_llama
    channel = grpc.insecure_channel(fx.target)
    gen_stub = generation_pb2_grpc.GenerationServiceStub(channel)
    start = start_on_a(fx, gen_stub)
    weights_of = {start: "A", "B-streamed": "B"}
    with TrainerClient([fx.target], group_timeout_s=30, rpc_timeout_s=30) as trainer:
        stub = trainer.stubs[fx.target]
        # The group first: the sync below must reach Prepare while both requests still decode.
        trainer.init()
        futures = [gen_stub.Generate.future(long_request(), timeout=120) for _ in range(2)]
        assert wait_until(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10).engine.running_requests == 2, 20)
        time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:  # the drain cannot finish in 1 ms
            stub.Pause(
                pb.PauseRequest(mode=pb.PAUSE_MODE_WAIT, timeout=duration_pb2.Duration(nanos=1_000_000)), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        assert error_reason(e.value) == "DRAIN_TIMEOUT"
        st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        assert st.paused and st.engine.running_requests == 2
        # Many small buckets: steps between two of them would see a mix of A and B.
        trainer.sync(
            fx.models["B"].state_dict().items(),
            "B-streamed",
            apply_mode="streaming",
            bucket_bytes=64 << 10,
            flush_cache=True,
        )
        st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        assert st.paused, "the operator's pause still holds after the update"
        assert trainer.resume()[fx.target].resumed_requests == 2
        results = [f.result() for f in futures]
    channel.close()
    for r in results:
        assert list(r.weight_versions) in ([start], [start, "B-streamed"]), r.weight_versions
        check_response(fx, r, weights_of)


DOOMED_TRAINER = r"""
import os, signal, sys
import torch
from wsync_grpc.trainer import TrainerClient

target, weights, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
state_dict = torch.load(weights)

def progress(p):
    if p.buckets_sent == kill_after:
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

with TrainerClient([target], group_timeout_s=10, rpc_timeout_s=10) as client:
    client.init()
    print("ready", flush=True)
    sys.stdin.readline()
    client.sync(state_dict.items(), "B-doomed", apply_mode="streaming", bucket_bytes=64 << 10, progress=progress)
print("survived", flush=True)
"""


@pytest.mark.timeout(180)
def test_trainer_killed_mid_streaming_sync_keeps_requests_frozen_until_a_complete_update(
    served_tiny_llama: Fixture, tmp_path: Path
) -> None:
    """Invariant 2 with real generation: a trainer SIGKILLed half-way through a streaming update
    leaves the engine dirty and paused; the requests in flight stay frozen (not dropped, not
    served on the half-updated weights), new ones are not admitted, Resume is refused; the next
    complete update lifts the pause and the frozen requests finish on the new weights."""
    fx = served_tiny_llama
    channel = grpc.insecure_channel(fx.target)
    gen_stub = generation_pb2_grpc.GenerationServiceStub(channel)
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
    start = start_on_a(fx, gen_stub)
    weights = tmp_path / "B.pt"
    torch.save(fx.models["B"].state_dict(), weights)

    trainer = subprocess.Popen(
        [sys.executable, "-c", DOOMED_TRAINER, fx.target, str(weights), "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    assert trainer.stdout is not None and trainer.stdin is not None
    assert trainer.stdout.readline().strip() == "ready", trainer.stderr.read() if trainer.stderr else ""
    futures = [gen_stub.Generate.future(long_request(), timeout=150) for _ in range(2)]
    assert wait_until(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10).engine.running_requests == 2, 20)
    time.sleep(0.5)  # let both decode some tokens on the start weights first (a step takes milliseconds)
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == -signal.SIGKILL and "dying" in out, err[-3000:]
    killed = time.monotonic()
    while (st := stub.GetStatus(pb.GetStatusRequest(), timeout=10)).state != pb.LIFECYCLE_STATE_FAILED:
        assert time.monotonic() - killed < 10 + 5, f"not noticed within the group timeout: {st}"
        time.sleep(0.05)
    assert st.last_error.reason == "PEER_LOST" and "trainer" in st.last_error.message, st.last_error
    assert st.last_error.update_id and st.weight_version == start, st
    assert st.dirty and st.paused and st.pause_mode == pb.PAUSE_MODE_KEEP, st
    assert st.engine.running_requests == 2 and not any(f.done() for f in futures), "in-flight requests dropped"

    # Not served on the half-updated weights: nothing is admitted, Resume is refused.
    with pytest.raises(grpc.RpcError) as e:
        gen_stub.Generate(
            generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=4, timeout=duration_pb2.Duration(seconds=1)),
            timeout=30,
        )
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "not admitted" in e.value.details()  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as e:
        stub.Resume(pb.ResumeRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and error_reason(e.value) == "ENGINE_DIRTY"  # type: ignore[attr-defined]
    assert not any(f.done() for f in futures)

    # A complete update (staged, from a new trainer) cleans the weights and lifts the pause.
    with TrainerClient([fx.target], group_timeout_s=30, rpc_timeout_s=30) as recovery:
        recovery.sync(fx.models["A"].state_dict().items(), "A-recovered", flush_cache=True)
        st = recovery.status()[fx.target]
    assert st.weight_version == "A-recovered" and not st.dirty and not st.paused, st
    results = [f.result() for f in futures]
    channel.close()
    for r in results:
        assert r.finish_reason != generation_pb2.FINISH_REASON_ABORTED, r
        assert list(r.weight_versions) == [start, "A-recovered"], r.weight_versions
        check_response(fx, r, {start: "A", "A-recovered": "A"})
