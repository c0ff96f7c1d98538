"""``wsync serve --engine synthetic --size PRESET`` (or ``--synthetic PRESET``): a tensor-only engine.

A :class:`~wsync_grpc.engines.tensor.TensorEngine` over the tensors of a
:mod:`~wsync_grpc.engines.synthetic` preset (Llama names and shapes, values
seeded by ``--seed``), in ``--dtype``: weights only, no generation.
"""

from __future__ import annotations

import argparse

from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.tools import options as cli_options
from wsync_grpc.tools.common import UsageError
from wsync_grpc.tools.engines.registry import BuiltEngine, EngineFactory, EngineOptions

DEFAULT_SIZE = "tiny"
"""The preset ``--engine synthetic`` serves without ``--size``."""


class SyntheticPlugin(EngineFactory):
    """The synthetic engine: ``--size PRESET`` (``--synthetic PRESET`` is short for ``--engine synthetic --size``)."""

    name = "synthetic"
    help = "a tensor-only model with Llama names and shapes, weights only (--synthetic PRESET: short for --size PRESET)"

    def add_options(self, options: EngineOptions) -> None:
        """``--size PRESET`` and ``--seed N``."""
        options.add_argument(
            "--size",
            metavar="PRESET",
            help=f"the synthetic model: {', '.join(synthetic.PRESETS)} (default {DEFAULT_SIZE})",
        )
        options.add_argument(
            "--seed", type=cli_options.count, default=0, metavar="N", help="seed of the synthetic model's values"
        )

    def check(self, args: argparse.Namespace) -> None:
        """Resolve ``--synthetic`` into ``args.size`` and check the preset.

        Raises:
            UsageError: ``--model`` given, ``--synthetic`` and ``--size`` disagree, or no such preset.
        """
        if args.model is not None:
            raise UsageError(
                "--engine synthetic builds its own tensors: drop --model DIR (or serve --engine reference)"
            )
        if args.synthetic is not None:
            if args.size is not None and args.size != args.synthetic:
                raise UsageError(f"--synthetic {args.synthetic} and --size {args.size} disagree: give one of them")
            args.size = args.synthetic
        if args.size is None:
            args.size = DEFAULT_SIZE
        if args.size not in synthetic.PRESETS:
            option = "--synthetic" if args.synthetic is not None else "--size"
            raise UsageError(
                f"{option} {args.size}: no such synthetic preset: choose one of {', '.join(synthetic.PRESETS)}"
            )

    def build(self, args: argparse.Namespace) -> BuiltEngine:
        """Build the preset's tensors (seconds for the GB presets), on ``--device``.

        Raises:
            UsageError: no such ``--device`` on this host.
        """
        cli_options.check_device(args.device)
        tensors = synthetic.build(args.size, dtype=parse_dtype(args.dtype), seed=args.seed)
        if args.device != "cpu":
            tensors = {n: t.to(args.device) for n, t in tensors.items()}
        engine = TensorEngine(tensors, aliases=synthetic.aliases(args.size), name=f"synthetic-{args.size}")
        return BuiltEngine(engine)
