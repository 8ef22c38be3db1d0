"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

A test of what happens across machines (a NATS cluster whose nodes live apart, a worker
whose network goes away) needs processes that reach each other only over a network the
test controls. Network namespaces give each "host" its own interfaces, addresses and
ports; `HostNetwork` builds them:

* one namespace per host, named `dynt<pid>-<host>` (the creating process's pid keeps
  parallel runs apart and makes leftovers of a killed run recognisable, see
  `sweep_stale`), with `lo` up;
* a Linux bridge in the root namespace holding `10.<n>.0.1/24`, so the test process
  itself reaches every host directly (HTTP to a frontend, monitoring of a NATS node);
* one veth pair per host: the root side is a port of the bridge, the namespace side is
  `eth0` with `10.<n>.0.<i>/24`. `n` is picked so that the /24 overlaps no route of the
  machine;
* `cut(host)` takes the root side of the host's veth down: the host keeps running but
  nothing reaches it and nothing it sends arrives (no RST, no FIN: a pulled cable, not a
  crashed process); `restore(host)` brings it back;
* `launcher(host)` is the `ip netns exec <ns>` prefix that runs a command in the host
  (`ip` execs the command, so its pid and a parent-death signal set before are kept).

`close()` (also on leaving the `with` block, and when building fails half way) kills
whatever still runs in the namespaces and removes the namespaces, the veths and the
bridge. `available()` says why none of this can be done here (not root, no `ip`, a
kernel or container that refuses namespaces), for a test to skip with that reason.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from dynamo.runtime.parent_death import pid_is_running

PREFIX = "dynt"
"""Every namespace and link this module makes starts with it (then the creator's pid)."""

_NAME_RE = re.compile(rf"^{PREFIX}(\d+)(?:-|br$|v\d+$)")
_MAX_IFNAME = 15  # IFNAMSIZ - 1
_SECOND_OCTETS = range(100, 255)
"""Where the test subnet `10.<n>.0.0/24` is looked for (away from the 10.0-10.99 ranges
that container networks and VPNs tend to use)."""


_open_tags: set[str] = set()
"""Tags of this process's networks now built: names carry only the pid (interface names
have 15 characters), so a process builds one network at a time."""


class NetnsError(RuntimeError):
    """An `ip` command failed; the message has its command line and stderr."""


def ip_binary() -> str | None:
    """The `ip` program (iproute2), on PATH or in /usr/sbin, /sbin; None when missing."""
    found = shutil.which("ip")
    if found:
        return found
    for candidate in ("/usr/sbin/ip", "/sbin/ip", "/bin/ip"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = ip_binary()
    if binary is None:
        raise NetnsError("iproute2's `ip` is not installed")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def available() -> str | None:
    """None when this process can build a `HostNetwork`, else why not: tries the
    namespace, a bridge and a veth pair in a probe namespace (deleted again), since each
    can be refused on its own (no CAP_SYS_ADMIN for /run/netns, no veth module...)."""
    if ip_binary() is None:
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _ip("-n", probe, "link", "add", "probebr", "type", "bridge")
        _ip("-n", probe, "link", "add", "probev0", "type", "veth", "peer", "name", "probev1")
    except NetnsError as exc:
        return f"cannot create a bridge or a veth pair: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> list[str]:
    """Remove the namespaces and links that a run which no longer exists left behind
    (its pid is in their names; a run killed by SIGKILL cannot clean up). Returns what
    was removed. Namespaces and links of live processes are left alone."""
    removed: list[str] = []
    for netns in _netns_names():
        match = _NAME_RE.match(netns)
        if match and not pid_is_running(int(match.group(1))):
            if _ip("netns", "del", netns, check=False).returncode == 0:
                removed.append(netns)
    listing = _ip("-j", "link", "show", check=False)
    for link in json.loads(listing.stdout or "[]") if listing.returncode == 0 else []:
        name = str(link.get("ifname", ""))
        match = _NAME_RE.match(name)
        if match and not pid_is_running(int(match.group(1))):
            if _ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


def _netns_names() -> list[str]:
    listing = _ip("netns", "list", check=False)
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 destination in the machine's routing tables (local addresses too)."""
    listing = _ip("-j", "-4", "route", "show", "table", "all", check=False)
    networks = []
    for route in json.loads(listing.stdout or "[]") if listing.returncode == 0 else []:
        dst = str(route.get("dst", "default"))
        if dst == "default":
            continue
        try:
            networks.append(ipaddress.IPv4Network(dst, strict=False))
        except ValueError:
            continue
    return networks


def pick_subnet(
    used: Sequence[ipaddress.IPv4Network], start: int | None = None
) -> ipaddress.IPv4Network:
    """A `10.<n>.0.0/24` overlapping none of `used`, trying `n` from `start` (default:
    derived from the pid, so two runs at once tend to try different ones first)."""
    octets = list(_SECOND_OCTETS)
    first = (os.getpid() if start is None else start) % len(octets)
    for n in octets[first:] + octets[:first]:
        candidate = ipaddress.IPv4Network(f"10.{n}.0.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise NetnsError("no free 10.<n>.0.0/24 for a test network")


@dataclass(frozen=True)
class Host:
    """One namespace of a `HostNetwork`: its test name, namespace, address and the
    root-side end of its veth (what `cut` takes down)."""

    name: str
    netns: str
    address: str
    veth: str


class HostNetwork:
    """Namespaces `hosts` (test names such as "nats1"), each on one bridge; see the
    module docstring. Build with `with HostNetwork([...]) as net:` or `open()`/`close()`."""

    def __init__(self, hosts: Sequence[str], *, subnet: ipaddress.IPv4Network | None = None):
        if not hosts:
            raise ValueError("a network needs at least one host")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names repeat: {list(hosts)}")
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts on one /24")
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}br"
        if len(f"{self.tag}v{len(hosts)}") > _MAX_IFNAME:
            raise ValueError(f"interface names would exceed {_MAX_IFNAME} characters")
        self._names = list(hosts)
        self._subnet = subnet
        self.hosts: dict[str, Host] = {}
        self.gateway = ""
        self._made_netns: list[str] = []
        self._made_links: list[str] = []
        self._cut: set[str] = set()
        self._opened = False

    # ------------------------------------------------------------------ building

    def open(self) -> HostNetwork:
        """Build everything; on any failure remove what was built and raise NetnsError."""
        if self.tag in _open_tags:
            raise NetnsError(f"this process already has a network ({self.tag}); close it first")
        _open_tags.add(self.tag)
        self._opened = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        subnet = self._subnet or pick_subnet(_used_networks())
        addresses = list(subnet.hosts())
        self.gateway = str(addresses[0])
        prefixlen = subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _ip("addr", "add", f"{self.gateway}/{prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names, start=1):
            host = Host(
                name=name,
                netns=f"{self.tag}-{name}",
                address=str(addresses[i]),
                veth=f"{self.tag}v{i}",
            )
            _ip("netns", "add", host.netns)
            self._made_netns.append(host.netns)
            inner = f"{self.tag}p{i}"
            _ip(
                "link", "add", host.veth, "type", "veth", "peer", "name", inner, "netns", host.netns
            )
            self._made_links.append(host.veth)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "link", "set", inner, "name", "eth0")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{prefixlen}", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            self.hosts[name] = host

    # ------------------------------------------------------------------ using

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r} (hosts: {', '.join(self.hosts)})") from None

    def address(self, name: str) -> str:
        """The host's IPv4 address (reachable from every host and from the test)."""
        return self.host(name).address

    def launcher(self, name: str) -> tuple[str, ...]:
        """The command prefix that runs a program inside the host."""
        return (ip_binary() or "ip", "netns", "exec", self.host(name).netns)

    def cut(self, name: str) -> None:
        """Disconnect the host: its veth's bridge side goes down, so packets to and from
        it are dropped silently (its processes keep running and see no error)."""
        _ip("link", "set", "dev", self.host(name).veth, "down")
        self._cut.add(name)

    def restore(self, name: str) -> None:
        """Reconnect a host that `cut` disconnected."""
        _ip("link", "set", "dev", self.host(name).veth, "up")
        self._cut.discard(name)

    def is_cut(self, name: str) -> bool:
        return name in self._cut

    def pids(self, name: str) -> list[int]:
        """Processes running inside the host's namespace."""
        listing = _ip("netns", "pids", self.host(name).netns, check=False)
        return [int(word) for word in listing.stdout.split() if word.isdigit()]

    # ------------------------------------------------------------------ removing

    def close(self) -> None:
        """Kill what still runs in the namespaces (SIGKILL: the test's own teardown had
        its chance to stop them gently), then remove namespaces, veths and the bridge.
        Idempotent; errors removing one thing do not stop the removal of the others."""
        for netns in self._made_netns:
            listing = _ip("netns", "pids", netns, check=False)
            for word in listing.stdout.split():
                if word.isdigit() and int(word) != os.getpid():
                    try:
                        os.kill(int(word), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for netns in reversed(self._made_netns):
            _ip("netns", "del", netns, check=False)
        # A namespace's veth goes with it only once no process holds the namespace:
        # delete the root sides explicitly (that removes both ends).
        for link in reversed(self._made_links):
            _ip("link", "del", link, check=False)
        self._made_netns.clear()
        self._made_links.clear()
        self._cut.clear()
        self.hosts = {}
        if self._opened:
            _open_tags.discard(self.tag)
            self._opened = False

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist (empty after `close`)."""
        mine = [n for n in _netns_names() if n.startswith(f"{self.tag}-")]
        listing = _ip("-j", "link", "show", check=False)
        links = json.loads(listing.stdout or "[]") if listing.returncode == 0 else []
        names = [str(link.get("ifname", "")) for link in links]
        return mine + [n for n in names if n == self.bridge or n.startswith(f"{self.tag}v")]

    def __enter__(self) -> HostNetwork:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
