"""The address a worker advertises to peers on other hosts, and which hosts are this one.

A worker binds its sockets on all interfaces (or where told), but what it *advertises*
(its instance record, its model card, the KV-transfer side channel vLLM's NixlConnector
announces to decode workers) must be one address a peer on another host can dial. Neither
`localhost` nor the host name is safe for that: `localhost` is the peer itself, and a
host name may resolve to 127.0.1.1 (Debian's /etc/hosts) or not at all elsewhere. So:

* `--advertise-host` / `$DYN_ADVERTISE_HOST` when given (a deployment knows best: a pod
  IP, a host name its DNS serves);
* else the address of the interface the default route leaves by (a UDP socket
  "connected" to a public address: no packet is sent, the kernel only picks the source);
* else the first non-loopback address the host name resolves to;
* else 127.0.0.1 (a machine with no network: everything is on this host anyway).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

ADVERTISE_HOST_ENV = "DYN_ADVERTISE_HOST"
LOOPBACK = "127.0.0.1"
_ROUTE_PROBES = (("192.0.2.1", 9), ("2001:db8::1", 9))
"""Documentation-only addresses (RFC 5737 / RFC 3849): connecting a UDP socket to them
asks the kernel for the outgoing interface without sending anything anywhere."""

ADVERTISE_HOST_HELP = (
    "Address other hosts reach this worker at: advertised in its instance record and model "
    "card, and given to vLLM's NixlConnector as its side-channel host "
    "($VLLM_NIXL_SIDE_CHANNEL_HOST, unless set) so decode workers on other hosts can fetch "
    f"the prefill's KV. Default: ${ADVERTISE_HOST_ENV}, else the address of the interface "
    "the default route uses, else the host name's first non-loopback address, else "
    f"{LOOPBACK}."
)


def _usable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast)


def _route_address() -> str | None:
    """The source address the kernel would use for the default route, if any."""
    for target in _ROUTE_PROBES:
        family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(target)
            address = str(sock.getsockname()[0])
            if _usable(address):
                return address
    return None


def _hostname_address() -> str | None:
    """The first non-loopback address the host name resolves to."""
    with contextlib.suppress(OSError, UnicodeError):
        for *_, sockaddr in socket.getaddrinfo(socket.gethostname(), None):
            address = str(sockaddr[0])
            if _usable(address):
                return address
    return None


def default_advertise_host() -> str:
    """This host's primary non-loopback address, or 127.0.0.1 when it has none."""
    return _route_address() or _hostname_address() or LOOPBACK


def advertise_host_or_env(given: str | None) -> str:
    """`--advertise-host` when given, else `$DYN_ADVERTISE_HOST`, else the default."""
    for value in (given, os.environ.get(ADVERTISE_HOST_ENV)):
        if value is not None and value.strip():
            return value.strip()
    return default_advertise_host()


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: a loopback or wildcard address, `localhost`, or
    an address one of its interfaces holds (tested by binding a throwaway socket to it)."""
    name = host.strip("[]")
    if name in ("", "*", "localhost"):
        return True
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(address.split("%", 1)[0])
            if ip.is_loopback or ip.is_unspecified:
                return True
        with contextlib.suppress(OSError), socket.socket(family, kind) as sock:
            sock.bind((address, 0, *sockaddr[2:]) if family == socket.AF_INET6 else (address, 0))
            return True
    return False
