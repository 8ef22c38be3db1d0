"""Command line of `python -m dynamo.vllm`: vLLM's own engine flags plus the worker's, resolved
into one `VllmWorkerConfig` (see `--help` and docs/speculative_decoding.md).

`parse_worker_args` runs the steps in order, each in its own module:

* `config.parser`: the parser (vLLM's AsyncEngineArgs flags plus the DynamoWorker group);
* `config.layers`: engine keys merged as vLLM defaults < `--extra-engine-args` file <
  explicit command-line flags, each with its source;
* `model_resolution`: `--model` (or a speculators checkpoint's verifier) as a local directory,
  and the served model name;
* `config.speculative_resolution`: speculators checkpoint < `--extra-engine-args` <
  `--speculative-config` < `--spec-method/--spec-model/--spec-tokens` <
  `--speculation-profile` (the schedule only), engine-level flags applying to target and
  draft;
* `kv_defaults`: KV events, KV transfer and CPU block-size rules;
* `config.report` (used by `main`, which prints what this module resolved): the resolved
  configuration as log lines or `--dry-run` YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs

from dynamo.llm.speculation_profile import SpeculationProfile
from dynamo.llm.worker import DEFAULT_DRAIN_TIMEOUT_S
from dynamo.llm.worker.addresses import advertise_host_or_env
from dynamo.llm.worker.inflight import max_inflight_or_env
from dynamo.llm.worker.roles import (
    DisaggregationMode,
    component_for,
    disaggregation_mode_of,
    migration_limit_for,
)
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.lease_ttl import default_lease_ttl
from dynamo.runtime.nats_address import DEFAULT_NATS_URL, ENV_NATS_SERVER
from dynamo.runtime.nats_options import NatsConnectOptions, nats_options_from_args
from dynamo.vllm.config.kv_defaults import (
    check_block_size,
    configure_kv_events,
    configure_kv_transfer,
    nixl_side_channel_env,
)
from dynamo.vllm.config.layers import collect_layers, merge_engine_values
from dynamo.vllm.config.model_resolution import resolve_target, served_name
from dynamo.vllm.config.parser import (
    build_parser,
    explicit_values,
    system_host_or_env,
    system_port_or_env,
)
from dynamo.vllm.config.sampling_defaults import check_generation_config
from dynamo.vllm.config.speculative_resolution import (
    configure_adaptation,
    load_speculation_profile,
    resolve_speculative,
)

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "ConfigError",
    "VllmWorkerConfig",
    "build_parser",
    "parse_worker_args",
]

log = logging.getLogger("dynamo.vllm")


@dataclasses.dataclass
class VllmWorkerConfig:
    """Everything `main` needs to start one vLLM worker; built only by `parse_worker_args`."""

    engine_args: AsyncEngineArgs
    disaggregation_mode: DisaggregationMode
    namespace: str
    component: str
    endpoint: str
    served_model_name: str
    model_path: Path
    """Local directory of the target model (tokenizer files for the model card)."""
    nats_server: str
    lease_ttl: float
    nats_options: NatsConnectOptions
    """Credentials and TLS of the NATS connection (flags over NATS_* variables)."""
    system_port: int | None
    """Metrics/health HTTP port; None disables the server, 0 picks a free port."""
    advertise_host: str
    """The address peers on other hosts reach this worker at (`--advertise-host`): in its
    instance record and model card, and the NIXL side-channel host unless set."""
    system_host: str
    """Address the metrics/health HTTP server binds to (`--system-host`)."""
    kv_events_port: int | None
    """TCP port of vLLM's KV-event publisher (`tcp://*:<port>`: the worker's relay dials
    127.0.0.1, consumers on other hosts `advertise_host`), set only by --kv-events-port or
    a `tcp://` endpoint in --kv-events-config.
    None otherwise: by default events go over a private Unix socket
    (`ipc://$TMPDIR/dynamo-kv-*-events.sock`, see `kv_events_endpoint`), or they are off."""
    migration_limit: int
    dry_run: bool
    engine_env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Variables the worker sets in its environment before the engine starts (vLLM and
    its engine core read them): `VLLM_NIXL_SIDE_CHANNEL_HOST` with a NIXL connector."""
    max_inflight_requests: int | None = None
    """Bound on requests accepted at once (0: none; None: 4 x max_num_seqs)."""
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    extra_engine_args: Path | None = None
    speculators_checkpoint: Path | None = None
    """The speculators checkpoint given as --model, now the draft `model`."""
    speculation_profile: SpeculationProfile | None = None
    """--speculation-profile, kept for the worker's drift monitor (the schedule is already
    in `speculative_config`)."""
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    """Engine key (and `speculative_config.<key>`) -> where its value came from."""
    ignored_keys: list[str] = dataclasses.field(default_factory=list)
    """--extra-engine-args keys vLLM has no meaning for."""

    @property
    def speculative_config(self) -> dict[str, Any] | None:
        return self.engine_args.speculative_config

    @property
    def kv_events_endpoint(self) -> str | None:
        """vLLM's publisher endpoint (bind form); None when events are off."""
        cfg = self.engine_args.kv_events_config
        return cfg.endpoint if cfg is not None and cfg.enable_kv_cache_events else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        cfg = self.engine_args.kv_events_config
        return cfg.replay_endpoint if cfg is not None and cfg.enable_kv_cache_events else None


def parse_worker_args(argv: Sequence[str] | None = None) -> VllmWorkerConfig:
    """Parse the command line (and the files it names) into a VllmWorkerConfig.

    Raises ConfigError for anything the worker must not start with.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    full = vars(parser.parse_args(argv))
    mode = disaggregation_mode_of(full)
    dry_run = bool(full["dry_run"])
    layers = collect_layers(parser, full, explicit_values(parser, argv))

    values, sources = merge_engine_values(layers)
    target_dir, checkpoint = resolve_target(values, sources, dry_run=dry_run)
    served = served_name(values, sources)
    check_generation_config(values.get("generation_config"))
    profile = load_speculation_profile(full["speculation_profile"])
    resolve_speculative(values, sources, layers, checkpoint, dry_run=dry_run, profile=profile)
    configure_adaptation(
        values,
        full["speculation_adapt"],
        full["speculation_profile"],
        window_steps=full["speculation_window"],
        warmup_drafts=full["speculation_warmup"],
    )
    check_block_size(values, sources)
    kv_events_port = configure_kv_events(values, sources, full["kv_events_port"])
    nats_server = full["nats_server"] or os.environ.get(ENV_NATS_SERVER) or DEFAULT_NATS_URL
    configure_kv_transfer(values, sources, mode, full["namespace"])
    if layers.file is not None and layers.file.ignored:
        log.warning(
            "--extra-engine-args %s: ignoring keys with no vLLM meaning: %s",
            full["extra_engine_args"],
            ", ".join(layers.file.ignored),
        )
    nats_options = nats_options_from_args(full, url=nats_server)
    advertise_host = advertise_host_or_env(full["advertise_host"])
    engine_args = AsyncEngineArgs.from_cli_args(argparse.Namespace(**values))
    return VllmWorkerConfig(
        engine_args=engine_args,
        disaggregation_mode=mode,
        namespace=full["namespace"],
        component=component_for(mode, full["component"]),
        endpoint=full["endpoint"],
        served_model_name=served,
        model_path=target_dir,
        nats_server=nats_server,
        nats_options=nats_options,
        lease_ttl=full["lease_ttl"] or default_lease_ttl(nats_options.replicas),
        system_port=system_port_or_env(full["system_port"]),
        advertise_host=advertise_host,
        system_host=system_host_or_env(full["system_host"]),
        engine_env=nixl_side_channel_env(engine_args.kv_transfer_config, advertise_host),
        kv_events_port=kv_events_port,
        migration_limit=migration_limit_for(mode, full["migration_limit"]),
        dry_run=dry_run,
        drain_timeout_s=full["drain_timeout"],
        max_inflight_requests=max_inflight_or_env(full["max_inflight_requests"]),
        extra_engine_args=Path(full["extra_engine_args"]) if full["extra_engine_args"] else None,
        speculators_checkpoint=checkpoint.path if checkpoint else None,
        speculation_profile=profile,
        sources=sources,
        ignored_keys=list(layers.file.ignored) if layers.file else [],
    )
