"""wsync inside a vLLM engine (the optional ``vllm`` extra).

Three parts, in the three kinds of process a vLLM engine runs:

- every process: :func:`register`, the ``vllm.general_plugins`` entry point,
  registers wsync's weight-transfer backend (``"wsync"``) with vLLM's
  ``WeightTransferEngineFactory``, so that installing wsync in a vLLM
  environment is enough;
- each worker process: :mod:`~wsync_grpc.engines.vllm.transfer` (the backend:
  group membership, background receive, layerwise-reload apply) and
  :mod:`~wsync_grpc.engines.vllm.worker` (the methods the front process calls
  through ``collective_rpc``);
- the front process (vLLM's OpenAI-compatible API server):
  :mod:`~wsync_grpc.engines.vllm.front` (the servicer's engine adapter over
  vLLM's engine client) and :mod:`~wsync_grpc.engines.vllm.server` (one
  command serving ``wsync.v1`` beside vLLM's HTTP API).
"""

from __future__ import annotations

BACKEND_NAME = "wsync"
"""The weight-transfer backend name (``--weight-transfer-config '{"backend": "wsync"}'``)."""

WORKER_EXTENSION = "wsync_grpc.engines.vllm.worker.WsyncWorkerExtension"
"""The worker extension class (``--worker-extension-cls``)."""


def register() -> None:
    """Register the ``wsync`` weight-transfer backend with vLLM (idempotent; vLLM calls it in every process).

    Lazy: the backend's module is imported only when vLLM creates the
    engine in a worker.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "wsync_grpc.engines.vllm.transfer", "WsyncTransferEngine"
        )
