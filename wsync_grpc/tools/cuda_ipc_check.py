"""The GPU check of the CUDA IPC transport (issue 46, item 6): ``python -m wsync_grpc.tools.cuda_ipc_check``.

Run on a machine with one CUDA GPU, from a plain checkout (``PYTHONPATH=.:generated``; ``make gpu-check``), in
under 4 minutes on one H100, start-up included:

1. checks the Python packages wsync needs for this (the engine's server and the trainer's client) and prints
   exactly the missing ones (exit status 3), then that PyTorch sees a CUDA device (exit status 4 otherwise, one
   line);
2. writes a model that needs no download into a temporary directory: a Llama of SmolLM2-135M's shapes
   (:data:`wsync_grpc.engines.synthetic.PRESETS` ``"smollm2-shapes"``), randomly initialized, with a small
   word-level tokenizer;
3. starts ``wsync serve --engine reference --model DIR --device cuda:0 --dtype bfloat16`` (another process: CUDA
   refuses to open an IPC handle in the process that exported it);
4. a trainer in this process, on the same GPU, syncs three versions by ``transport="cuda_ipc"`` (staged, then
   streaming, then staged), each checked bit-exact by the engine's ``GetWeightChecksums`` against the trainer's
   tensors, and timed (``SyncResult.total_seconds``, Prepare to the last Complete reply);
5. times a device-to-device copy of the same bytes (``Tensor.copy_``, median of 5) as the ceiling;
6. prints a table (device, bytes, seconds, GB/s, ratio to the copy, and each sync's phases: :data:`PHASES`) and
   writes it as JSON to ``--out``.

Exit status: 0 every sync bit-exact; 1 a check failed (the line says which); 2 a bad option; 3 packages missing;
4 no CUDA device.

Units: sizes in bytes, times in seconds, throughputs in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

ApplyMode = Literal["staged", "streaming"]
"""A sync's apply mode (:data:`wsync_grpc.trainer.options.ApplyMode`, not imported before the packages are checked)."""

PACKAGES: tuple[tuple[str, str], ...] = (
    ("torch", "torch"),
    ("grpc", "grpcio"),
    ("google.protobuf", "protobuf"),
    ("grpc_status", "grpcio-status"),
    ("grpc_health", "grpcio-health-checking"),
    ("grpc_reflection", "grpcio-reflection"),
    ("transformers", "transformers"),
    ("tokenizers", "tokenizers"),
    ("safetensors", "safetensors"),
    ("xxhash", "xxhash"),
    ("prometheus_client", "prometheus-client"),
    ("pythonjsonlogger", "python-json-logger"),
    ("opentelemetry", "opentelemetry-api"),
    ("tqdm", "tqdm"),
    ("re2", "google-re2"),
    ("wsync.v1", "wsync's generated stubs (PYTHONPATH=.:generated)"),
)
"""(module, what provides it) of everything the engine's server and the trainer's client import here."""

INSTALL_HINT = (
    "install wsync's dependencies (pip install -e . in the checkout), or, on a host that cannot reach a package "
    "index, bring them as wheels: 'make gpu-wheels' on a host that can (it fills .whl/ with the versions of the "
    "project's venv, for CPython 3.12 on x86-64 Linux), then 'make gpu-check' beside that .whl/ installs them first"
)
"""What the missing-packages line says to do."""

WSYNC_MODULES = ("wsync_grpc.tools.cli", "wsync_grpc.trainer", "wsync_grpc.engines.reference")
"""The modules imported, after :data:`PACKAGES` were found, to catch anything else missing."""

SHAPES = "smollm2-shapes"
"""The synthetic preset whose shapes the model takes (SmolLM2-135M)."""

MODES: tuple[ApplyMode, ...] = ("staged", "streaming", "staged")
"""The apply modes of the three syncs."""

PHASES = ("prepare", "broadcast", "pack", "verify", "complete")
"""The phases of :class:`~wsync_grpc.trainer.SyncResult` each row gives (``<phase>_s``, seconds): ``broadcast``
is the transfer through the ring (first bucket packed to the last acknowledged), ``pack`` the trainer's share of it
spent packing, ``verify`` and ``complete`` a staged update's two Completes."""

COPY_REPEATS = 5
"""Device-to-device copies timed (the median is kept)."""

START_TIMEOUT_S = 120.0
"""The longest the engine may take to start serving, in seconds."""

EXIT_FAILED, EXIT_USAGE, EXIT_PACKAGES, EXIT_NO_CUDA = 1, 2, 3, 4


def missing_packages() -> list[str]:
    """What provides each module of :data:`PACKAGES` that cannot be found, then of :data:`WSYNC_MODULES`'
    imports (``"module (provider)"``); empty when nothing is missing."""
    missing = []
    for module, provider in PACKAGES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            missing.append(f"{module} ({provider})")
    if missing:
        return missing
    for module in WSYNC_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            missing.append(f"{e.name} (imported by {module})")
        except Exception as e:  # found but unusable: e.g. grpcio or protobuf older than the generated stubs need
            missing.append(f"a usable {module} ({type(e).__name__}: {e})")
    return missing


def write_model(directory: Path, seed: int) -> None:
    """A Llama of :data:`SHAPES`'s shapes, randomly initialized (``seed``), and a word-level tokenizer, as a
    Hugging Face directory the reference engine loads offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers: Any = importlib.import_module("transformers")  # untyped: its classes are called through Any

    from wsync_grpc.engines.synthetic import PRESETS

    s = PRESETS[SHAPES]
    config = transformers.LlamaConfig(
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        vocab_size=s.vocab,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        tie_word_embeddings=s.tied,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)


def start_engine(model: Path, port_file: Path, log: Path, device: str = "cuda:0") -> subprocess.Popen[bytes]:
    """``wsync serve --engine reference`` of ``model`` on ``device`` in bfloat16, on a free loopback port (written
    to ``port_file``), its output to ``log``."""
    cmd = [
        sys.executable,
        "-m",
        "wsync_grpc.tools.cli",
        "serve",
        "--engine",
        "reference",
        "--model",
        str(model),
        "--device",
        device,
        "--dtype",
        "bfloat16",
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())


def child_env() -> dict[str, str]:
    """This process's environment, with the directories it imports wsync and its generated stubs from ahead on
    ``PYTHONPATH`` (a checkout run by pytest, whose ``pythonpath`` setting reaches only its own process)."""
    import wsync.v1

    import wsync_grpc

    roots = [str(Path(wsync_grpc.__file__).resolve().parents[1]), str(Path(wsync.v1.__file__).resolve().parents[2])]
    env = os.environ.copy()
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *given]))
    return env


def wait_port(proc: subprocess.Popen[bytes], port_file: Path, log: Path) -> int:
    """The engine's port, once it serves.

    Raises:
        RuntimeError: it exited, or did not serve within :data:`START_TIMEOUT_S`.
    """
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({proc.returncode}): {log.read_text()[-2000:]}")
        if port_file.is_file() and port_file.read_text().strip():
            return int(port_file.read_text().strip())
        time.sleep(0.2)
    raise RuntimeError(f"the engine did not serve within {START_TIMEOUT_S:g} s: {log.read_text()[-2000:]}")


def copy_seconds(nbytes: int, device: Any) -> float:
    """The median time of a device-to-device copy of ``nbytes`` bytes (``Tensor.copy_``, synchronized), seconds."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    on = src.device

    def sync() -> None:
        if on.type == "cuda":
            torch.cuda.synchronize(on)

    dst.copy_(src)
    sync()
    times = []
    for _ in range(COPY_REPEATS):
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t)
    del src, dst
    return statistics.median(times)


@contextlib.contextmanager
def colocated_pair(workdir: Path, device_name: str = "cuda:0") -> Iterator[tuple[Any, str]]:
    """The check's engine and trainer (steps 2 and 3 of the module): the model written into ``workdir``, an engine
    serving it on ``device_name`` in another process, and the trainer's copy of it in this process on the same
    device, in bfloat16. Yields ``(model, target)``: the trainer's ``torch.nn.Module`` and the engine's address.

    When the block raises, the engine's log ends on standard error (it goes with ``workdir``); the engine is stopped
    however the block ends.

    Raises:
        RuntimeError: the engine exited, or did not serve in time (:func:`wait_port`).
    """
    import torch

    model_dir = workdir / "model"
    write_model(model_dir, seed=0)
    port_file, log = workdir / "port", workdir / "engine.log"
    engine = start_engine(model_dir, port_file, log, device_name)
    try:
        transformers: Any = importlib.import_module("transformers")
        # Loaded, then converted: the keyword that picks the dtype at load has changed across transformers' releases.
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        model.to(device=device_name, dtype=torch.bfloat16)
        yield model, f"127.0.0.1:{wait_port(engine, port_file, log)}"
    except BaseException:
        if log.is_file():  # the engine's side of the failure (its log goes with the temporary directory)
            tail = log.read_text(errors="replace")[-4000:]
            print(f"cuda_ipc_check: the engine's log ends with:\n{tail}", file=sys.stderr)
        raise
    finally:
        engine.terminate()
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            engine.kill()


def next_version(model: Any) -> None:
    """Change every parameter of ``model`` (a ``torch.nn.Module``) a little, in place: a new weight version."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)


def check_served(client: Any, target: str, model: Any, what: str) -> None:
    """The engine at ``target`` serves ``model``'s tensors bit for bit (its ``GetWeightChecksums`` through
    ``client``, a :class:`~wsync_grpc.trainer.TrainerClient`, against ``model.state_dict()``).

    Raises:
        RuntimeError: it serves nothing, or some tensor differs (``what`` names the sync in the message).
    """
    from wsync_grpc.core.checksums import tensor_sha256s

    served = client.checksums()[target].by_name
    ours = model.state_dict()
    mine = dict(zip(served, tensor_sha256s(ours[n] for n in served), strict=True))
    wrong = sorted(n for n, digest in served.items() if digest != mine[n])
    if wrong or not served:
        raise RuntimeError(f"{what}: {len(wrong)} tensor(s) differ, e.g. {wrong[:3]}")


def run_check(
    out: Path | None, workdir: Path, *, device_name: str = "cuda:0", transport: str = "cuda_ipc"
) -> dict[str, Any]:
    """Steps 2 to 6 of the module (see there); the report. ``device_name`` and ``transport`` are the check's
    (``"cuda:0"``, ``"cuda_ipc"``); another pair (``"cpu"``, ``"shared_memory"``) runs the same steps on a host
    without a GPU, to check the script itself.

    Raises:
        RuntimeError: a sync was not bit-exact, the engine failed, or a sync failed (its error chained).
    """
    import torch

    from wsync_grpc.trainer import TrainerClient

    device = torch.device(device_name)
    with colocated_pair(workdir, device_name) as (trainer, target):
        rows: list[dict[str, Any]] = []
        with TrainerClient([target], device=device) as client:
            for i, mode in enumerate(MODES):
                next_version(trainer)
                version = f"v{i + 1}"
                result = client.sync(
                    trainer.named_parameters(),
                    version,
                    apply_mode=mode,
                    transport=transport,  # type: ignore[arg-type]
                )
                check_served(client, target, trainer, f"sync {version} ({mode})")
                rows.append(
                    {
                        "sync": version,
                        "mode": mode,
                        "bytes": result.payload_bytes,
                        "s": result.total_seconds,
                        "buckets": result.bucket_count,
                        **{f"{phase}_s": getattr(result, f"{phase}_seconds") for phase in PHASES},
                    }
                )
        copy_s = copy_seconds(rows[0]["bytes"], device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    for r in rows:
        r["gb_per_s"] = r["bytes"] / r["s"] / 1e9
        r["ratio_to_copy"] = copy_s / r["s"]
    copy_row: dict[str, Any] = {"sync": "d2d copy", "mode": "-", "bytes": rows[0]["bytes"], "s": copy_s}
    copy_row["gb_per_s"] = copy_row["bytes"] / copy_s / 1e9
    copy_row["ratio_to_copy"] = 1.0
    report: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transport": transport,
        "rows": [*rows, copy_row],
    }
    if transport == "cuda_ipc":
        from wsync_grpc.transports.cuda_ipc.cudart import runtime

        report["cudart"] = runtime().path  # the CUDA runtime library the transport called
    print(f"device: {name} (torch {torch.__version__}, CUDA {torch.version.cuda}, transport {transport})")
    if "cudart" in report:
        print(f"CUDA runtime called: {report['cudart']}")
    print(f"{'what':<10} {'mode':<10} {'bytes':>12} {'seconds':>9} {'GB/s':>8} {'ratio':>7}  phases (seconds)")
    for r in report["rows"]:
        phases = " ".join(f"{p} {r[p + '_s']:.4f}" for p in PHASES if p + "_s" in r)
        print(
            f"{r['sync']:<10} {r['mode']:<10} {r['bytes']:>12} {r['s']:>9.4f} {r['gb_per_s']:>8.2f} "
            f"{r['ratio_to_copy']:>7.3f}  {phases}"
        )
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the check (see the module); its exit status."""
    parser = argparse.ArgumentParser(
        prog="cuda_ipc_check", description="Check the CUDA IPC transport on one GPU (see the module's docstring)."
    )
    parser.add_argument("--out", type=Path, help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        print(f"cuda_ipc_check: --out {args.out}: no such directory {args.out.parent}", file=sys.stderr)
        return EXIT_USAGE
    missing = missing_packages()
    if missing:
        print(f"cuda_ipc_check: missing: {', '.join(missing)}; {INSTALL_HINT}", file=sys.stderr)
        return EXIT_PACKAGES
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print(
            "cuda_ipc_check: no CUDA device: torch.cuda.is_available() is false (this check needs one GPU)",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wsync-cuda-ipc-check-") as tmp:
        try:
            run_check(args.out, Path(tmp))
        except Exception as e:
            print(f"cuda_ipc_check: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_FAILED
    print(f"cuda_ipc_check: OK, 3 syncs bit-exact in {time.monotonic() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
