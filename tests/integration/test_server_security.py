"""The control port when exposed: TLS and the bearer token, on the server and in the ``wsync`` CLI.

Real servers on loopback ports with real certificates (``trustme``'s test CA); the CLI runs as its
own process. Refusals of a half TLS configuration, a missing file, an exposed port without TLS and
token, and server bounds that cannot work come before any model is loaded, as one line on stderr
with exit status 2. With a token on an exposed port, reflection needs the token; health never does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import ENV, ROOT, code_of, write_tls
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.server import WsyncServer, build_server
from wsync_grpc.testing import free_port, spawn_engine
from wsync_grpc.trainer import SyncProgress, TrainerClient

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it, as PEM files."""
    return write_tls(tmp_path_factory.mktemp("tls"), "127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def tls_server(tls: dict[str, Path]) -> Iterator[WsyncServer]:
    engine = TensorEngine(synthetic.build("tiny", dtype=torch.bfloat16), aliases=synthetic.aliases("tiny"))
    srv = build_server(engine, token=TOKEN, tls_cert=tls["cert"], tls_key=tls["key"])
    yield srv
    srv.stop(0.5)


def tls_stub(tls: dict[str, Path], srv: WsyncServer) -> weight_sync_pb2_grpc.WeightSyncServiceStub:
    creds = grpc.ssl_channel_credentials(root_certificates=tls["ca"].read_bytes())
    return weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.secure_channel(f"127.0.0.1:{srv.port}", creds))


def wsync(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync_grpc.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=ROOT,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(tls: dict[str, Path], tls_server: WsyncServer, scheme: str) -> None:
    stub = tls_stub(tls, tls_server)
    st = stub.GetStatus(pb.GetStatusRequest(), metadata=[("authorization", f"{scheme} {TOKEN}")], timeout=10)
    assert st.engine.tensor_count == len(synthetic.build("tiny"))


@pytest.mark.timeout(60)
def test_every_kind_of_call_without_the_token_is_unauthenticated(tls: dict[str, Path], tls_server: WsyncServer) -> None:
    stub = tls_stub(tls, tls_server)
    wrong = [("authorization", "Bearer not-the-token")]
    with pytest.raises(grpc.RpcError) as e:
        stub.GetStatus(pb.GetStatusRequest(), metadata=wrong, timeout=10)
    assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED
    header = pb.PrepareHeader(weight_version="x", bucket_count=1, total_bytes=1)
    with pytest.raises(grpc.RpcError) as e:
        stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=10)
    assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        next(stub.Watch(pb.WatchRequest(update_id="x", hold=True), timeout=10))
    assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"], ids=["loopback", "exposed"])
def test_reflection_needs_the_token_on_an_exposed_port_and_health_never_does(host: str) -> None:
    engine = TensorEngine(synthetic.build("tiny", dtype=torch.bfloat16))
    srv = build_server(engine, host=host, token=TOKEN)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

        def services(metadata: tuple[tuple[str, str], ...]) -> list[str]:
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            (reply,) = list(reflection.ServerReflectionInfo(iter([ask]), metadata=metadata, timeout=10))
            return [s.name for s in reply.list_services_response.service]

        assert "wsync.v1.WeightSyncService" in services((("authorization", f"Bearer {TOKEN}"),))
        if host == "127.0.0.1":
            assert "wsync.v1.WeightSyncService" in services(())
        else:
            with pytest.raises(grpc.RpcError) as e:
                services(())
            assert code_of(e.value) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()
        srv.stop(0.5)


def test_half_a_tls_configuration_is_refused_by_the_server(tls: dict[str, Path]) -> None:
    engine = TensorEngine(synthetic.build("tiny", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="both a certificate and its key"):
        build_server(engine, tls_cert=tls["cert"])


@pytest.mark.timeout(120)
def test_cli_talks_to_a_tls_engine_with_its_ca(tls: dict[str, Path], tls_server: WsyncServer) -> None:
    target = f"127.0.0.1:{tls_server.port}"
    r = wsync("status", "--target", target, "--tls-ca", str(tls["ca"]), "--token", TOKEN)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["engine"]["tensor_count"] == len(synthetic.build("tiny"))
    plain = wsync("status", "--target", target, "--token", TOKEN, "--timeout", "5")
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tls-cert", "{cert}"], "both --tls-cert and --tls-key"),
        (["--tls-cert", "{dir}/missing.pem", "--tls-key", "{key}"], "missing.pem: no such file"),
        (["--tls-client-ca", "{cert}"], "--tls-client-ca needs TLS"),
        (["--host", "0.0.0.0"], "--insecure"),
        (["--host", "0.0.0.0", "--token", "t"], "--insecure"),
        (["--host", "0.0.0.0", "--tls-cert", "{cert}", "--tls-key", "{key}"], "--insecure"),
        (["--max-calls", "everything=3"], "--max-calls takes CLASS=N with CLASS one of control"),
        (["--max-calls", "watch=0"], "at least one watch call must be allowed"),
        (["--keepalive-timeout", "0"], "argument --keepalive-timeout: 0 is not a duration above 0 seconds"),
        (["--update-idle-timeout", "-1"], "argument --update-idle-timeout: -1 is not a duration above 0 seconds"),
        (["--allow-master", "10.0.0.0/33"], "--allow-master: allowed master network '10.0.0.0/33'"),
    ],
    ids=[
        "half-tls",
        "missing-file",
        "client-ca-without-tls",
        "exposed-plain",
        "exposed-token-only",
        "exposed-tls-only",
        "unknown-call-class",
        "no-call-allowed",
        "no-keepalive-timeout",
        "negative-idle-limit",
        "bad-allow-master",
    ],
)
def test_cli_serve_refuses_what_cannot_be_safe_in_one_line(tls: dict[str, Path], args: list[str], says: str) -> None:
    fill = {"cert": str(tls["cert"]), "key": str(tls["key"]), "dir": str(tls["ca"].parent)}
    r = wsync("serve", "--synthetic", "tiny", "--port", "0", *[a.format(**fill) for a in args])
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_cli_serve_exposed_with_insecure_warns_that_the_token_and_the_metrics_are_plaintext(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    engine = spawn_engine(
        [
            *("--synthetic", "tiny", "--host", "0.0.0.0", "--insecure", "--token", "t", "--grace", "1"),
            *("--metrics-host", "0.0.0.0", "--metrics-port", str(free_port())),
        ],
        port_file=tmp_path / "port",
        log=log,
        env=ENV,
        cwd=ROOT,
    )
    try:
        text = log.read_text()
        assert "without TLS: the token travels in plaintext" in text
        assert "metrics served on 0.0.0.0" in text and "without a token" in text
    finally:
        engine.stop()


@pytest.mark.timeout(120)
def test_a_trainer_over_tls_with_the_token_holds_its_lease_and_its_watch(tls: dict[str, Path]) -> None:
    """The trainer's streams (KeepAlive, held Watch) run on their own channels: the same TLS and token."""
    engine = TensorEngine(synthetic.build("tiny", dtype=torch.bfloat16), aliases=synthetic.aliases("tiny"))
    srv = build_server(engine, token=TOKEN, tls_cert=tls["cert"], tls_key=tls["key"])
    try:
        stub, auth = tls_stub(tls, srv), [("authorization", f"Bearer {TOKEN}")]
        creds = grpc.ssl_channel_credentials(root_certificates=tls["ca"].read_bytes())
        target = f"127.0.0.1:{srv.port}"
        with TrainerClient([target], token=TOKEN, credentials=creds, rpc_timeout_s=30) as c:
            waited: list[float] = []

            def progress(_: SyncProgress) -> None:
                if not waited:  # a held Watch refused (no token, no TLS) would end by now and fail the sync
                    time.sleep(0.5)
                    waited.append(0.5)

            new = synthetic.build("tiny", seed=3, dtype=torch.bfloat16)
            c.sync(new.items(), "over-tls", progress=progress)
            st = stub.GetStatus(pb.GetStatusRequest(), metadata=auth, timeout=10)
            assert waited and st.weight_version == "over-tls"
            assert st.owner.owner == c.owner and st.owner.keepalive_calls == 1
    finally:
        srv.stop(0.5)


@pytest.mark.timeout(180)
def test_mutual_tls_admits_only_clients_certified_by_the_client_ca(tls: dict[str, Path], tmp_path: Path) -> None:
    """``--tls-client-ca``: an exposed engine authenticates its callers by certificate, before any call runs.

    A caller without a client certificate, or with one of another authority, cannot complete the TLS
    handshake (UNAVAILABLE); a caller with one of the client CA reads the status, with the CLI too, and a
    trainer syncs. Client certificates stand in for a token, so the engine starts on 0.0.0.0 without one.
    """
    import trustme

    client_ca, stranger_ca = trustme.CA(), trustme.CA()
    client_ca.cert_pem.write_to_path(str(tmp_path / "client-ca.pem"))
    paths: dict[str, tuple[bytes, bytes]] = {}
    for who, ca in (("trainer", client_ca), ("stranger", stranger_ca)):
        cert = ca.issue_cert(f"{who}.wsync.test")
        key, chain = cert.private_key_pem.bytes(), b"".join(b.bytes() for b in cert.cert_chain_pems)
        (tmp_path / f"{who}.key").write_bytes(key)
        (tmp_path / f"{who}.pem").write_bytes(chain)
        paths[who] = (key, chain)
    engine = spawn_engine(
        [
            *("--synthetic", "tiny", "--host", "0.0.0.0", "--grace", "1"),
            *("--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"])),
            *("--tls-client-ca", str(tmp_path / "client-ca.pem")),
        ],
        port_file=tmp_path / "port",
        log=tmp_path / "engine.log",
        env=ENV,
        cwd=ROOT,
    )
    target = engine.target
    root = tls["ca"].read_bytes()

    def status(creds: grpc.ChannelCredentials) -> pb.GetStatusResponse:
        with grpc.secure_channel(target, creds) as ch:
            return weight_sync_pb2_grpc.WeightSyncServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)

    try:
        for creds in (
            grpc.ssl_channel_credentials(root_certificates=root),
            grpc.ssl_channel_credentials(root, *paths["stranger"]),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                status(creds)
            assert code_of(refused.value) is grpc.StatusCode.UNAVAILABLE
        mine = grpc.ssl_channel_credentials(root, *paths["trainer"])
        assert status(mine).engine.tensor_count == len(synthetic.build("tiny"))
        cli = wsync(
            *("status", "--target", target, "--tls-ca", str(tls["ca"])),
            *("--tls-client-cert", str(tmp_path / "trainer.pem"), "--tls-client-key", str(tmp_path / "trainer.key")),
        )
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["engine"]["tensor_count"] == len(synthetic.build("tiny"))
        no_cert = wsync("status", "--target", target, "--tls-ca", str(tls["ca"]), "--timeout", "5")
        assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr, no_cert.stderr
        new = {k: v + 1 for k, v in synthetic.build("tiny", dtype=torch.bfloat16).items()}
        with TrainerClient([target], credentials=mine, rpc_timeout_s=30) as c:
            c.sync(new.items(), "over-mtls")
            assert status(mine).weight_version == "over-mtls"
    finally:
        engine.stop()
