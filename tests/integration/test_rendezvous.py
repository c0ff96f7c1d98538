"""A closed rendezvous: the trainer's store listens where it was told only, and Init cannot probe.

A real gRPC server on a loopback port serving a :class:`TensorEngine`; a real
:class:`TrainerClient` as rank 0 of a real gloo group in this process; a plain
TCP server that is not a store, for the probes.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import psutil
import pytest
from support import code_of, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.testing import in_process_server, join_as_trainer
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.wire.status import error_info, error_reason

pytestmark = pytest.mark.timeout(120)

BANNER = b"ZQXJ-not-a-store-7f3a\r\n"
"""What the fake service answers every connection with: no part of it may come back from Init."""


class Listener:
    """A plain TCP server on 127.0.0.1 that answers :data:`BANNER` and counts its connections."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    conn.sendall(BANNER)
                    conn.recv(1024)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@contextmanager
def listener() -> Iterator[Listener]:
    server = Listener()
    try:
        yield server
    finally:
        server.close()


def init_request(port: int, address: str = "127.0.0.1", timeout_s: int = 4) -> pb.InitRequest:
    req = pb.InitRequest(master_address=address, master_port=port, rank_offset=1, world_size=2)
    req.timeout.FromSeconds(timeout_s)
    return req


def listening(port: int) -> list[str]:
    """The local addresses this process listens on at TCP ``port``."""
    conns = psutil.Process().net_connections(kind="inet")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def other_local_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def test_the_trainers_store_listens_on_the_master_address_only() -> None:
    with tensor_server("tiny", seed=0) as (srv, _engine, _stub):
        with TrainerClient([srv.address], master_address="127.0.0.1") as client:
            port = client.init()[srv.address].raw.group.master_port
            assert listening(port) == ["127.0.0.1"], listening(port)
            other = other_local_address()
            if other is not None:  # reachable on loopback, refused on the host's other address
                with pytest.raises(OSError), socket.create_connection((other, port), timeout=5):
                    pass
            r = client.sync(synthetic.build("tiny", seed=3).items(), "v1")
            assert r.engines[srv.address].weight_version == "v1"
        assert listening(port) == []  # the store went with the group


def test_a_master_address_outside_the_allow_list_is_refused_before_any_connection() -> None:
    engine = TensorEngine(synthetic.build("tiny", seed=0))
    with listener() as fake, in_process_server(engine, allowed_masters=["10.0.0.0/8", "fd00::/8"]) as (_srv, stub):
        for address in ("127.0.0.1", "localhost", "[::1]"):
            with pytest.raises(grpc.RpcError) as e:
                stub.Init(init_request(fake.port, address), timeout=30)
            assert code_of(e.value) == grpc.StatusCode.PERMISSION_DENIED, e.value
            assert error_reason(e.value) == "MASTER_NOT_ALLOWED"
            assert "--allow-master" in (e.value.details() or "")
        assert fake.connections == 0
        st = status(stub)
        assert st.state == State.UNINITIALIZED.value and not st.HasField("owner")


def test_a_master_inside_the_allow_list_joins() -> None:
    engine = TensorEngine(synthetic.build("tiny", seed=0))
    with in_process_server(engine, allowed_masters=["127.0.0.0/8"]) as (_srv, stub):
        group = join_as_trainer(stub)
        try:
            st = status(stub)
            assert st.state == State.READY.value and st.group.master_address == "127.0.0.1"
        finally:
            group.destroy()


def test_a_join_to_a_port_that_is_not_a_store_does_not_echo_what_it_answered() -> None:
    with listener() as fake, tensor_server("tiny", seed=0) as (_srv, _engine, stub):
        with pytest.raises(grpc.RpcError) as e:
            stub.Init(init_request(fake.port), timeout=60)
        assert fake.connections >= 1  # the engine did try the address it was given
        err = e.value
        assert code_of(err) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), err
        reason, metadata = error_info(err)
        assert reason in ("JOIN_FAILED", "JOIN_TIMEOUT"), reason
        echoed = [
            BANNER[:4].decode(),
            str(int.from_bytes(BANNER[:4], "little")),  # torch's "Got: <int>" of the first 4 bytes
            str(int.from_bytes(BANNER[:4], "big")),
            BANNER[:4].hex(),
        ]
        last = status(stub).last_error
        for text in (err.details() or "", *metadata.values(), last.message):
            for leak in echoed:
                assert leak not in text, (leak, text)
        assert "no torch.distributed store" in (err.details() or "")
