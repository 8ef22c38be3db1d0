"""Every address a vLLM worker binds or advertises, for workers on different hosts.

Claims:
* the advertised host is `--advertise-host`, else `$DYN_ADVERTISE_HOST`, else this host's
  primary non-loopback address, else 127.0.0.1; it is on the instance records (metadata
  `host`), the model card and in `--dry-run`;
* with a NIXL connector the worker sets `VLLM_NIXL_SIDE_CHANNEL_HOST` to it before the
  engine starts (vLLM's default, `localhost`, cannot be reached from another host), unless
  the user set the variable; other connectors leave the environment alone;
* the system server binds `--system-host` / `$DYN_SYSTEM_HOST`, by default every interface;
* KV events on `--kv-events-port` (events and replay bound on every interface) are
  advertised as `tcp://<advertise host>:PORT`; Unix sockets are not;
* a `--kv-events-config` endpoint naming another host is refused (vLLM would connect its
  publisher there and the worker's relay could never receive the events); one naming
  this host is accepted and the relay listens on it (tests/unit/kv_router);
* `--help` explains the new flags.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import msgspec
import pytest
from vllm.config import KVTransferConfig

from dynamo.llm.protocols import ModelCard
from dynamo.llm.worker import WorkerRegistration, addresses
from dynamo.llm.worker.addresses import (
    ADVERTISE_HOST_ENV,
    advertise_host_or_env,
    default_advertise_host,
    is_local_host,
)
from dynamo.llm.worker.served import instance_metadata
from dynamo.runtime.wire import InstanceInfo, decode_instance, encode_instance
from dynamo.vllm.config.args import ConfigError, build_parser
from dynamo.vllm.config.kv_defaults import (
    NIXL_SIDE_CHANNEL_HOST_ENV,
    advertised_kv_event_addresses,
    nixl_side_channel_env,
)
from dynamo.vllm.config.report import resolved_config_yaml

NIXL = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
TEST_NET = "203.0.113.77"  # RFC 5737 documentation range: not an address of this machine


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "NATS_SERVER",
        "DYN_SYSTEM_PORT",
        "DYN_SYSTEM_HOST",
        ADVERTISE_HOST_ENV,
        NIXL_SIDE_CHANNEL_HOST_ENV,
        "DYN_KV_SHARED_STORAGE_PATH",
    ):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------ advertised host


def test_the_default_is_a_non_loopback_address_or_loopback() -> None:
    host = default_advertise_host()
    assert host == "127.0.0.1" or not host.startswith("127.")
    assert is_local_host(host), "the default names this machine"


def test_the_default_falls_back_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addresses, "_route_address", lambda: None)
    monkeypatch.setattr(addresses, "_hostname_address", lambda: "10.1.2.3")
    assert default_advertise_host() == "10.1.2.3"
    monkeypatch.setattr(addresses, "_hostname_address", lambda: None)
    assert default_advertise_host() == "127.0.0.1"


def test_flag_over_env_over_default(monkeypatch: pytest.MonkeyPatch, parse) -> None:
    monkeypatch.setattr(addresses, "_route_address", lambda: "10.9.9.9")
    assert advertise_host_or_env(None) == "10.9.9.9"
    assert parse().advertise_host == "10.9.9.9"
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "worker-7.example")
    assert parse().advertise_host == "worker-7.example"
    assert parse("--advertise-host", "10.0.0.5").advertise_host == "10.0.0.5"
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "  ")
    assert advertise_host_or_env(None) == "10.9.9.9", "a blank variable is unset"


def test_local_hosts() -> None:
    for host in ("127.0.0.1", "localhost", "*", "0.0.0.0", "::1", "[::1]"):
        assert is_local_host(host), host
    assert not is_local_host(TEST_NET)
    assert not is_local_host("no-such-host.invalid")


def test_the_host_is_on_the_instance_records_and_the_card() -> None:
    reg = WorkerRegistration(
        served_model_name="m",
        model_path=Path("/m"),
        advertise_host="10.0.0.5",
        advertised_addresses={"kv_events": "tcp://10.0.0.5:5557"},
    )
    assert instance_metadata(reg) == {"kv_events": "tcp://10.0.0.5:5557"}
    assert instance_metadata(WorkerRegistration(served_model_name="m", model_path=Path())) == {}
    assert "host" in {f for f in ModelCard.__struct_fields__}
    # The host itself is a typed field of the instance record, empty from older peers.
    info = InstanceInfo("ns", "backend", "generate", 1, "dyn.x", address="10.0.0.5")
    assert decode_instance(encode_instance(info)).address == "10.0.0.5"
    older = msgspec.msgpack.encode(
        {
            "namespace": "ns",
            "component": "backend",
            "endpoint": "generate",
            "instance_id": 1,
            "subject": "s",
        }
    )
    assert decode_instance(older).address == ""


# ------------------------------------------------------------------------ NIXL side channel


def test_nixl_side_channel_host_follows_the_advertised_host() -> None:
    nixl = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    assert nixl_side_channel_env(nixl, "10.0.0.5", {}) == {NIXL_SIDE_CHANNEL_HOST_ENV: "10.0.0.5"}
    assert nixl_side_channel_env(nixl, "10.0.0.5", {NIXL_SIDE_CHANNEL_HOST_ENV: "10.1.1.1"}) == {}
    example = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": "/kv"},
    )
    assert nixl_side_channel_env(example, "10.0.0.5", {}) == {}
    assert nixl_side_channel_env(None, "10.0.0.5", {}) == {}
    multi = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector"}]},
    )
    assert nixl_side_channel_env(multi, "h", {}) == {NIXL_SIDE_CHANNEL_HOST_ENV: "h"}


def test_a_nixl_worker_sets_the_side_channel_before_its_engine_starts(
    parse, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo.vllm.main import build_process

    cfg = parse("--is-prefill-worker", "--kv-transfer-config", NIXL, "--advertise-host", "10.0.0.5")
    assert cfg.engine_env == {NIXL_SIDE_CHANNEL_HOST_ENV: "10.0.0.5"}
    document = resolved_config_yaml(cfg)
    assert "advertise_host: 10.0.0.5" in document
    assert "nixl_side_channel: 10.0.0.5:5600" in document
    monkeypatch.setenv(NIXL_SIDE_CHANNEL_HOST_ENV, "placeholder")  # restored after the test
    monkeypatch.delenv(NIXL_SIDE_CHANNEL_HOST_ENV)
    process = build_process(cfg)
    assert os.environ[NIXL_SIDE_CHANNEL_HOST_ENV] == "10.0.0.5"
    (worker,) = process.workers
    assert worker.registration.advertise_host == "10.0.0.5"

    monkeypatch.setenv(NIXL_SIDE_CHANNEL_HOST_ENV, "10.1.1.1")
    cfg = parse("--is-prefill-worker", "--kv-transfer-config", NIXL)
    assert cfg.engine_env == {}, "the user's own setting wins"
    assert "nixl_side_channel: 10.1.1.1:5600" in resolved_config_yaml(cfg)


def test_an_example_connector_worker_sets_nothing(parse) -> None:
    cfg = parse("--is-decode-worker")
    assert cfg.engine_env == {}
    assert "nixl_side_channel: null" in resolved_config_yaml(cfg)


# ------------------------------------------------------------------------ system server


def test_system_host(parse, monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo.vllm.main import build_process

    assert parse().system_host == "0.0.0.0"
    monkeypatch.setenv("DYN_SYSTEM_HOST", "127.0.0.1")
    assert parse().system_host == "127.0.0.1"
    cfg = parse("--system-host", "10.0.0.5")
    assert cfg.system_host == "10.0.0.5"
    assert "system_host: 10.0.0.5" in resolved_config_yaml(cfg)
    assert build_process(cfg).system_host == "10.0.0.5"


# ------------------------------------------------------------------------ KV events


def test_tcp_kv_events_are_advertised_at_the_advertised_host(parse) -> None:
    cfg = parse("--kv-events-port", "25557", "--advertise-host", "10.0.0.5")
    assert cfg.kv_events_endpoint == "tcp://*:25557"
    assert cfg.kv_events_replay_endpoint is not None
    replay_port = cfg.kv_events_replay_endpoint.rpartition(":")[2]
    assert advertised_kv_event_addresses(
        cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.advertise_host
    ) == {
        "kv_events": "tcp://10.0.0.5:25557",
        "kv_events_replay": f"tcp://10.0.0.5:{replay_port}",
    }
    assert advertised_kv_event_addresses("tcp://*:1", None, "fe80::1") == {
        "kv_events": "tcp://[fe80::1]:1"
    }


def test_unix_socket_events_are_not_advertised(parse) -> None:
    cfg = parse()
    assert cfg.kv_events_endpoint is not None and cfg.kv_events_endpoint.startswith("ipc://")
    assert (
        advertised_kv_event_addresses(
            cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, "10.0.0.5"
        )
        == {}
    )
    assert advertised_kv_event_addresses("tcp://127.0.0.1:5557", None, "10.0.0.5") == {}


def test_an_events_endpoint_on_another_host_is_refused(parse) -> None:
    remote = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{TEST_NET}:5557",
    }
    with pytest.raises(ConfigError, match=f"{TEST_NET}.*not this host.*tcp://\\*:PORT"):
        parse("--kv-events-config", json.dumps(remote))
    local = {**remote, "endpoint": "tcp://127.0.0.1:5557"}
    assert parse("--kv-events-config", json.dumps(local)).kv_events_endpoint == local["endpoint"]
    own_ip = default_advertise_host()
    named = {**remote, "endpoint": f"tcp://{own_ip}:5557"}
    assert parse("--kv-events-config", json.dumps(named)).kv_events_port == 5557


# ------------------------------------------------------------------------ help


def test_help_explains_the_address_flags() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--advertise-host HOST" in text
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in text and "$DYN_ADVERTISE_HOST" in text
    assert "--system-host" in text and "$DYN_SYSTEM_HOST" in text
    assert "--kv-events-port" in text and "advertise-host:PORT" in text


def test_hostname_is_not_what_is_advertised_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name may resolve to 127.0.1.1 (Debian) or nowhere else: never advertised."""
    monkeypatch.setattr(addresses, "_route_address", lambda: None)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 2, 17, "", ("127.0.1.1", 0))])
    assert default_advertise_host() == "127.0.0.1"
