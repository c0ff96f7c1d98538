"""The main job on vLLM: a training loop that syncs SmolLM2-135M into two running vLLM engines after every step.

``python -m wsync_grpc.tools.demo_vllm`` (``make demo-vllm``, needs the ``vllm`` extra):

1. starts ``--engines`` vLLM engines (default 2) with ``wsync serve --engine vllm``,
   each serving SmolLM2-135M-Instruct's safetensors directory, ``wsync.v1`` on a free
   gRPC port and vLLM's OpenAI-compatible API on a free HTTP port, its worker's forward
   on cores of its own (:func:`~wsync_grpc.launch.vllm_cpu_binds`);
2. loads the same model in this process as the policy and runs ``--steps`` supervised
   steps that teach it a fixed answer (the same as ``make demo``);
3. after each step syncs every weight into all engines with
   :class:`~wsync_grpc.trainer.TrainerClient` (staged apply: the engines keep serving
   while the bytes arrive);
4. checks that every engine's SHA-256 of every tensor, read back from what vLLM serves
   (its fused, prepacked layers included), equals the trainer's tensor in the served
   dtype, and asks every engine the fixed prompt through ``/v1/chat/completions``: the
   engines must agree with each other, and their answer must move as the policy's does.
Exit status 0 only if every check held.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.group.process_group import free_port
from wsync_grpc.launch import EngineProcess, spawn_vllm_engine, stop_all, vllm_cpu_binds, wait_all
from wsync_grpc.tools.demo import PROMPT, training_batch
from wsync_grpc.trainer import TrainerClient


def chat(http: str, model: str, max_tokens: int) -> str:
    """The engine's greedy answer to :data:`~wsync_grpc.tools.demo.PROMPT`, through vLLM's OpenAI chat API."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{http}/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        text: str = json.loads(r.read())["choices"][0]["message"]["content"]
        return text


def _digest(t: torch.Tensor, dtype: torch.dtype) -> str:
    return hashlib.sha256(t.detach().to(dtype).contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()


def _check_checksums(client: TrainerClient, named: list[tuple[str, torch.Tensor]], version: str) -> list[str]:
    """Every engine serves ``version`` with the trainer's tensors, bit for bit in the served dtype."""
    failures = []
    policy = dict(named)
    for target, sums in client.checksums().items():
        bad = [c.name for c in sums.checksums if c.sha256 != _digest(policy[c.name], parse_dtype(c.dtype))]
        if sums.weight_version != version or bad or len(sums.checksums) != len(policy):
            failures.append(f"{version}: {target} serves {sums.weight_version!r}, {len(bad)} tensors differ {bad[:3]}")
        else:
            dtypes = sorted({c.dtype for c in sums.checksums})
            print(f"  {target}: all {len(sums.checksums)} checksums match ({','.join(dtypes)})", flush=True)
    return failures


def _train_and_sync(
    args: argparse.Namespace,
    trainer: tuple[Any, ...],
    targets: list[str],
    https: list[str],
    model: str,
    failures: list[str],
) -> list[str]:
    """Train ``args.steps`` steps, syncing and checking every engine after each; the engines' last answers."""
    policy, optimizer, input_ids, labels = trainer
    answers: list[str] = []
    with TrainerClient(targets, rpc_timeout_s=120, group_timeout_s=120) as client:
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            loss = policy(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            version = f"step-{step}"
            print(f"\nstep {step}: loss {loss.item():.3f} ({time.monotonic() - t0:.1f} s); syncing ...", flush=True)
            named = [(n, p.detach()) for n, p in policy.named_parameters()]
            result = client.sync(named, version, flush_cache=True)
            for e in result.engines.values():
                print(
                    f"  {e.target}: {version}, {e.bucket_count} buckets, {e.bytes_received / 1e6:.1f} MB, "
                    f"receive {e.receive_seconds:.2f} s, apply {e.apply_seconds:.2f} s",
                    flush=True,
                )
            failures += _check_checksums(client, named, version)
            answers = [chat(h, model, args.max_new_tokens) for h in https]
            print(f"  engines' answer: {answers[0]!r}", flush=True)
            if len(set(answers)) != 1:
                failures.append(f"{version}: the engines answer differently: {answers}")
    return answers


def run(args: argparse.Namespace) -> int:
    """Run the demo; the exit status (0: every check held)."""
    from wsync_grpc.engines.models import ensure_smollm2_dir, load_causal_lm

    t_start = time.monotonic()
    model_dir = ensure_smollm2_dir()
    policy, tokenizer, _ = load_causal_lm(str(model_dir), torch.float32)
    policy.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    trainer = (policy, optimizer, *training_batch(tokenizer))
    failures: list[str] = []
    procs: list[EngineProcess] = []
    with tempfile.TemporaryDirectory(prefix="wsync-demo-vllm-") as tmp:
        try:
            https = []
            for i, bind in enumerate(vllm_cpu_binds(args.engines)):  # the engines' forwards on cores of their own
                port = free_port()
                https.append(f"http://127.0.0.1:{port}")
                procs.append(
                    spawn_vllm_engine(
                        model_dir,
                        port_file=Path(tmp) / f"{i}.port",
                        http_port=port,
                        log=Path(tmp) / f"{i}.log",
                        env=bind,
                        wait=False,
                    )
                )
            print(f"starting {args.engines} vLLM engines ...", flush=True)
            wait_all(procs, timeout_s=600)
            targets = [p.target for p in procs]
            print(f"engines up in {time.monotonic() - t_start:.0f} s: {', '.join(targets)}", flush=True)
            first = [chat(h, str(model_dir), args.max_new_tokens) for h in https]
            print(f"\nprompt: {PROMPT!r}\nstep 0 (initial weights): {first[0]!r}", flush=True)
            answers = _train_and_sync(args, trainer, targets, https, str(model_dir), failures) or first
            if answers[0] == first[0]:
                failures.append("the engines' answer did not change over the steps")
        finally:
            stop_all(procs, grace_s=30)
    print(f"\nfirst answer: {first[0]!r}\nlast answer:  {answers[0]!r}\ntotal {time.monotonic() - t_start:.0f} s")
    if failures:
        print("\nFAILED checks:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print(f"all checks passed: {args.steps} steps synced into {args.engines} vLLM engines, bit-exact", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m wsync_grpc.tools.demo_vllm``."""
    p = argparse.ArgumentParser(prog="python -m wsync_grpc.tools.demo_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="training steps, each followed by a sync")
    p.add_argument("--engines", type=int, default=2, help="vLLM engines to start")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated for the comparison")
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: engines shut down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
