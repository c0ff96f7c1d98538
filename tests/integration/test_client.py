"""TrainerClient against real engine processes in a real gloo group.

Every engine here is a separate process running the wsync gRPC server: either
the real CLI (``python -m wsync_grpc.tools.cli serve --synthetic ...``) or a small
launcher (below) serving a :class:`~wsync_grpc.engines.tensor.TensorEngine`
with mixed dtypes, a scalar, a tied embedding and, for one engine, an extra
tensor the other does not have. Results are checked against the engines' own
``GetWeightChecksums`` (SHA-256 of the served bytes), compared with
``hashlib.sha256`` of the trainer's tensors.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import PauseMode
from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, child_env, free_port, spawn_engine, spawn_process, stop_all
from wsync_grpc.trainer import (
    TRAINER,
    ApplyMode,
    EngineCallError,
    InitError,
    Layout,
    SyncError,
    SyncProgress,
    TrainerClient,
)

# Wall-clock bounds (a re-Init within 0.5 s): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
ENV = child_env({"WSYNC_LOG_LEVEL": "INFO"})
START_TIMEOUT_S = 120.0

# name, dtype, shape: mixed dtypes, a scalar, ints, bools, a tied embedding (lm_head is its alias).
MIXED: list[tuple[str, str, list[int]]] = [
    ("model.embed_tokens.weight", "bfloat16", [96, 32]),
    ("model.layers.0.self_attn.q_proj.weight", "float32", [32, 32]),
    ("model.layers.0.input_layernorm.weight", "float16", [32]),
    ("model.layers.0.scale", "float32", []),
    ("model.layers.0.rotary.inv_freq_index", "int64", [1, 40]),
    ("model.layers.0.mask", "bool", [7]),
    ("model.layers.0.q8", "int8", [5, 3]),
    ("model.layers.1.mlp.down_proj.weight", "bfloat16", [96, 80]),
    ("model.layers.1.mlp.up_proj.weight", "float32", [80, 40]),
    ("model.norm.weight", "bfloat16", [32]),
]
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
EXTRA = ("extra.weight", "float32", [4, 4])

ENGINE_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from wsync_grpc.service.server import build_server, stop_on_signals, write_port_file
from wsync_grpc.engines.tensor import TensorEngine

spec = json.loads(sys.argv[1])
gen = torch.Generator().manual_seed(spec["seed"])
tensors = {}
for name, dtype, shape in spec["tensors"]:
    dt = getattr(torch, dtype)
    n = 1
    for d in shape:
        n *= d
    if dt == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        size = torch.empty((), dtype=dt).element_size()
        t = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dt).view(shape)
    tensors[name] = t.clone()
engine = TensorEngine(tensors, aliases=spec["aliases"], name=spec["name"])
srv = build_server(engine, port=0)
stop_on_signals(srv, grace=1.0)
write_port_file(Path(spec["port_file"]), srv.port)
srv.wait()
"""


# ----------------------------------------------------------------------------- engine processes


def start_tensor_engine(
    tmp: Path, name: str, tensors: list[tuple[str, str, list[int]]], seed: int = 0
) -> EngineProcess:
    """Start the launcher above serving ``tensors`` (random bit patterns from ``seed``)."""
    port_file = tmp / f"{name}.port"
    spec = {"tensors": tensors, "aliases": TIED, "name": name, "seed": seed, "port_file": str(port_file)}
    cmd = [sys.executable, "-c", ENGINE_SCRIPT, json.dumps(spec)]
    return spawn_process(
        cmd, ready_file=port_file, log=tmp / f"{name}.log", env=ENV, cwd=ROOT, timeout_s=START_TIMEOUT_S
    )


def start_cli_engine(tmp: Path, name: str, preset: str = "tiny", dtype: str = "bfloat16") -> EngineProcess:
    """Start ``python -m wsync_grpc.tools.cli serve --synthetic PRESET --port 0 --port-file ...``."""
    args = ["--synthetic", preset, "--dtype", dtype, "--grace", "1"]
    port_file, log = tmp / f"{name}.port", tmp / f"{name}.log"
    return spawn_engine(args, port_file=port_file, log=log, env=ENV, cwd=ROOT, timeout_s=START_TIMEOUT_S)


def stop(engines: list[EngineProcess]) -> None:
    """SIGTERM, then SIGKILL after 5 s.

    An engine whose armed update was cancelled may take until its group
    timeout to exit (a posted gloo receive that nobody will match); the
    tests do not wait for that.
    """
    stop_all(engines, grace_s=5)


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    """Two engines serving MIXED (different initial values)."""
    tmp = tmp_path_factory.mktemp("mixed")
    engines = [
        start_tensor_engine(tmp, "mixed-a", MIXED, seed=1),
        start_tensor_engine(tmp, "mixed-b", MIXED, seed=2),
    ]
    yield engines
    stop(engines)


@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    """Two engines started with the real CLI, serving the synthetic 'tiny' model in bf16."""
    tmp = tmp_path_factory.mktemp("cli")
    engines = [start_cli_engine(tmp, "cli-a"), start_cli_engine(tmp, "cli-b")]
    yield engines
    stop(engines)


# ----------------------------------------------------------------------------- trainer helpers


def trainer_tensors(seed: int, specs: list[tuple[str, str, list[int]]] = MIXED) -> dict[str, torch.Tensor]:
    """The trainer's weights: random bit patterns (NaN payloads included), plus the tied lm_head."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in specs:
        dt = getattr(torch, dtype)
        if dt == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            n = 1
            for d in shape:
                n *= d
            raw = torch.randint(
                0, 256, (n * torch.empty((), dtype=dt).element_size(),), dtype=torch.uint8, generator=gen
            )
            out[name] = raw.view(dt).view(shape).clone()
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: the same tensor, as in state_dict()
    return out


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def served(client: TrainerClient) -> dict[str, dict[str, str]]:
    """target -> name -> sha256, as the engines report them."""
    return {t: {c.name: c.sha256 for c in r.checksums} for t, r in client.checksums().items()}


def assert_serves(client: TrainerClient, tensors: dict[str, torch.Tensor], version: str) -> None:
    expected = {n: sha(t) for n, t in tensors.items() if n not in TIED}
    for target, sums in served(client).items():
        assert sums == expected, f"{target} does not serve the trainer's bytes"
    for target, st in client.status().items():
        assert st.weight_version == version, target
        assert st.state is State.READY, target
    alias = client.checksums(["lm_head.weight"])
    for target, r in alias.items():
        assert r.checksums[0].sha256 == expected["model.embed_tokens.weight"], target


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("layout", "apply_mode"), [("flattened", "staged"), ("individual", "staged"), ("flattened", "streaming")]
)
def test_sync_bit_exact_mixed_dtypes_tied_embeddings(
    mixed_pair: list[EngineProcess], layout: Layout, apply_mode: ApplyMode
) -> None:
    targets = [e.target for e in mixed_pair]
    progress: list[SyncProgress] = []
    with TrainerClient(targets, backend="gloo", group_timeout_s=60, rpc_timeout_s=30) as client:
        tensors = trainer_tensors(seed=10)
        before = served(client)
        res = client.sync(
            tensors.items(),
            "v1",
            layout=layout,
            apply_mode=apply_mode,
            bucket_bytes=8 << 10,
            progress=progress.append,
        )
        assert served(client) != before
        assert_serves(client, tensors, "v1")
        assert client.world_size == 3 and client.rank_offsets == {targets[0]: 1, targets[1]: 2}

        unique = len(MIXED)  # lm_head is sent once, as the embedding
        assert res.weight_version == "v1" and res.layout == layout and res.apply_mode == apply_mode
        assert res.tensor_count == unique and res.bucket_count > 2
        assert res.payload_bytes == sum(t.numel() * t.element_size() for n, t in tensors.items() if n not in TIED)
        assert list(res.engines) == targets
        for target, r in res.engines.items():
            assert r.target == target and r.weight_version == "v1" and r.update_id == res.update_id
            assert r.bucket_count == res.bucket_count and r.tensor_count == unique
            assert r.bytes_received == res.wire_bytes
            assert r.total_seconds > 0 and r.gb_per_s > 0
        if layout == "individual":
            assert res.wire_bytes == res.payload_bytes
        else:
            assert res.wire_bytes >= res.payload_bytes
        assert res.total_seconds >= res.broadcast_seconds > 0 and res.gb_per_s > 0
        assert [p.buckets_sent for p in progress] == list(range(1, res.bucket_count + 1))
        assert progress[-1].bytes_sent == progress[-1].total_bytes == res.wire_bytes

        # A second update on the same group: no re-init, new bytes everywhere.
        port = client.port
        tensors2 = trainer_tensors(seed=11)
        res2 = client.sync(tensors2.items(), "v2", layout=layout, apply_mode=apply_mode)
        assert client.port == port and res2.init_seconds < 0.5 and res2.bucket_count == 1
        assert_serves(client, tensors2, "v2")
    # Leaving the with-block left the group on every engine.
    with TrainerClient(targets) as probe:
        for st in probe.status().values():
            assert st.state is State.UNINITIALIZED
            assert st.group is None


def test_dtype_conversion_on_request(mixed_pair: list[EngineProcess]) -> None:
    """fp32 master weights sent as bf16; engines convert into their own dtypes on apply."""
    native = trainer_tensors(seed=20)
    master = {
        n: (torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) if t.dtype.is_floating_point else t)
        for i, (n, t) in enumerate(native.items())
        if n not in TIED
    }
    master["lm_head.weight"] = master["model.embed_tokens.weight"]
    with TrainerClient([e.target for e in mixed_pair], backend="gloo") as client:
        res = client.sync(master.items(), "bf16-wire", dtype=torch.bfloat16)
        assert res.payload_bytes == sum(
            t.numel() * (2 if t.dtype.is_floating_point else t.element_size())
            for n, t in master.items()
            if n not in TIED
        )
        expected = {
            n: sha(t.to(torch.bfloat16).to(native[n].dtype) if t.dtype.is_floating_point else t)
            for n, t in master.items()
            if n not in TIED
        }
        for target, sums in served(client).items():
            assert sums == expected, target


def test_cli_engines_synthetic_model(cli_pair: list[EngineProcess]) -> None:
    targets = [e.target for e in cli_pair]
    tensors = synthetic.build("tiny", dtype=torch.bfloat16, seed=5)
    with TrainerClient(targets) as client:
        replies = client.init()
        assert [list(r.group.ranks) for r in replies.values()] == [[1], [2]]
        assert all(r.group.backend == "gloo" for r in replies.values())
        assert client.init() == replies, "init on a healthy client is a no-op"
        res = client.sync(tensors.items(), "step-1", flush_cache=True)
        assert all(r.cache_flushed for r in res.engines.values())
        for target, sums in served(client).items():
            assert sums == {n: sha(t) for n, t in tensors.items()}, target
        # state_dict() of a tied model lists lm_head too: still sent once.
        with_alias = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
        res = client.sync(with_alias.items(), "step-2", layout="individual")
        assert res.tensor_count == len(tensors)
        assert {st.weight_version for st in client.status().values()} == {"step-2"}


def test_fan_out_helpers(cli_pair: list[EngineProcess]) -> None:
    targets = [e.target for e in cli_pair]
    with TrainerClient(targets) as client:
        paused = client.pause("keep")
        assert set(paused) == set(targets) and all(r.mode is PauseMode.KEEP for r in paused.values())
        again = client.pause("abort")
        assert all(r.already_paused for r in again.values())
        assert all(st.paused for st in client.status().values())
        assert all(r.was_paused for r in client.resume().values())
        assert not any(r.was_paused for r in client.resume().values())
        assert not any(r.cancelled for r in client.cancel().values()), "nothing in flight"
        client.init()
        assert all(st.state is State.READY for st in client.status().values())
        left = client.leave()
        assert all(r.was_member for r in left.values())
        assert client.needs_init and client.group is None
        assert all(st.state is State.UNINITIALIZED for st in client.status().values())
        with pytest.raises(EngineCallError) as info:
            client.checksums(["no.such.tensor"])
        assert set(info.value.failures) == set(targets)
        assert all(f.code == grpc.StatusCode.INVALID_ARGUMENT for f in info.value.failures.values())
        assert all(f.reason == "UNKNOWN_TENSOR" for f in info.value.failures.values())
        # The raw generated stub stays usable next to the client.
        stub = client.stubs[targets[0]]
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).engine.workers == 1
        # Each typed result keeps the engine's reply as it came.
        status = client.status()[targets[0]]
        assert isinstance(status.raw, pb.GetStatusResponse)
        assert status.raw.state == pb.LIFECYCLE_STATE_UNINITIALIZED and status.raw.engine.workers == 1
        sums = client.checksums()[targets[0]]
        assert isinstance(sums.raw, pb.GetWeightChecksumsResponse) and len(sums.raw.checksums) > 0
        assert sums.by_name == {c.name: c.sha256 for c in sums.raw.checksums}
        paused = client.pause("keep")[targets[0]]
        assert paused.raw.mode == pb.PAUSE_MODE_KEEP
        assert client.resume()[targets[0]].raw.was_paused


STALE_OWNER = r"""
import sys, time
from wsync_grpc.trainer import TrainerClient

c = TrainerClient(sys.argv[1:])
c.init()
print("port", c.port, flush=True)
time.sleep(300)
"""


def test_stale_membership_is_replaced_on_init(cli_pair: list[EngineProcess]) -> None:
    """A trainer that died without leaving: the next trainer's init forms a new group at once.

    While it lives it owns the engines (the next trainer gets NOT_OWNER); its death ends its
    KeepAlive calls, which releases them.
    """
    targets = [e.target for e in cli_pair]
    first = subprocess.Popen([sys.executable, "-c", STALE_OWNER, *targets], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert first.stdout is not None
        old_port = int(first.stdout.readline().split()[1])
        with TrainerClient(targets) as second:
            with pytest.raises(SyncError) as e:
                second.sync(synthetic.build("tiny", dtype=torch.bfloat16, seed=9).items(), "fresh")
            assert {f.reason for f in e.value.failures.values()} == {"NOT_OWNER"}
            first.kill()
            first.wait(10)
            deadline = time.monotonic() + 5
            while any(st.owner is not None for st in second.status().values()):  # released at once
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # No Leave from the first: the engines stay READY in a group whose trainer is gone.
            second.sync(synthetic.build("tiny", dtype=torch.bfloat16, seed=9).items(), "fresh")
            assert second.port != old_port
            assert {st.group.master_port for st in second.status().values()} == {second.port}
    finally:
        first.kill()


def test_one_engine_rejects_metadata(tmp_path: Path) -> None:
    """The engine lacking 'extra.weight' rejects Prepare; nothing is broadcast, nothing changes."""
    engines = [
        start_tensor_engine(tmp_path, "plain", MIXED, seed=3),
        start_tensor_engine(tmp_path, "with-extra", [*MIXED, EXTRA], seed=4),
    ]
    plain, extra = (e.target for e in engines)
    try:
        with TrainerClient([plain, extra], group_timeout_s=60) as client:
            v1 = trainer_tensors(seed=30)
            client.sync(v1.items(), "v1")
            before = served(client)

            bad = trainer_tensors(seed=31, specs=[*MIXED, EXTRA])
            with pytest.raises(SyncError) as info:
                client.sync(bad.items(), "v2-bad")
            err = info.value
            assert err.stage == "prepare" and not err.broadcast_started
            assert set(err.failures) == {plain}, err
            f = err.failures[plain]
            assert f.code == grpc.StatusCode.INVALID_ARGUMENT and f.reason == "UNKNOWN_TENSOR"
            assert "extra.weight" in f.message and f.metadata.get("tensor") == "extra.weight"
            text = str(err)
            assert plain in text and "INVALID_ARGUMENT" in text and "UNKNOWN_TENSOR" in text
            assert extra not in err.failures and err.cancelled == {plain: False, extra: True}
            assert err.weight_version == "v2-bad" and err.results == {}
            assert client.needs_init and client.group is None

            # Nobody's weights or version changed; the accepting engine was cancelled and left.
            assert served(client) == before
            st = client.status()
            assert {s.weight_version for s in st.values()} == {"v1"}
            assert st[plain].state is State.READY
            assert st[extra].state is State.FAILED and st[extra].group is None
            last_error = st[extra].last_error
            assert last_error is not None and last_error.reason == "UPDATE_CANCELLED"

            # The next sync re-initializes everything by itself.
            v3 = trainer_tensors(seed=32)
            res = client.sync(v3.items(), "v3")
            assert res.init_seconds > 0 and not client.needs_init
            assert_serves_subset(client, v3, "v3")
    finally:
        stop(engines)


def assert_serves_subset(client: TrainerClient, tensors: dict[str, torch.Tensor], version: str) -> None:
    names = [n for n in tensors if n not in TIED]
    for target, r in client.checksums(names).items():
        assert r.weight_version == version, target
        assert {c.name: c.sha256 for c in r.checksums} == {n: sha(tensors[n]) for n in names}, target


def test_engine_killed_mid_broadcast(tmp_path: Path) -> None:
    """An engine dies after the first bucket: one SyncError; the survivor is cancelled, weights intact."""
    big = [*MIXED, *[(f"model.layers.2.w{i}", "float32", [128, 128]) for i in range(6)]]
    engines = [
        start_tensor_engine(tmp_path, "survivor", big, seed=5),
        start_tensor_engine(tmp_path, "victim", big, seed=6),
    ]
    survivor, victim = engines
    timeout = 20.0
    try:
        with TrainerClient([survivor.target, victim.target], group_timeout_s=timeout, rpc_timeout_s=10) as client:
            client.init()
            before = served(client)[survivor.target]

            def kill_after_first(p: SyncProgress) -> None:
                if p.buckets_sent == 1:
                    victim.process.send_signal(signal.SIGKILL)
                    victim.process.wait(10)

            t0 = time.monotonic()
            with pytest.raises(SyncError) as info:
                client.sync(
                    trainer_tensors(seed=40, specs=big).items(),
                    "doomed",
                    bucket_bytes=64 << 10,
                    progress=kill_after_first,
                )
            elapsed = time.monotonic() - t0
            err = info.value
            assert elapsed < timeout + 15, f"bounded by the group timeout, took {elapsed:.1f} s"
            assert err.stage == "broadcast" and err.broadcast_started
            assert TRAINER in err.failures and victim.target in err.failures, err
            assert err.failures[victim.target].code == grpc.StatusCode.UNAVAILABLE
            assert victim.target in str(err) and "trainer" in str(err)
            assert err.cancelled.get(survivor.target) is True
            assert client.needs_init

        with TrainerClient([survivor.target]) as alone:
            st = alone.status()[survivor.target]
            # Cancelled (FAILED), then left by the first client's close().
            assert st.last_error is not None
            assert st.last_error.reason == "UPDATE_CANCELLED" and st.weight_version == ""
            assert st.state in (State.FAILED, State.UNINITIALIZED)
            assert served(alone)[survivor.target] == before, "staged apply: old weights intact"
            fresh = trainer_tensors(seed=41, specs=big)
            alone.sync(fresh.items(), "after-crash")
            assert_serves_subset(alone, fresh, "after-crash")
    finally:
        stop(engines)


def test_unreachable_engine_is_named() -> None:
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    with TrainerClient([dead], rpc_timeout_s=5) as client:
        with pytest.raises(InitError) as info:
            client.init()
        assert set(info.value.failures) == {dead}
        assert info.value.failures[dead].code == grpc.StatusCode.UNAVAILABLE
        assert dead in str(info.value)
        with pytest.raises(SyncError) as sync_info:
            client.sync([("w", torch.zeros(2))], "v")
        assert sync_info.value.stage == "init" and dead in str(sync_info.value)


def test_argument_errors() -> None:
    with pytest.raises(ValueError):
        TrainerClient([])
    with pytest.raises(ValueError):
        TrainerClient(["a:1", "a:1"])
    with pytest.raises(ValueError):
        TrainerClient(["a:1"], workers=[0])
    with TrainerClient(["127.0.0.1:1"]) as client:
        with pytest.raises(ValueError, match="weight_version"):
            client.sync([("w", torch.zeros(2))], "")
        with pytest.raises(ValueError, match="nothing to sync"):
            client.sync([], "v")
        with pytest.raises(ValueError, match="layout"):
            client.sync([("w", torch.zeros(2))], "v", layout="zigzag")  # type: ignore[arg-type]
