"""`dynamo.testing.netns` without root: the choices made before any `ip` command runs.

Claims: the test subnet overlaps no route of the machine, however the routes lie (one
of the same /24, a wider one covering it, the whole 10/8), and is looked for from a
pid-derived start so that two runs at once try different subnets first; names that
cannot work (none, repeated) are refused before anything is built; and `available()`
names a missing `ip` as the reason instead of failing.
"""

from __future__ import annotations

import ipaddress

import pytest

from dynamo.testing import netns
from dynamo.testing.netns import HostNetwork, NetnsError, pick_subnet


def net(text: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(text)


def test_the_subnet_avoids_every_route_that_overlaps_it() -> None:
    used = [net("10.100.0.0/24"), net("10.101.0.0/16"), net("10.96.0.0/13"), net("192.0.2.0/24")]
    chosen = pick_subnet(used, start=0)
    assert chosen == net("10.104.0.0/24")
    assert not any(chosen.overlaps(u) for u in used)


def test_the_search_starts_where_told_and_wraps_around() -> None:
    assert pick_subnet([], start=5) == net("10.105.0.0/24")
    used = [net(f"10.{n}.0.0/24") for n in range(250, 255)]
    assert pick_subnet(used, start=150) == net("10.100.0.0/24")


def test_no_free_subnet_is_an_error() -> None:
    with pytest.raises(NetnsError, match="no free"):
        pick_subnet([net("10.0.0.0/8")])


@pytest.mark.parametrize("hosts", [[], ["a", "b", "a"]])
def test_impossible_host_lists_are_refused_before_building(hosts: list[str]) -> None:
    with pytest.raises(ValueError):
        HostNetwork(hosts)


def test_without_ip_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "ip_binary", lambda: None)
    assert netns.available() == "iproute2's `ip` is not installed"
