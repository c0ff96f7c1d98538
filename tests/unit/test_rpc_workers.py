"""The two halves of a remote-worker engine name their calls from one list (the calls themselves run between a
real vLLM front and its workers, through ``WsyncWorkerExtension.wsync_call``, in ``tests/e2e/test_vllm_engine.py``
and ``test_vllm_tensor_parallel.py``)."""

from __future__ import annotations

import pytest

from wsync_grpc.engines.rpc import WorkerCall
from wsync_grpc.engines.worker_calls import WORKER_CALLS, dispatch


def test_every_call_the_front_makes_has_one_handler_on_the_workers() -> None:
    assert set(WORKER_CALLS) == set(WorkerCall)
    assert all(isinstance(c.value, str) for c in WorkerCall)


def test_a_call_of_another_version_is_refused_by_name_before_any_worker_state_is_read() -> None:
    with pytest.raises(NotImplementedError, match="no_such_call"):
        dispatch(None, "no_such_call", [])  # type: ignore[arg-type]  # refused before the worker is read
