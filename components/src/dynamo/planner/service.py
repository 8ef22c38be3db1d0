"""The planner's loop: observe, decide (`planner.Planner`), act (a `Connector`), report.

Separate from the decision so that the decision stays pure: this module owns the NATS
connection, the frontends' scrapes, the connector, the metrics server and the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from pathlib import Path

import nats

from dynamo.llm.speculation_profile import load_profile
from dynamo.planner.args import PlannerConfig
from dynamo.planner.connectors import Connector, ConnectorError
from dynamo.planner.connectors.local import LocalConnector, WorkerKind, WorkerLauncher
from dynamo.planner.frontend_scrape import FrontendScraper
from dynamo.planner.metrics import DOWN, UP, PlannerMetrics
from dynamo.planner.observation import Observation, TrafficWindow
from dynamo.planner.planner import Decision, Planner
from dynamo.planner.policy import Hysteresis
from dynamo.planner.pools import PoolRole
from dynamo.planner.worker_load import WorkerLoadWatcher

log = logging.getLogger(__name__)


def build_planner(config: PlannerConfig) -> Planner:
    """The decision, from the config and the profile it names."""
    assert config.perf.profile is not None  # parse_args requires it
    return Planner.from_profile(
        load_profile(config.perf.profile),
        config.pools,
        config.targets,
        speculative=config.perf.speculative,
        fixed_k=config.perf.fixed_k,
        prefill_ms_per_token=config.perf.prefill_ms_per_token,
        hysteresis=Hysteresis(config.loop.scale_down_intervals, config.loop.cooldown_s),
        default_isl=config.perf.default_isl,
        default_osl=config.perf.default_osl,
    )


def build_connector(config: PlannerConfig) -> Connector:
    """The connector `--connector` names (imported here: only the one used is loaded)."""
    if config.connector == "kubernetes":
        from dynamo.planner.connectors.kubernetes import KubernetesConnector

        return KubernetesConnector(config.kubernetes_namespace)
    return local_connector(config)


def local_connector(config: PlannerConfig) -> LocalConnector:
    """Worker processes on this machine, started as the launch scripts start them."""
    log_dir = config.workers.log_dir or Path(tempfile.mkdtemp(prefix="dynamo-planner-"))
    log.info("worker logs in %s", log_dir)
    launchers = [
        WorkerLauncher(
            WorkerKind(config.workers.worker_kind),
            config.model,
            config.namespace,
            config.nats_url,
            role,
            served_model_name=config.served_model_name,
            component=spec.component,
            extra_args=config.worker_args[role],
        )
        for role, spec in config.pools.items()
    ]
    return LocalConnector(launchers, log_dir, config.workers.drain_timeout_s)


async def run_planner(
    config: PlannerConfig, stop: asyncio.Event, connector: Connector | None = None
) -> None:
    """Plan until `stop` is set; then close the connector (`local`: drain its workers)."""
    planner = build_planner(config)
    connector = connector or build_connector(config)
    metrics = PlannerMetrics()
    metrics.set_targets(config.targets.ttft_s, config.targets.itl_s)
    if config.loop.metrics_port is not None:
        metrics.serve(config.loop.metrics_port)
    nc = await nats.connect(config.nats_url, **config.nats_options.connect_kwargs())
    components = {role: spec.component for role, spec in config.pools.items()}
    loads = WorkerLoadWatcher(
        nc, config.namespace, components, stale_after_s=max(3 * config.loop.interval_s, 10.0)
    )
    scraper = FrontendScraper(list(config.frontend_urls), config.served_model_name)
    try:
        await connector.start()
        await loads.start()
        await _ensure_minimum(config, connector)
        await scraper.window()  # the baseline the first interval is measured from
        while not await _sleep_or_stop(stop, config.loop.interval_s):
            try:
                await _one_interval(config, planner, connector, scraper, loads, metrics)
            except ConnectorError as exc:
                if not exc.transient:
                    raise
                log.warning("interval skipped, the connector failed (will retry): %s", exc)
    finally:
        await connector.close()
        await loads.close()
        metrics.close()
        with contextlib.suppress(Exception):
            await nc.close()


async def _ensure_minimum(config: PlannerConfig, connector: Connector) -> None:
    """Start each pool at its minimum (a pool already larger is left to the first decision)."""
    for role, spec in config.pools.items():
        if await connector.replicas(role) < spec.min_workers:
            await connector.scale(role, spec.min_workers)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Wait one interval; True when `stop` was set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def _one_interval(
    config: PlannerConfig,
    planner: Planner,
    connector: Connector,
    scraper: FrontendScraper,
    loads: WorkerLoadWatcher,
    metrics: PlannerMetrics,
) -> None:
    window = await scraper.window()
    if window is None:
        # No frontend answered: no traffic measured is not no traffic, so every pool is
        # held as it is (the scraper has logged which frontends are down).
        log.warning("no frontend answered its /metrics: replicas held this interval")
        return
    seen = Observation(window, {role: loads.load(role) for role in config.pools})
    current = {role: await connector.replicas(role) for role in config.pools}
    decision = planner.decide(seen, current, time.monotonic())
    for role, target in decision.targets.items():
        if target != current[role]:
            await connector.scale(role, target)
            metrics.scaled(role, UP if target > current[role] else DOWN)
    metrics.observed(window, decision.forecast.request_rate)
    for role, need in decision.needs.items():
        metrics.pool(
            role,
            target=decision.targets[role],
            actual=current[role],
            capacity_rps=need.capacity_rps,
            correction=_correction(planner, role),
        )
    log.info("%s", describe(window, decision, current, planner))


def _correction(planner: Planner, role: PoolRole) -> float:
    if role is PoolRole.PREFILL:
        return planner.models.prefill.correction
    return planner.models.decode.correction


def _corrections(planner: Planner, role: PoolRole) -> str:
    """The model corrections that size `role` (an aggregated pool has both)."""
    decode = f"step x{planner.models.decode.correction:.2f}"
    prefill = f"prefill x{planner.models.prefill.correction:.2f}"
    if role is PoolRole.AGGREGATED:
        return f"{decode}, {prefill}, ITL p90/mean {planner.itl_tail_ratio:.2f}"
    return prefill if role is PoolRole.PREFILL else decode


def describe(
    window: TrafficWindow, decision: Decision, current: dict[PoolRole, int], planner: Planner
) -> str:
    """One log line per interval: what was seen, what is expected, what each pool gets."""
    seen = f"{window.request_rate:.2f} req/s ended, {window.arrival_rate:.2f} arrived"
    if window.mean_isl is not None and window.mean_osl is not None:
        seen += f", ISL {window.mean_isl:.0f}, OSL {window.mean_osl:.0f}"
    if window.ttft_p90_s is not None:
        seen += f", TTFT p90 {window.ttft_p90_s * 1000:.0f} ms"
    if window.itl_p90_s is not None:
        seen += f", ITL p90 {window.itl_p90_s * 1000:.0f} ms"
    if window.acceptance_length is not None:
        seen += f", acceptance {window.acceptance_length:.2f}"
    pools = "; ".join(
        f"{role}: {current[role]} -> {decision.targets[role]}"
        f" (needs {need.replicas}{', unmet at max' if need.unmet else ''},"
        f" {need.capacity_rps:.2f} req/s per worker, {_corrections(planner, role)})"
        for role, need in decision.needs.items()
    )
    return f"{seen} | forecast {decision.forecast.request_rate:.2f} req/s | {pools}"
