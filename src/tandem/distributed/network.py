"""Which network interface reaches the job's master, for the workers' transports: gloo and
NCCL bind to the host name's address, which many images resolve to 127.0.0.1 (:func:`route_to`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from tandem.errors import UsageError, param

#: the variables that tell each transport its interface (gloo, NCCL's bootstrap and sockets,
#: TensorPipe's RPC); a user's own setting of any of them is kept
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Route:
    """``iface`` (holding ``local``) is where this machine's packets to ``remote`` leave."""

    iface: str
    local: str
    remote: str


def resolve(host: str) -> str:
    """``host``'s IPv4 address; a one-line error naming it when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"cannot resolve the master address {host!r}: {exc}") from None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None (no such interface, or none set)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_to(host: str, iface: str | None = None) -> Route:
    """The interface and local address this machine reaches ``host`` from (``iface`` given:
    that one, checked). A one-line error when no route leads there."""
    remote = resolve(host)
    if iface is not None:
        local = interface_address(iface)
        if local is None:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise UsageError(f"{param('iface')} {iface}: no such interface with an IPv4 address on "
                             f"this machine (it has: {names})")
        return Route(iface, local, remote)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((remote, 9))  # UDP: only picks the route, sends nothing
        except OSError as exc:
            raise UsageError(f"no route from this machine to the master {host} ({remote}): "
                             f"{exc.strerror}") from None
        local = sock.getsockname()[0]
    name = next((interface for _, interface in socket.if_nameindex()
                 if interface_address(interface) == local), None)
    if name is None:
        raise UsageError(f"cannot tell which interface holds {local}, this machine's address "
                         f"towards {host}; name it with {param('iface')}")
    return Route(name, local, remote)


def has_reverse_name(address: str) -> bool:
    """False when ``address`` has no host name for want of a DNS answer (c10d's err=-3)."""
    try:
        socket.getnameinfo((address, 0), 0)
    except socket.gaierror as exc:
        return exc.errno != socket.EAI_AGAIN
    return True
