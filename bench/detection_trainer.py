"""One trainer of the detection case: ``python -m bench.detection_trainer`` (driven by :mod:`bench.detection_case`).

A real trainer process: it builds the synthetic model (:func:`bench.common.build_flat`, values
seeded by ``--seed``), forms the group with the engine at ``--target``
(:meth:`~wsync_grpc.trainer.client.TrainerClient.init`, client defaults), prints one JSON line
``{"event": "ready", ...}`` and starts one :meth:`~wsync_grpc.trainer.client.TrainerClient.sync`
of weight version ``--version`` with apply mode ``--mode``. The benchmark SIGKILLs it in the
middle of that broadcast; a trainer left to finish (the recovery sync after the kills) prints
``{"event": "synced", "seconds": ...}`` (the sync's wall time, seconds) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.detection_trainer")
    p.add_argument("--target", required=True, help="the engine's gRPC address (host:port)")
    p.add_argument("--model", required=True, help="synthetic preset (bench.common.model_shape)")
    p.add_argument("--mode", choices=("staged", "streaming"), required=True, help="the sync's apply mode")
    p.add_argument("--version", required=True, help="the weight version the sync installs")
    p.add_argument("--seed", type=int, default=1, help="seed of the trainer's weights")
    args = p.parse_args(argv)

    from bench.common import build_flat
    from wsync_grpc.trainer import TrainerClient

    model = build_flat(args.model, seed=args.seed)
    with TrainerClient([args.target], group_timeout_s=120.0, rpc_timeout_s=120.0) as c:
        c.init()
        emit(event="ready", bytes=model.nbytes, tensors=len(model.tensors))
        t0 = time.monotonic()
        c.sync(model.tensors.items(), args.version, apply_mode=args.mode)
        emit(event="synced", seconds=time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
