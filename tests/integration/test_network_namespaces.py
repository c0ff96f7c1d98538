"""Beyond loopback: engines in network namespaces of their own, reached over veth pairs.

Each engine is a real ``wsync serve`` process started with ``ip netns exec`` in a namespace the test
creates, with a veth pair and private addresses (``10.x.y.0/24`` per engine: the host's side ``.1``,
the engine's ``.2``, a default route back to the host, which forwards between these links only) that
the test removes again, whatever happens.
The trainer is this process, in the host's namespace: the rendezvous store, gloo's sockets and gRPC
(TLS, the engines' certificates naming a host name rather than an address) all cross real
interfaces, as between hosts. Checked: ``master_address="auto"`` picks the host's address on the
first engine's link; the store listens there only (an engine's namespace reaches it, the host's
other addresses refuse); a sync arrives bit-exact in every namespace; an engine whose link goes down
in the middle of the broadcast is named within the keepalive bound and the trainer does not hang.

Needs root and ``ip netns`` (CI runs as root); skipped, with the reason, where the host forbids them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from support import ENV, ROOT, write_tls

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, cli_command, spawn_process, stop_all, wait_all
from wsync_grpc.trainer import EngineCallError, SyncError, SyncProgress, TrainerClient, route_address
from wsync_grpc.wire.keepalive import Keepalive

TOKEN = "netns-token"
FLEET_DOMAIN = "fleet.wsync.test"
"""The engines' certificates name ``*.fleet.wsync.test``; the client checks the name it expects, not an address."""
SERVER_NAME = f"rollout.{FLEET_DOMAIN}"
KEEPALIVE = Keepalive(interval_s=1.0, timeout_s=2.0)
"""Both ends, so that the bound is seconds."""
BOUND_S = KEEPALIVE.bound_s + 2.0
"""The documented bound for an engine that stops answering: the keepalive's interval and timeout, then 2 s for a
re-attached ``Watch`` (docs/failure-semantics.md); 5 s here."""
SLACK_S = 2.0
"""What the bound may be exceeded by on a loaded host: the abort of the broadcast, thread wake-ups."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _namespaces_forbidden() -> str | None:
    """Why this host cannot give the test namespaces and veth pairs, or ``None`` if it can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"wsprobe{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"this host forbids network namespaces: ip netns add: {r.stderr.strip()}"
    try:
        r = _ip("link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b", "netns", probe, check=False)
        if r.returncode != 0:
            return f"this host forbids veth pairs: ip link add: {r.stderr.strip()}"
        _ip("link", "del", f"{probe}a", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


_FORBIDDEN = _namespaces_forbidden() if sys.platform == "linux" else "network namespaces are Linux's"
# Wall-clock bounds (a cut-off engine named within its keepalive bound): `make test` runs it serially.
pytestmark = [pytest.mark.skipif(_FORBIDDEN is not None, reason=_FORBIDDEN or ""), pytest.mark.serial]


@dataclass
class Link:
    """One engine's namespace and its veth pair: ``host_if`` (``host_address``) <-> ``ns_if`` (``address``)."""

    namespace: str
    host_if: str
    ns_if: str
    host_address: str
    address: str

    def exec(self, *command: str) -> list[str]:
        """``command`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def down(self) -> None:
        """Cut the namespace off: the host's end of the pair goes down."""
        _ip("link", "set", self.host_if, "down")


@contextmanager
def namespaces(count: int) -> Iterator[list[Link]]:
    """``count`` namespaces, each with a veth pair to the host and a /24 of its own; all removed at the end."""
    run = secrets.token_hex(2)
    net = 200 + secrets.randbelow(50)
    base = secrets.randbelow(200)
    links: list[Link] = []
    try:
        for i in range(count):
            prefix = f"10.{net}.{base + i}"
            link = Link(f"wsync-{run}-e{i}", f"ws{run}h{i}", f"ws{run}n{i}", f"{prefix}.1", f"{prefix}.2")
            _ip("netns", "add", link.namespace)
            links.append(link)
            _ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if, "netns", link.namespace)
            _ip("addr", "add", f"{link.host_address}/24", "dev", link.host_if)
            _ip("link", "set", link.host_if, "up")
            # Engines reach each other too (gloo connects every pair of ranks): the host routes between the
            # namespaces, for packets coming in on these links only (the host's own forwarding stays as it is).
            Path(f"/proc/sys/net/ipv4/conf/{link.host_if}/forwarding").write_text("1\n")
            _ip("-n", link.namespace, "addr", "add", f"{link.address}/24", "dev", link.ns_if)
            _ip("-n", link.namespace, "link", "set", link.ns_if, "up")
            _ip("-n", link.namespace, "link", "set", "lo", "up")
            _ip("-n", link.namespace, "route", "add", "default", "via", link.host_address)
        yield links
    finally:
        for link in links:
            _ip("link", "del", link.host_if, check=False)  # takes its peer along
            _ip("netns", "del", link.namespace, check=False)
    leftovers = [n for n in _ip("netns", "list").stdout.split() if n.startswith(f"wsync-{run}-")]
    assert not leftovers, leftovers


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, and the fleet's certificate for ``*.fleet.wsync.test`` (a name, no address) signed by it."""
    return write_tls(tmp_path_factory.mktemp("tls"), f"*.{FLEET_DOMAIN}")


def credentials(tls: dict[str, Path]) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls["ca"].read_bytes())


NAME_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)
"""The host name the client checks the engines' certificates against (targets are the namespaces' addresses)."""


@contextmanager
def fleet(links: list[Link], tls: dict[str, Path], tmp: Path, preset: str) -> Iterator[list[EngineProcess]]:
    """One ``wsync serve`` per namespace on its address (TLS, token, :data:`KEEPALIVE`); stopped at the end."""
    masters = ",".join(f"{link.host_address}/32" for link in links[:1])
    env = {**ENV, "WSYNC_TOKEN": TOKEN}
    procs: list[EngineProcess] = []
    try:
        for i, link in enumerate(links):
            command = cli_command(
                "serve",
                "--synthetic",
                preset,
                "--dtype",
                "bfloat16",
                "--host",
                link.address,
                "--port",
                "0",
                "--port-file",
                str(tmp / f"engine{i}.port"),
                "--tls-cert",
                str(tls["cert"]),
                "--tls-key",
                str(tls["key"]),
                "--allow-master",
                masters,
                "--keepalive-interval",
                str(KEEPALIVE.interval_s),
                "--keepalive-timeout",
                str(KEEPALIVE.timeout_s),
                "--grace",
                "1",
            )
            procs.append(
                spawn_process(
                    link.exec(*command),
                    ready_file=tmp / f"engine{i}.port",
                    log=tmp / f"engine{i}.log",
                    env=env,
                    cwd=ROOT,
                    wait=False,
                    name=f"engine{i}",
                    host=link.address,
                )
            )
        wait_all(procs)
        yield procs
    finally:
        stop_all(procs, grace_s=3)


def client(engines: list[EngineProcess], tls: dict[str, Path], **options: object) -> TrainerClient:
    return TrainerClient(
        [e.target for e in engines],
        master_address="auto",
        token=TOKEN,
        credentials=credentials(tls),
        channel_options=NAME_OPTIONS,
        keepalive=KEEPALIVE,
        **options,  # type: ignore[arg-type]
    )


def listening(port: int) -> list[str]:
    """The local addresses this process listens on at TCP ``port``."""
    conns = psutil.Process().net_connections(kind="inet")
    return sorted(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def connects_from(link: Link, address: str, port: int) -> bool:
    """Whether a TCP connection from inside ``link``'s namespace to ``address:port`` is accepted."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=5).close()\n"
        "except OSError as e:\n"
        "    print(e); sys.exit(1)\n"
    )
    r = subprocess.run(link.exec(sys.executable, "-c", probe), capture_output=True, text=True, timeout=30)
    return r.returncode == 0


def refused_here(address: str, port: int) -> bool:
    """Whether a TCP connection from the host's namespace to ``address:port`` is refused."""
    try:
        socket.create_connection((address, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.timeout(300)
def test_a_sync_across_namespaces_is_bit_exact_with_the_store_on_the_chosen_interface_only(
    tls: dict[str, Path], tmp_path: Path
) -> None:
    weights = synthetic.build("tiny", seed=7, dtype=torch.bfloat16)
    with namespaces(2) as links, fleet(links, tls, tmp_path, "tiny") as engines:
        first, second = links
        assert route_address(engines[0].target) == first.host_address
        with client(engines, tls, group_timeout_s=60, rpc_timeout_s=30) as c:
            inits = c.init()
            port = c.port
            assert port is not None
            # "auto" chose the host's address on the first engine's link; every engine was told it.
            assert {r.raw.group.master_address for r in inits.values()} == {first.host_address}
            # The store listens there only: reachable from both namespaces (the second one through its own
            # link and the host's routing), refused on the host's other addresses.
            assert listening(port) == [first.host_address], listening(port)
            assert connects_from(first, first.host_address, port)
            assert connects_from(second, first.host_address, port)
            assert not connects_from(second, second.host_address, port)
            assert refused_here("127.0.0.1", port)
            assert refused_here(second.host_address, port)

            result = c.sync(weights.items(), "netns-v1")
            assert {t: r.weight_version for t, r in result.engines.items()} == dict.fromkeys(c.targets, "netns-v1")
            expected = {name: tensor_sha256(t) for name, t in weights.items()}
            for target, sums in c.checksums().items():
                got = {x.name: x.sha256 for x in sums.checksums}
                assert got == expected, target
            statuses = c.status()
            assert all(s.weight_version == "netns-v1" for s in statuses.values()), statuses
        assert listening(port) == []  # the store went with the group


@pytest.mark.timeout(180)
def test_tls_across_namespaces_checks_the_engines_host_name(tls: dict[str, Path], tmp_path: Path) -> None:
    with namespaces(1) as links, fleet(links, tls, tmp_path, "tiny") as engines:
        target = engines[0].target
        with client(engines, tls) as c:  # the name the fleet's certificate holds: served
            assert c.status()[target].engine.tensor_count == len(synthetic.build("tiny"))
        # Another name than the certificate's is refused at the handshake, across the link as on loopback.
        channel = grpc.secure_channel(
            target, credentials(tls), options=[("grpc.ssl_target_name_override", "rollout.other.test")]
        )
        with channel, pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=5)
        # And the token is still required over TLS.
        with (
            TrainerClient([target], credentials=credentials(tls), channel_options=NAME_OPTIONS) as anonymous,
            pytest.raises(EngineCallError) as e,
        ):
            anonymous.status()
        assert e.value.failures[target].code == grpc.StatusCode.UNAUTHENTICATED, e.value


@pytest.mark.timeout(300)
def test_an_engine_cut_off_mid_broadcast_is_named_within_the_keepalive_bound(
    tls: dict[str, Path], tmp_path: Path
) -> None:
    old = synthetic.build("0.25gb", seed=1, dtype=torch.bfloat16)
    new = synthetic.build("0.25gb", seed=2, dtype=torch.bfloat16)
    with ExitStack() as stack:
        links = stack.enter_context(namespaces(2))
        engines = stack.enter_context(fleet(links, tls, tmp_path, "0.25gb"))
        victim, survivor = engines[1], engines[0]
        cut_at: list[float] = []

        def progress(p: SyncProgress) -> None:
            if p.buckets_sent == 1 and not cut_at:
                links[1].down()
                cut_at.append(time.monotonic())

        c = stack.enter_context(client(engines, tls, group_timeout_s=120, rpc_timeout_s=30))
        c.sync(old.items(), "v1", bucket_bytes=16 << 20)
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                c.sync(new.items(), "v2", bucket_bytes=16 << 20, progress=progress)
            except BaseException as exc:
                outcome["error"] = exc
            outcome["at"] = time.monotonic()

        t = threading.Thread(target=run, name="netns-sync", daemon=True)
        t.start()
        t.join(BOUND_S + SLACK_S + 60)
        assert not t.is_alive(), "the trainer hung after the link went down"
        assert cut_at, "the link was never cut (fewer than two buckets?)"
        err = outcome.get("error")
        assert isinstance(err, SyncError), outcome
        noticed_s = float(outcome["at"]) - cut_at[0]  # type: ignore[arg-type]
        print(f"link down -> SyncError in {noticed_s:.2f} s (bound {BOUND_S:g} s + {SLACK_S:g} s slack): {err}")
        assert victim.target in err.failures, err
        assert noticed_s <= BOUND_S + SLACK_S, (noticed_s, err)
        # Nothing was published: the survivor still serves v1, bit-exact.
        with suppress(Exception):
            c.close()
        with TrainerClient(
            [survivor.target], token=TOKEN, credentials=credentials(tls), channel_options=NAME_OPTIONS
        ) as reader:
            assert reader.status()[survivor.target].weight_version == "v1"
            got = {x.name: x.sha256 for x in reader.checksums()[survivor.target].checksums}
        assert got == {name: tensor_sha256(t) for name, t in old.items()}
