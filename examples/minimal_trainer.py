"""A minimal trainer loop: train, then push the new weights into running engines with wsync.

    python examples/minimal_trainer.py 127.0.0.1:50051 [more engines...]

Each engine is a ``wsync serve`` process (SmolLM2-135M-Instruct by default).
"""

import sys

import torch

from wsync_grpc.engines.models import load_causal_lm
from wsync_grpc.trainer import TrainerClient

model, tokenizer, _ = load_causal_lm("smollm2")  # the same weights the engines serve
model.requires_grad_(True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
batch = tokenizer("wsync keeps rollout engines in sync.", return_tensors="pt")

with TrainerClient(sys.argv[1:]) as client:  # Init on every engine while this process joins as rank 0
    for step in range(1, 4):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        result = client.sync(model.named_parameters(), weight_version=f"step-{step}", flush_cache=True)
        print(f"step {step}: loss {loss.item():.3f}, {result.wire_bytes / 1e6:.0f} MB in {result.total_seconds:.2f} s")
