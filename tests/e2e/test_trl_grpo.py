"""TRL's ``GRPOTrainer`` training SmolLM2-135M on CPU with rollouts from a real ``wsync serve --engine vllm``.

One engine (vLLM's OpenAI API for TRL's generation, ``wsync.v1`` for the
weights; the shared ``tp1`` engine of ``shared_engines``, started with the
flags TRL needs) and a :class:`~wsync_grpc.trainer.grpo.WsyncGRPOTrainer` in this
process: 2 optimizer steps over a few prompts, 2 generations each, short
completions. TRL syncs before each step's generation; after every sync the
engine serves weight version ``step-N`` (N the trainer's global step), its
checksums equal the trainer's parameters in the served dtype, and its greedy
answer and log-probabilities are what the trainer's own model gives with the
served weights (up to bfloat16 arithmetic). Every sync is an entry of TRL's log
history (``wsync/...`` keys, through transformers' ``Trainer.log``) that states
its ``SyncResult``, and the TRL guide's block that reads them
(``trainer.sync_weights()``, ``trainer.last_sync``, ``trainer.trainer_client``)
runs as written on the trained trainer.
A sync that fails raises out of ``train()``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_engines import Vllm, post, sample
from support import ENV, ROOT

from wsync_grpc.testing import EngineProcess, free_port
from wsync_grpc.trainer import SyncError, SyncResult, TrainerClient

pytest.importorskip("vllm", reason="the vllm extra is not installed")
pytest.importorskip("trl", reason="the trl extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.vllm_engines("tp1")]

SERVED = torch.bfloat16
PROBE = "The capital of France is"
PROMPTS = ["Write a word.", "Name a color.", "Say hello.", "Count to three."]


@pytest.fixture(scope="module")
def trl_engine(engine: Vllm) -> tuple[EngineProcess, str]:
    """The shared engine's process and the base URL of its OpenAI API."""
    return engine.proc, engine.http


LOGPROB_TOL = 0.25
"""Nats by which the engine's bfloat16 arithmetic may differ from the trainer's float32 on the same served weights.

Both compute with the same bfloat16 weights, but vLLM's kernels (and its activations) are not the trainer's;
a stale or wrong weight moves these log-probabilities by far more (one optimizer step here changes the greedy
answer outright). Greedy tokens alone are no fair test: after a step the top two candidates can be closer
than that arithmetic noise, and the two sides then pick different tokens from equal weights.
"""


def _greedy_engine(http: str, model: str, max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """The engine's greedy continuation of ``PROBE``: its token ids and each one's log-probability (nats)."""
    body = {
        "model": model,
        "prompt": PROBE,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    choice = post(f"{http}/v1/completions", body)["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


def _trainer_scores(
    model_dir: Path, params: dict[str, torch.Tensor], tokenizer: Any, answers: list[list[int]]
) -> list[torch.Tensor]:
    """For each of ``answers``: log-softmax ``[len(tokens), vocab]`` of a fresh model holding ``params``
    rounded to the served dtype, in float32 (the model is loaded once for all of them).

    Row ``i`` is the distribution after ``PROBE`` and ``tokens[:i]`` (teacher-forced on the engine's tokens).
    """
    from transformers import AutoModelForCausalLM

    served = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        own = dict(served.named_parameters())
        for name, p in params.items():
            own[name].copy_(p.detach().to(SERVED).float())
        ids = tokenizer(PROBE, return_tensors="pt")["input_ids"]
        for tokens in answers:
            full = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1)
            logits = served(full, attention_mask=torch.ones_like(full)).logits[0, ids.shape[1] - 1 : -1]
            scores.append(torch.log_softmax(logits.float(), dim=-1))
    return scores


def _answers_as_the_trainer(engine: tuple[list[int], list[float]], scores: torch.Tensor) -> list[str]:
    """Where the engine's greedy answer is not what the trainer's weights give; empty when it is.

    At every position the engine's token must be the trainer's greedy choice up to ``LOGPROB_TOL`` (a near
    tie may go either way), and the engine's log-probability of it must equal the trainer's within
    ``LOGPROB_TOL``.
    """
    tokens, logprobs = engine
    wrong = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = scores[i]
        mine, best = float(row[tok]), float(row.max())
        if best - mine > LOGPROB_TOL or abs(lp - mine) > LOGPROB_TOL:
            wrong.append(f"position {i}: engine token {tok} at {lp:.3f}, the trainer's {mine:.3f}, its best {best:.3f}")
    return wrong


def _sha(t: torch.Tensor) -> str:
    from grpo_rank import served_sha

    return served_sha(t)


GUIDE = ROOT / "docs" / "guides" / "trl.md"
GUIDE_MARK = re.compile(r"^<!-- docs-test: tests/e2e/test_trl_grpo.py -->\n```python\n(.*?)\n```$", re.M | re.S)


def _guide_block() -> str:
    """The TRL guide's block marked to run here, on the trained ``trainer``."""
    blocks = GUIDE_MARK.findall(GUIDE.read_text())
    assert len(blocks) == 1, f"{GUIDE}: {len(blocks)} blocks marked for {__name__}"
    return str(blocks[0])


def _trainer(model: Any, tokenizer: Any, http: str, target: str, out: Path, **hooks: Any) -> Any:
    from grpo_rank import tiny_trainer

    return tiny_trainer(model, tokenizer, http, target, out, free_port(), 0, PROMPTS, **hooks)


def test_grpo_trains_two_steps_with_rollouts_from_a_wsync_vllm_engine(
    trl_engine: tuple[EngineProcess, str], smollm2_dir: Path, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    proc, http = trl_engine
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    seen: list[dict[str, Any]] = []
    results: list[SyncResult] = []
    holder: dict[str, Any] = {}

    def check(result: SyncResult) -> None:
        """After each sync: the engine serves the trainer's parameters as version step-N, and answers as they do.

        The sync after training is checked by the guide's block instead (its checksums), to keep the test short.
        """
        results.append(result)
        if holder.get("trained"):
            return
        trainer = holder["trainer"]
        step = int(trainer.state.global_step)
        assert result.weight_version == f"step-{step}"
        params = dict(trainer.model.named_parameters())
        names = sample(params)  # the guide's block reads every tensor back after the last sync
        with TrainerClient([proc.target]) as reader:
            sums = reader.checksums(names)[proc.target]
        assert sums.weight_version == f"step-{step}"
        wrong = [c.name for c in sums.checksums if c.sha256 != _sha(params[c.name])]
        assert not wrong and len(sums.checksums) == len(names), wrong[:3]
        engine_answer = _greedy_engine(http, str(smollm2_dir))
        answers = [engine_answer] + ([seen[-1]["engine"]] if seen else [])
        scores = _trainer_scores(smollm2_dir, params, smollm2_tokenizer, [a[0] for a in answers])
        if seen:  # the check tells the weights served before this sync from these ones
            stale = _answers_as_the_trainer(answers[1], scores[1])
            assert stale, "the previous weights' answer passes as this step's: the check has no power"
        seen.append(
            {
                "step": step,
                "sums": sums.by_name,
                "engine": engine_answer,
                "wrong": _answers_as_the_trainer(engine_answer, scores[0]),
            }
        )

    trainer = _trainer(model, smollm2_tokenizer, http, proc.target, tmp_path / "out", wsync_on_sync=check)
    holder["trainer"] = trainer
    try:
        trainer.train()
        assert [s["step"] for s in seen] == [0, 1]
        for s in seen:
            assert not s["wrong"], s
        assert seen[0]["sums"] != seen[1]["sums"]  # the first optimizer step changed the served weights
        client = trainer.wsync_client
        assert client is not None and client.last_result is not None
        assert client.last_result.engines[proc.target].cache_flushed
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 2

        # Each sync is an entry of TRL's log history (Trainer.log) stating its SyncResult; TRL's own
        # per-step entries still carry the metrics TRL averages over the step (none of them wsync's).
        history = trainer.state.log_history
        logged = [h for h in history if any(k.startswith("wsync/") for k in h)]
        assert [h.get("step") for h in logged] == [0, 1], history
        for h, r in zip(logged, results, strict=True):
            _assert_logged(h, r, proc.target)
        assert all("reward" in h and not any(k.startswith("wsync/") for k in h) for h in history if "loss" in h)

        # The guide's block, as written, on this trainer: one more sync (step-2), read back through the new names.
        holder["trained"] = True
        namespace: dict[str, Any] = {"trainer": trainer, "__name__": "trl_guide"}
        exec(compile(_guide_block(), str(GUIDE), "exec"), namespace)
        final = namespace["final"]
        assert isinstance(final, SyncResult) and final.weight_version == "step-2"
        assert results[-1] is final and trainer.last_sync is final
        assert trainer.trainer_client is client.trainer_client is not None
        params = dict(trainer.model.named_parameters())
        served = namespace["sums"][proc.target]
        assert served.weight_version == "step-2" and served.by_name == {n: _sha(p) for n, p in params.items()}
        assert namespace["synced"] == [*logged, trainer.state.log_history[-1]]
        _assert_logged(trainer.state.log_history[-1], final, proc.target)
        assert trainer.state.log_history[-1]["step"] == 2
    finally:  # a failure here must not leave the module's engine owned by this client
        if trainer.wsync_client is not None:
            trainer.wsync_client.close_communicator()


def _assert_logged(entry: dict[str, Any], r: SyncResult, target: str) -> None:
    """``entry`` (of ``state.log_history``) is what the sync whose result is ``r`` logged, into one engine."""
    assert entry["wsync/weight_version_step"] == int(r.weight_version.removeprefix("step-"))
    assert entry["wsync/payload_bytes"] == r.payload_bytes > 0
    assert entry["wsync/wire_bytes"] == r.wire_bytes >= r.payload_bytes
    assert entry["wsync/total_seconds"] == r.total_seconds > 0
    assert entry["wsync/gb_per_s"] == r.gb_per_s > 0
    assert entry["wsync/engines"] == len(r.engines) == 1 and target in r.engines
    assert entry["wsync/excluded"] == len(r.excluded) == 0
    assert {k for k in entry if not k.startswith("wsync/")} == {"step", "epoch"}, entry  # an entry of its own


def test_a_failed_sync_raises_out_of_train(
    trl_engine: tuple[EngineProcess, str], smollm2_dir: Path, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """A trainer whose parameters do not fit the engine's model: the first sync's refusal stops ``train()``."""
    from transformers import AutoModelForCausalLM

    proc, http = trl_engine
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    model.model.norm.weight = torch.nn.Parameter(torch.ones(7))  # a shape the engine does not serve
    trainer = _trainer(model, smollm2_tokenizer, http, proc.target, tmp_path / "out")
    with pytest.raises(SyncError) as e:
        trainer.train()
    assert e.value.failures[proc.target].reason == "SHAPE_MISMATCH"
    with TrainerClient([proc.target]) as reader:
        assert not reader.status()[proc.target].dirty
    client = trainer.wsync_client
    assert client is not None
    client.close_communicator()


def test_the_trl_example_trains_and_leaves_the_engine_on_the_final_policy(
    trl_engine: tuple[EngineProcess, str], tmp_path: Path
) -> None:
    """``examples/trl_grpo.py`` as the TRL guide runs it, for 2 steps: a sync before each step and one after."""
    proc, http = trl_engine
    example = [sys.executable, str(ROOT / "examples" / "trl_grpo.py")]
    r = subprocess.run(
        [*example, "--target", proc.target, "--http", http, "--steps", "2", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("synced")] == [
        "synced step-0",
        "synced step-1",
        "synced step-2",
    ]
    assert [ln.split(":")[0] for ln in lines if ln.startswith("step ")] == ["step 1", "step 2"]
    with TrainerClient([proc.target]) as reader:
        st = reader.status()[proc.target]
    assert st.weight_version == "step-2" and not st.dirty


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_training_processes_take_part_and_the_main_one_syncs(
    trl_engine: tuple[EngineProcess, str], tmp_path: Path, fsdp: bool
) -> None:
    """``torch.distributed.run`` with 2 CPU processes (gloo): every process iterates the parameters at each
    sync (FSDP2's gathers are collectives), the main one sends; the engine serves what it sent, as ``step-N``."""
    proc, http = trl_engine
    env = {**ENV, "WSYNC_TEST_GROUP_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        + [str(ROOT / "tests" / "grpo_rank.py"), proc.target, http, str(tmp_path)]
        + (["--fsdp"] if fsdp else []),
        capture_output=True,
        text=True,
        timeout=800,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    main = [x for x in ranks if x["main"]]
    assert len(main) == 1 and main[0]["rank"] == 0
    assert [s["version"] for s in main[0]["synced"]] == ["step-0", "step-1", "step-2"]
    assert all(len(x["losses"]) == 2 for x in ranks)
    with TrainerClient([proc.target]) as reader:
        sums = reader.checksums()[proc.target]
    assert sums.weight_version == "step-2"
    assert sums.by_name == main[0]["synced"][-1]["sums"]
