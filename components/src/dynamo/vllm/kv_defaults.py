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

from dynamo.runtime.cli import ConfigError
from dynamo.runtime.nats_server import free_port
from dynamo.vllm.config_layers import SRC_VLLM, SRC_WORKER

log = logging.getLogger("dynamo.vllm")

CPU_BLOCK_MULTIPLE = 32
KV_SHARED_STORAGE_ENV = "DYN_KV_SHARED_STORAGE_PATH"


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
        return _tcp_port_of(given)
    if values.get("enable_prefix_caching") is False:
        if port is not None:
            log.warning(
                "--kv-events-port ignored: prefix caching is off, so there are no KV events"
            )
        return None
    if port is not None:
        # TCP on request (another host consumes the events); vLLM binds only `tcp://*`.
        endpoint = f"tcp://*:{port}"
        replay = f"tcp://127.0.0.1:{free_port()}"
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
    present; on CPU vLLM's ExampleConnector over a directory that prefill and decode share
    (one host, or a shared filesystem) — the connector verified on these machines.

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
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": path},
        )
    sources["kv_transfer_config"] = SRC_WORKER
