"""Command line of `python -m dynamo.planner`: flags → `PlannerConfig` (no I/O, no NATS)."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.llm.worker.roles import DEFAULT_COMPONENT, PREFILL_COMPONENT
from dynamo.planner.policy import Targets
from dynamo.planner.pools import PoolRole, PoolSpec, Topology
from dynamo.runtime.cli import (
    ConfigError,
    add_log_level_argument,
    non_negative_int,
    port,
    positive_float,
)
from dynamo.runtime.nats_address import nats_url_from_env
from dynamo.runtime.nats_options import (
    NatsConnectOptions,
    add_nats_arguments,
    nats_options_from_args,
)
from dynamo.runtime.settings import Flag, add_setting_arguments, setting, settings_from_args

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PREFILL_MS_PER_TOKEN = 1.8
"""The embedded model's prefill cost per prompt token on this project's 2-core CPU
machine: the slope of TTFT against prompt length that `benchmarks/conditional_disagg_bench.py
--sweep --split-cores` measured for a prompt computed on the decode worker."""

LOOP = "planning loop"
MODEL = "performance model"
POOLS = "pools"
LOCAL = "local connector"
K8S = "kubernetes connector"


@dataclass(frozen=True)
class LoopSettings:
    """When the planner looks, and how eagerly it changes its mind."""

    interval_s: float = setting(
        10.0,
        Flag(
            "--interval",
            "Seconds between two decisions: each observes the interval just past, forecasts "
            "the next one and sets the replicas for it.",
            type=positive_float,
            group=LOOP,
        ),
    )
    scale_down_intervals: int = setting(
        3,
        Flag(
            "--scale-down-intervals",
            "A pool shrinks only after its need stayed below its replicas this many "
            "intervals in a row (then to the largest need of those intervals); growth is "
            "immediate.",
            type=non_negative_int,
            group=LOOP,
        ),
    )
    cooldown_s: float = setting(
        30.0,
        Flag(
            "--cooldown",
            "Seconds after a pool's last change before it may shrink again (a new worker "
            "needs time to start and fill before its effect is measured).",
            type=positive_float,
            group=LOOP,
        ),
    )
    metrics_port: int | None = setting(
        None,
        Flag(
            "--metrics-port",
            "Serve the planner's Prometheus metrics (targets, replicas, forecast, SLA "
            "attainment, capacity) on this port at /metrics. Default: not served.",
            type=port,
            group=LOOP,
        ),
    )


@dataclass(frozen=True)
class ModelSettings:
    """What the performance model starts from."""

    profile: Path | None = setting(
        None,
        Flag(
            "--profile",
            "Speculation profile of the decode workers' engine (`python -m "
            "dynamo.vllm.profile_spec` output): step times per batch size and K, and the "
            "acceptance per draft position. Required. The embedded model's are in "
            "engine_configs/profiles/smollm2-135m-instruct/.",
            type=Path,
            group=MODEL,
        ),
    )
    speculation: str = setting(
        "none",
        Flag(
            "--speculation",
            "What the decode workers run: none (the profile's step times without "
            "speculation), adaptive (the K with the best goodput at each batch, what "
            "--speculation-adapt does), or a number K (a fixed K). With speculation the "
            "capacity follows the acceptance the frontends measure.",
            group=MODEL,
        ),
    )
    prefill_ms_per_token: float = setting(
        DEFAULT_PREFILL_MS_PER_TOKEN,
        Flag(
            "--prefill-ms-per-token",
            "Prefill cost per uncached prompt token, corrected online from measured TTFT. "
            f"Default: {DEFAULT_PREFILL_MS_PER_TOKEN} (the embedded model on 2 CPU cores).",
            type=positive_float,
            group=MODEL,
        ),
    )
    default_isl: float = setting(
        256.0,
        Flag(
            "--default-isl",
            "Prompt tokens per request assumed until the frontends have measured some.",
            type=positive_float,
            group=MODEL,
        ),
    )
    default_osl: float = setting(
        128.0,
        Flag(
            "--default-osl",
            "Generated tokens per request assumed until the frontends have measured some.",
            type=positive_float,
            group=MODEL,
        ),
    )

    @property
    def fixed_k(self) -> int | None:
        """The K of `--speculation K`; None for none/adaptive."""
        return int(self.speculation) if self.speculation.isdigit() else None

    @property
    def speculative(self) -> bool:
        return self.speculation != "none" and self.speculation != "0"


@dataclass(frozen=True)
class WorkerSettings:
    """How the `local` connector starts workers (the launch scripts' flags)."""

    worker_kind: str = setting(
        "mocker",
        Flag(
            "--worker-kind",
            "local: what to start, `python -m dynamo.mocker` or `python -m dynamo.vllm`.",
            choices=("mocker", "vllm"),
            group=LOCAL,
        ),
    )
    log_dir: Path | None = setting(
        None,
        Flag(
            "--log-dir",
            "local: where each worker's log goes (default: a new temporary directory, "
            "printed at start).",
            type=Path,
            group=LOCAL,
        ),
    )
    drain_timeout_s: float = setting(
        30.0,
        Flag(
            "--drain-timeout",
            "local: seconds a stopped worker may finish its requests; what it still holds "
            "then migrates to another worker.",
            type=positive_float,
            group=LOCAL,
        ),
    )


@dataclass(frozen=True)
class PlannerConfig:
    """Everything `python -m dynamo.planner` was told."""

    model: str
    served_model_name: str
    namespace: str
    nats_url: str
    nats_options: NatsConnectOptions
    frontend_urls: tuple[str, ...]
    targets: Targets
    topology: Topology
    pools: dict[PoolRole, PoolSpec]
    connector: str
    kubernetes_namespace: str
    worker_args: dict[PoolRole, tuple[str, ...]]
    log_level: str = "INFO"
    loop: LoopSettings = field(default_factory=LoopSettings)
    perf: ModelSettings = field(default_factory=ModelSettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.planner",
        description=(
            "SLA planner: keeps as few workers per pool as meet the TTFT and ITL targets. "
            "Every --interval it reads the frontends' /metrics and the workers' load "
            "reports (NATS), forecasts the next interval's load, sizes each pool with a "
            "performance model from the engine's profile (speculation included, corrected "
            "online), and sets the replicas through a connector. See docs/planner.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_sla_arguments(parser.add_argument_group("targets"))
    _add_pool_arguments(parser.add_argument_group(POOLS))
    where = parser.add_argument_group("where things are")
    where.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Model the workers serve (name or directory, as for the workers' --model).",
    )
    where.add_argument(
        "--served-model-name",
        default=None,
        help="Name clients use for it, which labels the frontends' metrics (default: the "
        "model's name, or the directory's).",
    )
    where.add_argument(
        "--namespace", default="dynamo", help="Dynamo namespace of the workers and frontend."
    )
    where.add_argument(
        "--nats-server", default=None, help="NATS URL (default: $NATS_SERVER, else local)."
    )
    where.add_argument(
        "--frontend-url",
        action="append",
        default=None,
        help="Base URL of a frontend whose /metrics the planner reads; repeat for each "
        "replica (default: http://127.0.0.1:8000).",
    )
    add_nats_arguments(parser.add_argument_group("NATS authentication and TLS"))
    connector = parser.add_argument_group("connector")
    connector.add_argument(
        "--connector",
        choices=("local", "kubernetes"),
        default="local",
        help="local: start and stop worker processes on this machine; kubernetes: scale "
        "the pools' Deployments (deploy/k8s) through the API's scale subresource.",
    )
    connector.add_argument(
        "--kubernetes-namespace",
        default="dynamo",
        help="kubernetes: namespace of the worker Deployments.",
    )
    groups = {LOCAL: parser.add_argument_group(LOCAL)}
    for role in (PoolRole.DECODE, PoolRole.PREFILL):
        groups[LOCAL].add_argument(
            f"--{role.value}-worker-args",
            default="",
            help=f"local: extra flags for each {role.value} (or aggregated) worker, "
            "shell-quoted in one string (engine flags, mocker timing flags).",
        )
    for cls in (LoopSettings, ModelSettings, WorkerSettings):
        groups = add_setting_arguments(parser, cls, groups=groups)
    add_log_level_argument(parser)
    return parser


def _add_sla_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--ttft-ms",
        type=positive_float,
        required=True,
        help="Target p90 time to first token, milliseconds.",
    )
    group.add_argument(
        "--itl-ms",
        type=positive_float,
        required=True,
        help="Target p90 inter-token latency, milliseconds.",
    )


def _add_pool_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--topology",
        choices=[t.value for t in Topology],
        default=Topology.AGGREGATED.value,
        help="aggregated: one pool of workers doing both; disaggregated: a prefill pool "
        "and a decode pool, each sized on its own.",
    )
    for role, low, high in ((PoolRole.DECODE, 1, 8), (PoolRole.PREFILL, 1, 8)):
        what = "decode (or aggregated)" if role is PoolRole.DECODE else "prefill"
        group.add_argument(
            f"--min-{role.value}-workers",
            type=non_negative_int,
            default=low,
            help=f"Fewest {what} workers, whatever the load.",
        )
        group.add_argument(
            f"--max-{role.value}-workers",
            type=non_negative_int,
            default=high,
            help=f"Most {what} workers, whatever the load.",
        )
    group.add_argument(
        "--decode-component",
        default=DEFAULT_COMPONENT,
        help="Component the decode (or aggregated) workers register under.",
    )
    group.add_argument(
        "--prefill-component",
        default=PREFILL_COMPONENT,
        help="Component the prefill workers register under.",
    )


def parse_args(argv: Sequence[str] | None = None) -> PlannerConfig:
    """Parse and check the command line; ConfigError for values that cannot work."""
    ns = build_parser().parse_args(argv)
    topology = Topology(ns.topology)
    try:
        pools = _pools(ns, topology)
        targets = Targets(ns.ttft_ms / 1000.0, ns.itl_ms / 1000.0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    perf = settings_from_args(ModelSettings, ns)
    if perf.profile is None:
        raise ConfigError(
            "--profile is required: the decode workers' speculation profile "
            "(python -m dynamo.vllm.profile_spec; the embedded model's are in "
            "engine_configs/profiles/smollm2-135m-instruct/)"
        )
    if perf.speculation not in ("none", "adaptive") and not perf.speculation.isdigit():
        raise ConfigError(f"--speculation must be none, adaptive or a K, not {perf.speculation!r}")
    url = ns.nats_server or nats_url_from_env()
    return PlannerConfig(
        model=ns.model,
        served_model_name=ns.served_model_name or Path(ns.model).name,
        namespace=ns.namespace,
        nats_url=url,
        nats_options=nats_options_from_args(ns, url=url),
        frontend_urls=tuple(ns.frontend_url or ["http://127.0.0.1:8000"]),
        targets=targets,
        topology=topology,
        pools=pools,
        connector=ns.connector,
        kubernetes_namespace=ns.kubernetes_namespace,
        worker_args={
            PoolRole.DECODE: tuple(shlex.split(ns.decode_worker_args)),
            PoolRole.AGGREGATED: tuple(shlex.split(ns.decode_worker_args)),
            PoolRole.PREFILL: tuple(shlex.split(ns.prefill_worker_args)),
        },
        log_level=ns.log_level,
        loop=settings_from_args(LoopSettings, ns),
        perf=perf,
        workers=settings_from_args(WorkerSettings, ns),
    )


def _pools(ns: argparse.Namespace, topology: Topology) -> dict[PoolRole, PoolSpec]:
    decode = (ns.min_decode_workers, ns.max_decode_workers)
    prefill = (ns.min_prefill_workers, ns.max_prefill_workers)
    pools: dict[PoolRole, PoolSpec] = {}
    for role in topology.roles:
        low, high = prefill if role is PoolRole.PREFILL else decode
        component = ns.prefill_component if role is PoolRole.PREFILL else ns.decode_component
        pools[role] = PoolSpec(role, component, low, high)
    return pools
