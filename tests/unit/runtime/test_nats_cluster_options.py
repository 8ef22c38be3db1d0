"""How a process is pointed at a NATS cluster: the server list, `--nats-replicas`, the
lease that outlives a JetStream failover, and the cluster the development server starts.
Pure parsing and configuration: the cluster itself is exercised in
tests/integration/test_nats_cluster.py."""

from __future__ import annotations

import argparse

import pytest
from nats.aio.client import Client as NatsClient

from dynamo.frontend.__main__ import build_parser as frontend_parser
from dynamo.mocker.args import build_parser as mocker_parser
from dynamo.nats_server import NatsCluster
from dynamo.nats_server.cli import build_parser
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.kv import registry_config
from dynamo.runtime.lease_ttl import (
    CLUSTER_LEASE_TTL_S,
    DEFAULT_LEASE_TTL_S,
    ENV_LEASE_TTL,
    default_lease_ttl,
)
from dynamo.runtime.leases import LeaseKeeper
from dynamo.runtime.nats_address import is_reachable
from dynamo.runtime.nats_options import (
    ENV_NATS_REPLICAS,
    NatsConnectOptions,
    add_nats_arguments,
    nats_options_from_args,
    split_urls,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_NATS_REPLICAS, raising=False)
    monkeypatch.delenv(ENV_LEASE_TTL, raising=False)


def replicas(*argv: str, env: dict[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    add_nats_arguments(parser)
    return nats_options_from_args(parser.parse_args(list(argv)), env or {}).replicas


def test_replicas_default_to_one_and_come_from_the_flag_or_the_variable() -> None:
    assert replicas() == 1
    assert replicas(env={ENV_NATS_REPLICAS: "3"}) == 3
    assert replicas("--nats-replicas", "3", env={ENV_NATS_REPLICAS: "5"}) == 3


@pytest.mark.parametrize("bad", ["0", "6", "three", "-1", "2.5"])
def test_a_replica_count_jetstream_cannot_have_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"--nats-replicas: .*1 to 5.*" + bad):
        replicas("--nats-replicas", bad)
    with pytest.raises(ConfigError, match=r"\$DYN_NATS_REPLICAS"):
        replicas(env={ENV_NATS_REPLICAS: bad})


@pytest.mark.parametrize("parser", [frontend_parser, mocker_parser], ids=["frontend", "mocker"])
def test_every_component_offers_the_flag(parser: object) -> None:
    text = parser().format_help()  # type: ignore[operator]
    assert "--nats-replicas" in text


def test_buckets_carry_the_replica_count() -> None:
    assert registry_config("dyn_x", 3).replicas == 3
    assert NatsConnectOptions(replicas=3).replicas == 3


def test_a_url_list_is_split_and_blanks_dropped() -> None:
    urls = " nats://a:4222, nats://b:4222,,nats://c:4222 "
    assert split_urls(urls) == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]


def test_a_list_is_reachable_when_any_server_is() -> None:
    # Nothing listens on port 1; the probe moves on to the next server of the list.
    assert not is_reachable("nats://127.0.0.1:1,nats://127.0.0.1:2", timeout=0.1)


def test_a_cluster_lease_outlives_a_jetstream_leader_election() -> None:
    """nats-server elects a new stream leader 4 to 9 s after losing one; a key put at
    most one heartbeat before the loss must not expire before it can be put again."""
    assert default_lease_ttl() == DEFAULT_LEASE_TTL_S
    assert default_lease_ttl(replicas=3) == CLUSTER_LEASE_TTL_S
    keeper = LeaseKeeper(NatsClient(), CLUSTER_LEASE_TTL_S)  # never connected
    worst_election_s, retry_and_put_s = 9.0, 0.5 + 2.0
    assert CLUSTER_LEASE_TTL_S - keeper.interval_s > worst_election_s + retry_and_put_s


def test_an_explicit_lease_wins_on_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_LEASE_TTL, "7")
    assert default_lease_ttl(replicas=3) == 7.0


def test_the_cluster_nodes_route_to_each_other_with_unique_names() -> None:
    cluster = NatsCluster(3, ports=[14222, 14223, 14224], name="dev")
    try:
        names = [node.cluster.server_name for node in cluster.nodes if node.cluster]
        assert names == ["n1", "n2", "n3"]
        assert cluster.url == "nats://127.0.0.1:14222,nats://127.0.0.1:14223,nats://127.0.0.1:14224"
        for node in cluster.nodes:
            assert node.cluster is not None
            own = f"nats-route://127.0.0.1:{node.cluster.route_port}"
            assert own not in node.cluster.routes and len(node.cluster.routes) == 2
            argv = node.cluster.argv()
            assert argv[argv.index("--cluster_name") + 1] == "dev"
    finally:
        cluster.close()


def test_the_cluster_needs_one_port_per_node() -> None:
    with pytest.raises(ValueError, match="3 nodes need 3 client ports"):
        NatsCluster(3, ports=[14222])


def test_the_development_server_offers_a_cluster() -> None:
    args = build_parser().parse_args(["--cluster-size", "3", "--port", "4222"])
    assert args.cluster_size == 3
    assert "--cluster-size" in build_parser().format_help()
