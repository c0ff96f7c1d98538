"""GRPO with TRL on SmolLM2-135M: rollouts from a wsync vLLM engine, the policy synced before every step's rollouts.

Start the engine (README, "Training with TRL"), then:

    python examples/trl_grpo.py --target 127.0.0.1:50051 --http http://127.0.0.1:8000

TRL's ``GRPOTrainer`` generates through the engine's OpenAI API; its weight
syncs go through wsync (``WsyncGRPOTrainer``): staged, the cache flushed,
the weight version ``step-N`` after N optimizer steps. One more sync after
training leaves the engine serving the final policy.
"""

import argparse

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from wsync_grpc.engines.models import ensure_smollm2_dir
from wsync_grpc.trainer import SyncResult
from wsync_grpc.trainer.grpo import WsyncGRPOTrainer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--target", default="127.0.0.1:50051", help="the engine's wsync.v1 gRPC target")
parser.add_argument("--http", default="http://127.0.0.1:8000", help="the engine's OpenAI API")
parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
parser.add_argument("--output-dir", default="grpo-out", help="where TRL writes its run")
args = parser.parse_args()

model_dir = ensure_smollm2_dir()  # the checkpoint the engine serves
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
prompts = Dataset.from_dict({"prompt": ["Name a color.", "Say hello.", "Write one word.", "Count to three."]})


def brevity(completions: list[str], **_: object) -> list[float]:
    """The toy reward: shorter answers are better."""
    return [-len(c) / 10 for c in completions]


def report(result: SyncResult) -> None:
    print(f"synced {result.weight_version}: {result.wire_bytes / 1e6:.0f} MB in {result.total_seconds:.2f} s")


config = GRPOConfig(
    output_dir=args.output_dir,
    use_cpu=not torch.cuda.is_available(),
    bf16=False,
    max_steps=args.steps,
    learning_rate=1e-5,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=16,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_vllm=True,
    vllm_mode="server",
    vllm_server_base_url=args.http,
)
trainer = WsyncGRPOTrainer(
    model=model,
    reward_funcs=brevity,
    args=config,
    train_dataset=prompts,
    processing_class=tokenizer,
    wsync_targets=[args.target],
    wsync_on_sync=report,
)
trainer.train()
trainer.sync_weights()  # the engine serves the policy after the last step
for entry in trainer.state.log_history:
    if "loss" in entry:
        print(f"step {entry['step']}: loss {entry['loss']:.4f}, reward {entry.get('reward', 0.0):.3f}")
