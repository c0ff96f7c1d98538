"""One rank of a sharded FSDP2 trainer that syncs into running engines: ``python -m wsync_grpc.tools.fsdp_rank``.

Every rank loads SmolLM2-135M-Instruct (or ``--model``), shards it with ``fully_shard`` (FSDP2:
every parameter becomes a ``DTensor``), then for each step changes its weights (``--train``: one
AdamW step on the demo's batch; otherwise a seeded perturbation, the same on every rank) and syncs
them through :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient`, once per ``--modes`` entry.
Each outcome is one JSON line on stdout (``{"event": "synced" | "error", ...}``); with ``--check``,
rank 0 also compares every engine's checksums and greedy answer with its own gathered weights.

The rank joins the trainer's process group from ``--master-port`` (gloo over loopback by default,
``--master-address`` otherwise); ``make demo-fsdp`` and the tests start one process per rank.
Exit status: 0 when every sync (and check) succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wsync_grpc.core.checksums import tensor_sha256s
from wsync_grpc.tools.options import OneLineParser
from wsync_grpc.trainer.settings import add_setting_options

log = logging.getLogger("wsync.fsdp_rank")

PROMPT = "What is the best tool to sync weights into inference engines?"

CLIENT_OPTIONS = ("bucket_bytes", "rpc_timeout_s", "group_timeout_s")
"""The client's settings the rank takes as options (``--bucket-bytes``...): type, default and help from
:class:`~wsync_grpc.trainer.settings.Settings`."""

RANK_DEFAULTS: dict[str, object] = {"bucket_bytes": 64 << 20, "rpc_timeout_s": 60.0, "group_timeout_s": 60.0}
"""The rank program's own defaults for some of them: buckets of 64 MiB (each rank gathers one bucket at a
time, so this bounds the gathered memory of a CPU demo) and 60 s timeouts, as the program had before the
declaration."""


def emit(**fields: Any) -> None:
    """One JSON line on stdout (what the driver and the tests read)."""
    print(json.dumps(fields), flush=True)


def _shard(model: torch.nn.Module) -> None:
    """FSDP2: each decoder layer, then the whole model (parameters become ``DTensor`` s, ``Shard(0)``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(model)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Add seeded noise to every parameter: the same global change on every rank (each its own shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = 1e-3 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if isinstance(p, DTensor):
                p.add_(distribute_tensor(noise, p.device_mesh, p.placements))
            else:
                p.add_(noise)


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """One supervised step on ``batch`` (the same on every rank); returns the loss."""
    out = model(input_ids=batch[0], labels=batch[1])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(out.loss.item())


def _check(
    client: Any,
    model: torch.nn.Module,
    version: str,
    wire: torch.dtype | None,
    local: Any,
    targets: list[str] | None = None,
) -> list[str]:
    """Rank 0: every engine of ``targets`` (default: every member) serves ``version`` with exactly the gathered
    weights (through the wire dtype ``wire``, in the dtype each tensor is served in) and, with a ``local`` copy of
    the policy, the same greedy answer.

    Collective (every rank gathers); only rank 0 compares. Returns the failures.
    """
    from wsync_grpc.trainer.sharded.source import full

    whole = {n: full(p) for n, p in model.named_parameters()}
    if client.rank != 0:
        return []
    failures = []
    sent = {n: t.detach().to(wire) if wire is not None else t.detach() for n, t in whole.items()}
    from wsync.v1 import weight_sync_pb2 as pb

    from wsync_grpc.core.dtypes import parse_dtype

    stubs = client.client.stubs
    for target in targets if targets is not None else client.client.targets:
        sums = stubs[target].GetWeightChecksums(
            pb.GetWeightChecksumsRequest(), timeout=60, metadata=client.client.call_metadata
        )
        served = {c.name: parse_dtype(c.dtype) for c in sums.checksums}
        got = {c.name: c.sha256 for c in sums.checksums}
        mine = tensor_sha256s(t.to(served.get(n, t.dtype)) for n, t in sent.items())
        bad = [n for (n, _), sha in zip(sent.items(), mine, strict=True) if got.get(n) != sha]
        if sums.weight_version != version or bad:
            failures.append(f"{target} serves {sums.weight_version!r}; {len(bad)} tensors differ ({bad[:3]})")
    if local is None:
        emit(event="checked", version=version, answer=None, failures=failures)
        return failures
    with local.weights_lock():
        local.load_weights(0, [(n, t.detach()) for n, t in whole.items()])
        local.flush_cache()
        local.set_weight_version(version)
    mine = local.generate(PROMPT, 16).text
    from wsync_grpc.tools.demo import generate_on

    for target in targets if targets is not None else client.client.targets:
        r = generate_on(target, PROMPT, 16)
        if r.text != mine or list(r.weight_versions) != [version]:
            failures.append(f"{target} answered {r.text!r} ({list(r.weight_versions)}), the trainer {mine!r}")
    emit(event="checked", version=version, answer=mine, failures=failures)
    return failures


def _progress(version: str, delay_s: float = 0.0) -> Any:
    """A progress callback (rank 0 only) printing one ``bucket`` event per bucket on every engine, then
    sleeping ``delay_s`` seconds (a slower trainer, so that tests can act mid-sync)."""

    def report(p: Any) -> None:
        emit(event="bucket", version=version, sent=p.buckets_sent, of=p.bucket_count)
        if delay_s:
            time.sleep(delay_s)

    return report


def _wait_for_file(path: Path, timeout_s: float = 300.0) -> None:
    """Wait until ``path`` exists (a test's word to go on), polling every 0.1 s, at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.1)


def run(args: argparse.Namespace) -> int:
    """One rank's whole run; returns its exit status."""
    from wsync_grpc.engines.models import load_causal_lm
    from wsync_grpc.trainer.results import ClientError
    from wsync_grpc.trainer.roster import FleetPolicy
    from wsync_grpc.trainer.sharded import ShardedTrainerClient, TrainerRankLost

    os.environ.setdefault("MASTER_ADDR", args.master_address)
    os.environ["MASTER_PORT"] = str(args.master_port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    model, tokenizer, _name = load_causal_lm(args.model)
    local = None
    if args.check == "all" and args.rank == 0:
        from wsync_grpc.engines.reference import ReferenceEngine

        local = ReferenceEngine(load_causal_lm(args.model)[0], tokenizer, name="trainer copy")
    if args.train:
        model.requires_grad_(True)
        model.train()
    _shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0) if args.train else None
    batch = None
    if args.train:
        from wsync_grpc.tools.demo import training_batch

        batch = training_batch(tokenizer)
    wire = getattr(torch, args.dtype) if args.dtype else None
    ok = True
    options: dict[str, Any] = {name: getattr(args, name) for name in CLIENT_OPTIONS}
    if args.min_engines:
        options["policy"] = FleetPolicy.exclude(min_engines=args.min_engines)
    with ShardedTrainerClient(args.targets.split(","), master_address=args.engine_master_address, **options) as c:
        emit(event="ready", rank=c.rank)
        for step in range(1, args.steps + 1):
            loss = None
            if optimizer is not None and batch is not None:
                loss = _train_step(model, optimizer, batch)
            else:
                perturb(model, seed=step)
            for entry in args.modes.split(","):
                mode, _, own_transport = entry.partition(":")  # "direct:shared_memory": this sync's own transport
                transport = own_transport or args.transport
                version = f"step-{step}-{mode}{'-' + own_transport if own_transport else ''}{args.version_suffix}"
                emit(event="sync_start", rank=c.rank, version=version, mode=mode, step=step)
                t0 = time.monotonic()
                try:
                    r = c.sync(
                        model.named_parameters(),
                        version,
                        mode=mode,  # type: ignore[arg-type]
                        apply_mode=args.apply_mode,
                        dtype=wire,
                        progress=_progress(version, args.bucket_delay) if args.progress else None,
                        delta=args.delta,
                        transport=transport,  # type: ignore[arg-type]
                    )
                except (ClientError, ValueError) as e:  # RanksDisagree is a ValueError
                    lost = e.lost if isinstance(e, TrainerRankLost) else []
                    emit(
                        event="error",
                        rank=c.rank,
                        version=version,
                        kind=type(e).__name__,
                        message=str(e),
                        lost=lost,
                        seconds=time.monotonic() - t0,
                    )
                    return 1
                emit(
                    event="synced",
                    rank=c.rank,
                    version=r.weight_version,
                    mode=mode,
                    loss=loss,
                    seconds=round(time.monotonic() - t0, 3),
                    buckets=r.bucket_count,
                    wire_bytes=r.wire_bytes,
                    verified=min(e.buckets_verified for e in r.engines.values()),
                    engines=sorted(r.engines),
                    excluded=sorted(r.excluded),
                    attempts=r.attempts,
                    delta_base=r.delta.base_version if r.delta is not None else None,
                    received={t: e.bytes_received for t, e in r.engines.items()},
                    init_seconds=r.init_seconds,
                )
                if args.check != "none":
                    local_copy = local if args.check == "all" else None
                    failures = _check(c, model, version, wire, local_copy, sorted(r.engines))
                    ok = ok and not failures
        if args.catch_up_after is not None:
            _wait_for_file(args.catch_up_after)
            mode = args.modes.split(",")[0].partition(":")[0]
            transport = args.catch_up_transport or args.transport
            caught = c.catch_up(model.named_parameters(), mode=mode, transport=transport)  # type: ignore[arg-type]
            emit(
                event="caught_up",
                rank=c.rank,
                engines=sorted(caught.engines) if caught else [],
                init_seconds=caught.init_seconds if caught else 0.0,
            )
            if args.check != "none" and caught is not None:
                failures = _check(c, model, caught.weight_version, wire, None)
                ok = ok and not failures
    dist.destroy_process_group()
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The rank's command line."""
    p = OneLineParser(prog="python -m wsync_grpc.tools.fsdp_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True, help="this trainer rank")
    p.add_argument("--world", type=int, required=True, help="trainer ranks in all")
    p.add_argument("--master-port", type=int, required=True, help="port of the trainer's own process group")
    p.add_argument("--master-address", default="127.0.0.1", help="host of the trainer's own process group")
    p.add_argument("--engine-master-address", default="127.0.0.1", help="where engines reach trainer rank 0")
    p.add_argument("--targets", required=True, help="engines' control addresses, comma-separated")
    p.add_argument("--steps", type=int, default=1, help="steps, each followed by one sync per mode")
    p.add_argument(
        "--modes",
        default="gather",
        help="send modes to sync in after each step, comma-separated; MODE:TRANSPORT syncs in MODE by TRANSPORT "
        "(else --transport's), its version suffixed with -TRANSPORT",
    )
    p.add_argument("--train", action="store_true", help="a real AdamW step per step (default: a seeded perturbation)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--apply-mode", default="staged", choices=["staged", "streaming"])
    p.add_argument(
        "--transport",
        default="broadcast",
        choices=["broadcast", "shared_memory"],
        help="how the bytes travel (shared_memory: engines on this host, either mode)",
    )
    add_setting_options(p, *CLIENT_OPTIONS, defaults=RANK_DEFAULTS)
    p.add_argument(
        "--check",
        choices=["none", "checksums", "all"],
        default="none",
        help="after each sync rank 0 checks every engine's checksums against the gathered weights "
        "(and with 'all' the greedy answers of engines that serve wsync.v1.GenerationService)",
    )
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"], help="wire dtype (default: float32)")
    p.add_argument("--progress", action="store_true", help="rank 0 prints a 'bucket' event per bucket sent")
    p.add_argument(
        "--delta",
        action="store_true",
        help="sync deltas after the first sync (direct: every rank its own pieces; gather: rank 0 what it gathered)",
    )
    p.add_argument("--version-suffix", default="", help="appended to every version (tests: ranks that disagree)")
    p.add_argument("--model", default=None, help="local Hugging Face directory (default SmolLM2-135M-Instruct)")
    p.add_argument(
        "--min-engines",
        type=int,
        default=0,
        help="sync under the exclude fleet policy with at least this many engines (default 0: the fail policy)",
    )
    p.add_argument(
        "--bucket-delay", type=float, default=0.0, help="with --progress, rank 0 sleeps this long per bucket, seconds"
    )
    p.add_argument(
        "--catch-up-after",
        type=Path,
        default=None,
        help="after the steps, wait for this file, then catch the engines behind up (collectively)",
    )
    p.add_argument(
        "--catch-up-transport",
        default=None,
        choices=["broadcast", "shared_memory"],
        help="how the catch-up's bytes travel (default: --transport's)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    logging.basicConfig(
        level=os.environ.get("WSYNC_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
