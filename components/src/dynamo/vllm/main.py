"""`python -m dynamo.vllm`: a vLLM engine with speculative decoding served over NATS.

The command line becomes a `VllmWorkerConfig` (`args`); the engine glue is `VllmBackend`;
everything else a worker process does (system server first, so `/health` answers 503
while the engine loads; registration with the model card last; SIGTERM drain; exit codes
0 / 1 / 2) is `dynamo.llm.worker`'s, shared with the mocker.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import prometheus_client
import uvloop
from prometheus_client import REGISTRY

from dynamo.llm.worker import ServedWorker, WorkerProcess, WorkerRegistration
from dynamo.runtime.cli import configure_logging
from dynamo.runtime.gc_tuning import tune_for_serving
from dynamo.runtime.parent_death import (
    children_die_with_this_process,
    spawned_children_die_with_this_process,
)
from dynamo.vllm.config.args import ConfigError, VllmWorkerConfig, parse_worker_args
from dynamo.vllm.config.kv_defaults import advertised_kv_event_addresses
from dynamo.vllm.config.report import resolved_config_lines, resolved_config_yaml
from dynamo.vllm.serving.backend import VllmBackend
from dynamo.vllm.serving.metrics import VllmWorkerCollector

log = logging.getLogger("dynamo.vllm")


def build_process(cfg: VllmWorkerConfig) -> WorkerProcess:
    """One served vLLM worker in a process; nothing is loaded until `run()`.

    Sets `cfg.engine_env` in this process's environment first: vLLM reads those variables
    (the NIXL side-channel host) when the engine starts, and its engine core inherits them.
    """
    for name, value in cfg.engine_env.items():
        log.info("setting %s=%s for the engine", name, value)
        os.environ[name] = value
    backend = VllmBackend(cfg)
    registration = WorkerRegistration(
        served_model_name=cfg.served_model_name,
        model_path=Path(cfg.model_path),
        namespace=cfg.namespace,
        component=cfg.component,
        endpoint=cfg.endpoint,
        worker_type=backend.worker_type,
        nats_server=cfg.nats_server,
        nats_options=cfg.nats_options,
        lease_ttl=cfg.lease_ttl,
        drain_timeout_s=cfg.drain_timeout_s,
        migration_limit=cfg.migration_limit,
        max_inflight_requests=cfg.max_inflight_requests,
        publish_kv_events=cfg.kv_events_endpoint is not None,
        advertise_host=cfg.advertise_host,
        advertised_addresses=advertised_kv_event_addresses(
            cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.advertise_host
        ),
    )
    if cfg.system_port is not None:
        # vLLM's own series live in the process-global registry; ours join them there.
        labels = {"model": cfg.served_model_name, "worker_type": backend.worker_type.value}
        REGISTRY.register(
            VllmWorkerCollector(
                backend.engine.stats,
                backend.counters,
                labels,
                monitor=backend.observe_speculation,
            )
        )
    return WorkerProcess(
        [ServedWorker(backend, registration, name="vllm-worker")],
        name="vllm worker",
        system_port=cfg.system_port,
        system_host=cfg.system_host,
        registry=REGISTRY,
    )


def main(argv: list[str] | None = None) -> int:
    configure_logging(logging.INFO)
    try:
        cfg = parse_worker_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        sys.stdout.write(resolved_config_yaml(cfg))
        return 0
    # Counters' `_created` timestamps are noise on /metrics (one extra series per counter).
    prometheus_client.disable_created_metrics()
    # vLLM starts its engine core with multiprocessing (spawned on CPU, forked or spawned
    # on GPU): tie it to this process, so a SIGKILLed worker leaves no engine behind
    # holding its memory (vLLM's own workers follow their engine core through a pipe).
    children_die_with_this_process(signal.SIGKILL)
    spawned_children_die_with_this_process(signal.SIGKILL)
    for line in resolved_config_lines(cfg):
        log.info("config: %s", line)
    tune_for_serving()  # the engine core is another process: this is the output path's
    return uvloop.run(build_process(cfg).run())
