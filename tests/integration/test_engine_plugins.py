"""An engine plug-in registered at run time is served by ``wsync serve``'s generic path, end to end.

The child process registers :class:`OnesPlugin` with the registry's public
function, then runs the ``wsync`` command's ``main`` (``serve --engine ones
--port 0 --port-file F``): its own option parsed, its engine built and served
by the weight-sync server, ``GetStatus`` answered over gRPC, and ``close``
called at SIGTERM.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from support import ENV, ROOT
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import spawn_process
from wsync_grpc.tools.engines import BuiltEngine, EngineFactory, EngineOptions, register_engine


class OnesPlugin(EngineFactory):
    """``--ones-count N`` tensors of four ones; ``close`` writes ``--ones-closed-file``."""

    name = "ones"
    help = "N tensors of four ones (a test engine)"

    def add_options(self, options: EngineOptions) -> None:
        options.add_argument("--ones-count", type=int, default=2, metavar="N", help="how many tensors")
        options.add_argument("--ones-closed-file", type=Path, help="written when the engine is closed")

    def build(self, args: argparse.Namespace) -> BuiltEngine:
        engine = TensorEngine({f"w.{i}": torch.ones(4) for i in range(args.ones_count)}, name="ones")
        closed: Path | None = args.ones_closed_file

        def close() -> None:
            if closed is not None:
                closed.write_text("closed")

        return BuiltEngine(engine, close=close)


def child_main() -> int:
    """The child process: register the plug-in, then run ``wsync`` on this process's arguments."""
    from wsync_grpc.tools import cli

    register_engine(OnesPlugin())
    return cli.main(sys.argv[1:])


@pytest.mark.timeout(120)
def test_a_plugin_registered_at_run_time_is_served_by_wsync_serve(tmp_path: Path) -> None:
    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(ROOT / 'tests')!r}]; "
        "import test_engine_plugins as t; sys.exit(t.child_main())"
    )
    closed = tmp_path / "closed"
    port_file = tmp_path / "port"
    args = ["serve", "--engine", "ones", "--ones-count", "3", "--ones-closed-file", str(closed), "--grace", "1"]
    engine = spawn_process(
        [sys.executable, "-c", code, *args, "--port", "0", "--port-file", str(port_file)],
        ready_file=port_file,
        log=subprocess.PIPE,
        env=ENV,
        cwd=ROOT,
        timeout_s=90,
    )
    proc = engine.process
    try:
        with grpc.insecure_channel(engine.target) as ch:
            st = weight_sync_pb2_grpc.WeightSyncServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert st.engine.name == "ones" and st.engine.tensor_count == 3 and st.engine.parameter_count == 12
        engine.terminate()
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, out
        assert "model ones: 3 tensors" in out and "stopped" in out
        assert closed.read_text() == "closed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
