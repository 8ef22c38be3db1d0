"""Renders a resolved `VllmWorkerConfig` for people: start-up log lines or the `--dry-run` YAML.

Both show each engine key that differs from vLLM's default with the source it came from, so
a surprising value can be traced to the flag or file that set it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import yaml
from vllm.engine.arg_utils import AsyncEngineArgs

from dynamo.runtime.nats_options import redact_url
from dynamo.vllm.config.kv_defaults import nixl_side_channel
from dynamo.vllm.config.layers import SRC_VLLM, SRC_WORKER

if TYPE_CHECKING:  # args.py imports this module: the config class is only a type here
    from dynamo.vllm.config.args import VllmWorkerConfig


def _worker_summary(cfg: VllmWorkerConfig) -> dict[str, Any]:
    return {
        "disaggregation_mode": cfg.disaggregation_mode,
        "namespace": cfg.namespace,
        "component": cfg.component,
        "endpoint": cfg.endpoint,
        "served_model_name": cfg.served_model_name,
        "model_path": str(cfg.model_path),
        "speculators_checkpoint": str(cfg.speculators_checkpoint)
        if cfg.speculators_checkpoint
        else None,
        "nats_server": redact_url(cfg.nats_server),
        "nats_security": cfg.nats_options.describe(cfg.nats_server),
        "lease_ttl": cfg.lease_ttl,
        "advertise_host": cfg.advertise_host,
        "system_host": cfg.system_host,
        "system_port": cfg.system_port,
        "kv_events_port": cfg.kv_events_port,
        "nixl_side_channel": nixl_side_channel(cfg.engine_args.kv_transfer_config, cfg.engine_env),
        "engine_env": dict(cfg.engine_env) or None,
        "migration_limit": cfg.migration_limit,
        "max_inflight_requests": "auto (4 x max_num_seqs)"
        if cfg.max_inflight_requests is None
        else cfg.max_inflight_requests,
        "extra_engine_args": str(cfg.extra_engine_args) if cfg.extra_engine_args else None,
    }


def non_default_engine_values(cfg: VllmWorkerConfig) -> dict[str, Any]:
    """AsyncEngineArgs fields not left at vLLM's default (per the recorded sources), as plain
    data in vLLM's field order. Tracking sources beats comparing values: a flag given
    explicitly shows even when it equals the default, and nothing depends on `__eq__`."""
    changed = {}
    for f in dataclasses.fields(AsyncEngineArgs):
        if f.name == "speculative_config":
            if cfg.engine_args.speculative_config is not None:
                changed[f.name] = plain(cfg.engine_args.speculative_config)
        elif cfg.sources.get(f.name, SRC_VLLM) != SRC_VLLM:
            changed[f.name] = plain(getattr(cfg.engine_args, f.name))
    return changed


def plain(value: Any) -> Any:
    """`value` as YAML/JSON-safe data (vLLM config objects become mappings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def resolved_config_lines(cfg: VllmWorkerConfig) -> list[str]:
    """One line per worker setting and per engine key that differs from vLLM's default,
    each with its source; `speculative_config` gets a line per key."""
    lines = [
        f"worker.{key} = {value}"
        for key, value in _worker_summary(cfg).items()
        if value is not None
    ]
    for key, value in non_default_engine_values(cfg).items():
        if key == "speculative_config" and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                source = cfg.sources.get(f"speculative_config.{sub_key}", "?")
                lines.append(
                    f"engine.speculative_config.{sub_key} = {json.dumps(sub_value)}  [{source}]"
                )
            continue
        lines.append(f"engine.{key} = {json.dumps(value)}  [{cfg.sources.get(key, SRC_WORKER)}]")
    if cfg.ignored_keys:
        lines.append(f"ignored --extra-engine-args keys = {', '.join(cfg.ignored_keys)}")
    return lines


def resolved_config_yaml(cfg: VllmWorkerConfig) -> str:
    """The resolved configuration as YAML: `worker`, `engine` (non-default AsyncEngineArgs
    fields), `sources` (where each engine key came from) and `ignored_keys`."""
    engine = non_default_engine_values(cfg)
    sources = {
        key: source
        for key, source in cfg.sources.items()
        if key in engine
        or (key.startswith("speculative_config.") and "speculative_config" in engine)
    }
    document: dict[str, Any] = {
        "worker": _worker_summary(cfg),
        "engine": engine,
        "sources": sources,
    }
    if cfg.ignored_keys:
        document["ignored_keys"] = list(cfg.ignored_keys)
    header = "# python -m dynamo.vllm --dry-run: resolved configuration (nothing was loaded)\n"
    return header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
