"""One process of a multi-process TRL GRPO run syncing through wsync (launched by ``torch.distributed.run``).

    python -m torch.distributed.run --nproc_per_node 2 tests/grpo_rank.py TARGET HTTP OUT_DIR [--fsdp]

Every process builds a :class:`~wsync_grpc.trainer.grpo.WsyncGRPOTrainer`
(SmolLM2-135M on CPU, gloo), trains 2 steps and syncs once more; the main
process holds the client. Each process writes ``OUT_DIR/rank<R>.json``: the
versions the main process synced, with the trainer's parameters' digests in
the served dtype at each sync (the main process), and the losses.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from wsync_grpc.engines.models import ensure_smollm2_dir
from wsync_grpc.trainer import SyncResult
from wsync_grpc.trainer.grpo import WsyncGRPOTrainer

SERVED = torch.bfloat16


def served_sha(t: torch.Tensor) -> str:
    """Hex SHA-256 of ``t``'s bytes in the served dtype (what the engine's checksums read)."""
    return hashlib.sha256(t.detach().to(SERVED).contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()


def tiny_trainer(
    model: Any,
    tokenizer: Any,
    http: str,
    target: str,
    out: Path,
    group_port: int,
    seed: int,
    prompts: list[str],
    extra_args: dict[str, Any] | None = None,
    **hooks: Any,
) -> WsyncGRPOTrainer:
    """A 2-step GRPO run on CPU: 2 prompts per device batch, 2 generations each, 8-token completions.

    Rollouts from the vLLM server at ``http``, weights synced into ``target``;
    the reward prefers short completions, with noise from ``seed`` so that
    every group has an advantage to learn from.
    """
    g = torch.Generator().manual_seed(seed)

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [-len(c) / 10 + float(torch.rand((), generator=g)) for c in completions]

    config = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        max_steps=2,
        learning_rate=1e-3,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=http,
        vllm_group_port=group_port,
        seed=0,
        **(extra_args or {}),
    )
    return WsyncGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        wsync_targets=[target],
        wsync_options={"group_timeout_s": 60},
        **hooks,
    )


def main() -> None:
    target, http, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    fsdp = "--fsdp" in sys.argv[4:]
    rank = int(os.environ["RANK"])
    model_dir = ensure_smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    synced: list[dict[str, Any]] = []
    holder: dict[str, Any] = {}

    def on_sync(result: SyncResult) -> None:
        sent = holder["trainer"].wsync_client.last_sent
        synced.append({"version": result.weight_version, "sums": {n: served_sha(t) for n, t in sent}})

    extra: dict[str, Any] = {}
    if fsdp:
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}}
    prompts = ["Write a word.", "Name a color.", "Say hello.", "Count."]
    port = int(os.environ["WSYNC_TEST_GROUP_PORT"])
    trainer = tiny_trainer(
        model, tokenizer, http, target, out / "run", port, rank, prompts, extra, wsync_on_sync=on_sync
    )
    holder["trainer"] = trainer
    trainer.train()
    trainer.sync_weights()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    client = trainer.wsync_client
    (out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "main": client is not None, "synced": synced, "losses": losses})
    )
    if client is not None:
        client.close_communicator()


if __name__ == "__main__":
    main()
