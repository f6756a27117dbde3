"""The loopback rule: what counts as this host, for gRPC targets and for gRPC peers.

Same-host weight sync (a shared file instead of a stream) is only offered by the learner to
replicas it addresses on this host (`is_local_target`) and only accepted by the server from
clients that call from this host (`is_local_peer`); both parse their strings down to a host and
decide with the one rule, `is_loopback_host`: `localhost`, a loopback address (IPv4-mapped
IPv6 ones included), or a Unix socket.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

_UNIX_SCHEMES = ("unix:", "unix-abstract:")


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address ("127.0.0.1", "[::1]", "localhost") is this host."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _host_of(host_port: str) -> str:
    """The host of "host:port", "[v6]:port", "host" or a bare IPv6 address."""
    if host_port.startswith("["):
        return host_port[1 : host_port.find("]")]
    if host_port.count(":") == 1:  # host:port (more colons: a bare IPv6 address)
        return host_port.split(":")[0]
    return host_port


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer string, as a server sees its client ("ipv4:127.0.0.1:5000",
    "ipv6:%5B::1%5D:5000" or "ipv6:[::1]:5000", "unix:..."), is a client on this host."""
    if peer.startswith(_UNIX_SCHEMES):
        return True
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return False
    return is_loopback_host(_host_of(unquote(rest)))


def is_local_target(target: str) -> bool:
    """Whether a gRPC target, as a client dials it ("127.0.0.1:50051", "localhost:5",
    "[::1]:5", "dns:///localhost:5", "ipv4:127.0.0.1:5,127.0.0.2:5", "unix:/x"), is this host.
    A target of several addresses is local when every one of them is."""
    if target.startswith(_UNIX_SCHEMES):
        return True
    if target.startswith("dns:"):
        target = target.removeprefix("dns:")
        if target.startswith("//"):  # dns://authority/host:port: the authority is the resolver
            target = target[2:].partition("/")[2]
        addresses = [target]
    elif target.startswith(("ipv4:", "ipv6:")):
        addresses = target.partition(":")[2].split(",")
    else:
        addresses = [target]
    return all(is_loopback_host(_host_of(unquote(address))) for address in addresses)
