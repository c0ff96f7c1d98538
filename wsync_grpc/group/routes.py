"""Which local address reaches a peer: the interface the weight-sync group's sockets use.

A host with several interfaces (a node with a management and a data network, a container or a
network namespace with its own) reaches each peer from one of its addresses, the one the kernel's
route to that peer leaves from. The trainer's store listens on one address (``master_address``),
and each member's gloo sockets listen on the address its route to the store leaves from, not on
whatever the host name resolves to (often loopback, which peers in other hosts or namespaces
cannot reach).

Nothing here sends a packet: a UDP socket's ``connect`` only looks the route up.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable

DISCARD_PORT = 9
"""The port a route is looked up with (any port gives the same route; nothing is sent)."""


def resolve(host: str, port: int = DISCARD_PORT) -> list[tuple[socket.AddressFamily, str]]:
    """The addresses ``host`` (a name or an address, IPv6 possibly in brackets) resolves to, IPv4 first.

    Raises:
        OSError: ``host`` does not resolve.
    """
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)
    found = list(dict.fromkeys((socket.AddressFamily(i[0]), str(i[4][0])) for i in infos))
    return sorted(found, key=lambda f: f[0] != socket.AF_INET)


def local_address_to(host: str) -> str | None:
    """The address of this host that the route to ``host`` leaves from; ``None`` when there is none.

    For an address of this host, an address of this host (usually that one; ``127.0.0.5`` gives
    ``127.0.0.1``: see :func:`own_address`). ``host`` may be a name: its addresses are tried in
    :func:`resolve`'s order. No packet is sent.
    """

    def route(s: socket.socket, address: str) -> str:
        s.connect((address, DISCARD_PORT))
        return str(s.getsockname()[0])

    return _first_datagram(host, route)


def own_address(host: str) -> str | None:
    """``host``'s address if it is one of this host's (a socket can be bound to it), else ``None``."""

    def bound(s: socket.socket, address: str) -> str:
        s.bind((address, 0))
        return address

    return _first_datagram(host, bound)


def _first_datagram(host: str, probe: Callable[[socket.socket, str], str]) -> str | None:
    """``probe(a UDP socket of the address's family, address)`` for ``host``'s addresses in :func:`resolve`'s
    order: the first answer; ``None`` when ``host`` does not resolve or every probe raised ``OSError``."""
    try:
        candidates = resolve(host)
    except OSError:
        return None
    for family, address in candidates:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
            return probe(s, address)
    return None


def gloo_listen_address(master_address: str) -> str | None:
    """The address this member's gloo sockets listen on: the store's own, or the one the route to it leaves from.

    torch's default gloo device listens on what the host name resolves to, often loopback (``127.0.0.1
    myhost`` in ``/etc/hosts``) or an interface the other members cannot reach; members on other hosts
    or in other network namespaces then fail to connect. On the store's host (the trainer, and any
    member beside it), ``master_address`` itself; elsewhere the route to it names the interface the
    group is reached on. ``None`` (torch's default device) when ``GLOO_SOCKET_IFNAME`` is set (the
    operator chose) or no route leads to the store.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    return own_address(master_address) or local_address_to(master_address)


def target_host(target: str) -> str:
    """The host part of a gRPC target (``host:port``, ``[v6]:port``, ``dns:///host:port``, ``ipv4:a:p``...).

    A ``unix:`` target is this host: ``localhost``.

    Raises:
        ValueError: a target with no host.
    """
    t = target
    if t.startswith(("unix:", "unix-abstract:")):
        return "localhost"
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme) :]
            if t.startswith("//"):  # dns://authority/host:port
                t = t[2:].partition("/")[2]
            t = t.split(",")[0]  # ipv4:a:p,b:q names several: the first
            break
    if t.startswith("["):
        host = t[1 : t.find("]")] if "]" in t else ""
    elif t.count(":") == 1:
        host = t.rsplit(":", 1)[0]
    else:
        host = t  # no port, or a bare IPv6 address
    if not host:
        raise ValueError(f"no host in target {target!r}")
    return host


def route_address(target: str) -> str:
    """The address of this host that reaches the engine at gRPC ``target``: a ``master_address`` for it.

    ``TrainerClient(master_address="auto")`` uses it on the first engine at every group formation.

    Raises:
        ValueError: ``target`` has no host, does not resolve, or no route leads to it.
    """
    host = target_host(target)
    address = local_address_to(host)
    if address is None:
        raise ValueError(f"no route from this host to {host!r} (target {target!r}): give master_address explicitly")
    return address
