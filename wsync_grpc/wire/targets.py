"""Which addresses only this host reaches, and the client's refusal to send a token in clear to any other.

A bearer token sent over a plaintext channel can be read by anyone on the path. The CLI and
:class:`~wsync_grpc.trainer.client.TrainerClient` therefore refuse a token without TLS unless the
target is on this host (:func:`check_clear_token`); the engine's own rule for its bind address is the
same test (:func:`is_loopback`).
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)
"""Host names that only this host reaches (besides the loopback addresses, 127.0.0.0/8 and ::1)."""

LOCAL_SCHEMES = ("unix:", "unix-abstract:")
"""gRPC target schemes that never leave this host."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this host only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_host(target: str) -> str:
    """The host of a gRPC target: ``host:port``, ``[v6]:port``, ``dns:///host:port``, ``ipv4:a.b.c.d:port``...

    Returns ``""`` for a target that stays on this host (``unix:`` sockets).
    """
    if target.startswith(LOCAL_SCHEMES):
        return ""
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :].lstrip("/")
            if "/" in target:  # dns://authority/host:port
                target = target.split("/", 1)[1]
            break
    target = target.split(",", 1)[0]
    if target.startswith("["):
        return target[1:].partition("]")[0]
    if target.count(":") > 1:  # a bare IPv6 address, no port
        return target
    return target.rpartition(":")[0] if ":" in target else target


def check_clear_token(target: str) -> None:
    """Refuse to send a token in clear (no TLS) to ``target`` unless only this host reaches it.

    Raises:
        ValueError: ``target`` is not a loopback address; the message names it and suggests TLS.
    """
    host = target_host(target)
    if host and not is_loopback(host):
        raise ValueError(
            f"refusing to send a token in clear to {target}: it is not a loopback address (127.0.0.0/8, ::1, "
            "localhost), so anyone on the path could read it; connect with TLS (TrainerClient(credentials=...), "
            "or the CLI's --tls-ca), or reach the engine on a loopback address (e.g. through an SSH tunnel)"
        )
