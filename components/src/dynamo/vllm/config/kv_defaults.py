"""The worker's own rules for KV-cache settings: events for the KV router, a connector for
disaggregated workers, a block size CPU attention accepts."""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.config import KVEventsConfig, KVTransferConfig

from dynamo.llm.kv_router.zmq_relay import publisher_binds
from dynamo.llm.worker.addresses import is_local_host
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.ports import free_port
from dynamo.vllm.config.layers import SRC_VLLM, SRC_WORKER
from dynamo.vllm.kv_transfer.janitor import DISK_CONNECTOR, DISK_CONNECTOR_MODULE

log = logging.getLogger("dynamo.vllm")

CPU_BLOCK_MULTIPLE = 32
KV_SHARED_STORAGE_ENV = "DYN_KV_SHARED_STORAGE_PATH"
NIXL_SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
NIXL_SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_SIDE_CHANNEL_DEFAULT_PORT = 5600
"""vLLM's defaults (vllm/envs.py): host `localhost`, port 5600. The prefill worker's
NixlConnector announces host:port in its transfer parameters and the decode worker dials
it, so `localhost` only works when both run on one host."""


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _gpu_present() -> bool:
    """True when vLLM runs on a CUDA device in this installation."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:
        return False


def check_block_size(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """CPU attention needs blocks of a multiple of 32 tokens; vLLM only warns, then fails
    or runs slowly later, so a user-given size that is not is refused up front."""
    block = values.get("block_size")
    if block is None or sources.get("block_size") == SRC_VLLM or not _on_cpu():
        return
    if block % CPU_BLOCK_MULTIPLE:
        raise ConfigError(
            f"--block-size {block} ({sources.get('block_size')}): on CPU the block size must be a "
            f"multiple of {CPU_BLOCK_MULTIPLE}"
        )


def configure_kv_events(
    values: dict[str, Any], sources: dict[str, str], port: int | None
) -> int | None:
    """Turn on vLLM's ZMQ KV-event publisher for the KV router, unless the user configured
    events themselves or switched prefix caching (and so events) off. Returns the TCP port
    events are published on, None for the default Unix socket (or no events)."""
    given: KVEventsConfig | None = values.get("kv_events_config")
    if sources.get("kv_events_config", SRC_VLLM) != SRC_VLLM and given is not None:
        if port is not None:
            raise ConfigError("give either --kv-events-port or --kv-events-config, not both")
        _check_events_endpoint(given)
        return _tcp_port_of(given)
    if values.get("enable_prefix_caching") is False:
        if port is not None:
            log.warning(
                "--kv-events-port ignored: prefix caching is off, so there are no KV events"
            )
        return None
    if port is not None:
        # TCP on request (another host consumes the events): vLLM binds `tcp://*` for
        # both, so a remote consumer can also ask the replay socket for what it missed.
        endpoint = f"tcp://*:{port}"
        replay = f"tcp://*:{free_port()}"
    else:
        # Default: Unix sockets private to this host. Nothing to race for (a TCP port picked
        # now would only be bound ~30 s later, when the engine starts) and nothing exposed
        # on the network.
        base = Path(tempfile.gettempdir()) / f"dynamo-kv-{os.getpid()}-{secrets.token_hex(4)}"
        endpoint, replay = f"ipc://{base}-events.sock", f"ipc://{base}-replay.sock"
    values["kv_events_config"] = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        replay_endpoint=replay,
    )
    sources["kv_events_config"] = SRC_WORKER
    return port


def _check_events_endpoint(cfg: KVEventsConfig) -> None:
    """Refuse a user's events endpoint the worker's own relay could never receive from.

    vLLM binds wildcard, IPv6 and ipc endpoints but *connects* its publisher to a named
    `tcp://host:port`; the relay then binds there (`publishers.relay_kv_events`), which
    only works when that host is this one. Naming another host would leave the KV router
    without this worker's events, silently."""
    if not cfg.enable_kv_cache_events:
        return
    endpoint = str(cfg.endpoint)
    if publisher_binds(endpoint) or not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    if not is_local_host(host):
        raise ConfigError(
            f"--kv-events-config endpoint {endpoint}: vLLM connects its publisher to a named "
            f"host, so the worker's relay would have to listen on {host}, which is not this "
            "host. To publish events for consumers on other hosts bind all interfaces "
            "(`tcp://*:PORT`, or --kv-events-port PORT) and let them connect to this "
            "worker's --advertise-host"
        )


def _tcp_port_of(cfg: KVEventsConfig) -> int | None:
    """The port of a user's `tcp://host:port` events endpoint; None for other transports."""
    if not cfg.enable_kv_cache_events:
        return None
    endpoint = str(cfg.endpoint)
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if endpoint.startswith("tcp://") and tail.isdigit() else None


def configure_kv_transfer(
    values: dict[str, Any], sources: dict[str, str], mode: str, namespace: str
) -> None:
    """Disaggregated workers need a KV connector. Where none is given: NIXL where a GPU is
    present; on CPU `DiskKvConnector` (vLLM's ExampleConnector, made to survive entries
    that vanish before they load, see dynamo.vllm.kv_transfer.disk_connector) over a directory that
    prefill and decode share (one host, or a shared filesystem).

    An explicit config without a connector (e.g. `--kv-transfer-config '{}'`) on a
    prefill/decode worker is refused: such a worker could never hand its KV over."""
    if mode == "agg":
        return
    given: KVTransferConfig | None = values.get("kv_transfer_config")
    if given is not None:
        if not given.kv_connector:
            raise ConfigError(
                f"--kv-transfer-config: a {mode} worker needs a KV connector "
                "(`kv_connector`), e.g. ExampleConnector on CPU or NixlConnector on GPU; "
                "leave the flag out to get the default"
            )
        return
    if _gpu_present():
        values["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        )
    else:
        path = os.environ.get(KV_SHARED_STORAGE_ENV) or f"/tmp/dynamo-kv-{namespace}"
        values["kv_transfer_config"] = KVTransferConfig(
            kv_connector=DISK_CONNECTOR,
            kv_connector_module_path=DISK_CONNECTOR_MODULE,
            # A decode worker only reads what prefill workers wrote.
            kv_role="kv_consumer" if mode == "decode" else "kv_both",
            kv_connector_extra_config={"shared_storage_path": path},
            # An entry that vanished or broke between scheduling and loading: recompute.
            kv_load_failure_policy="recompute",
        )
    sources["kv_transfer_config"] = SRC_WORKER


def uses_nixl(kv_transfer_config: KVTransferConfig | None) -> bool:
    """Whether the engine's KV connector is (or, for a MultiConnector, includes) NIXL."""
    if kv_transfer_config is None:
        return False
    if "Nixl" in str(kv_transfer_config.kv_connector or ""):
        return True
    extra = kv_transfer_config.kv_connector_extra_config or {}
    return any("Nixl" in str(c.get("kv_connector", "")) for c in extra.get("connectors", []))


def nixl_side_channel_env(
    kv_transfer_config: KVTransferConfig | None,
    advertise_host: str,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Variables to set before the engine starts so that a decode worker on another host
    can reach this worker's NIXL side channel: `VLLM_NIXL_SIDE_CHANNEL_HOST` becomes the
    advertised host (vLLM's default, `localhost`, only works on one host). Empty when the
    connector is not NIXL or the user set the variable themselves."""
    environ = os.environ if environ is None else environ
    if not uses_nixl(kv_transfer_config) or environ.get(NIXL_SIDE_CHANNEL_HOST_ENV):
        return {}
    return {NIXL_SIDE_CHANNEL_HOST_ENV: advertise_host}


def nixl_side_channel(
    kv_transfer_config: KVTransferConfig | None, env: Mapping[str, str]
) -> str | None:
    """`host:port` the NIXL side channel announces (None without NIXL), from `env` (what
    the worker sets) over the process environment, for `--dry-run` and the start-up log."""
    if not uses_nixl(kv_transfer_config):
        return None
    host = env.get(NIXL_SIDE_CHANNEL_HOST_ENV) or os.environ.get(
        NIXL_SIDE_CHANNEL_HOST_ENV, "localhost"
    )
    port = os.environ.get(NIXL_SIDE_CHANNEL_PORT_ENV) or NIXL_SIDE_CHANNEL_DEFAULT_PORT
    return f"{host}:{port}"


def advertised_kv_event_addresses(
    endpoint: str | None, replay_endpoint: str | None, advertise_host: str
) -> dict[str, str]:
    """The KV-event sockets peers on other hosts can dial, for the instance record:
    `kv_events` / `kv_events_replay` as `tcp://<advertise host>:<port>`, for endpoints
    bound on every interface (`tcp://*:PORT`). Unix sockets and loopback binds are
    private to this host and not advertised."""
    wildcard = ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:")
    named = {"kv_events": endpoint, "kv_events_replay": replay_endpoint}
    host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
    return {
        name: f"tcp://{host}:{value.rpartition(':')[2]}"
        for name, value in named.items()
        if value and value.startswith(wildcard)
    }
