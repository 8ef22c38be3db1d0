"""The SLA planner against static fleets, on a load trace with a ramp, a spike and a fall.

Three setups run the same trace in turn, each on fresh processes (NATS shared, a new
namespace, a new frontend in kv mode), and all three through `python -m dynamo.planner`
with the `local` connector, so the workers are started the same way:

* `planner`: the planner sizes the pools (between 1 and `--max-workers` per pool);
* `static-mean`: a fixed fleet sized for the trace's mean rate (`--min` = `--max`);
* `static-peak`: a fixed fleet sized for the trace's peak rate.

The fleet sizes come from the planner's own model at the targets, so the comparison asks
whether adapting beats the two fixed answers to the same arithmetic. The workers are
`python -m dynamo.mocker` processes whose step-time model is fitted to the embedded
model's measured step times (`engine_configs/profiles/smollm2-135m-instruct/`: the
profile the planner reads; `perf_model.fit_mocker_timing`), with the prefill cost per
token measured on the real engine (`--prefill-ms-per-token`).

The trace (fractions of `--minutes`): low, a ramp to the middle level, a spike to the
peak, back to the middle, a fall to low. Arrivals are Poisson (open loop, the same
seeded arrival times in every setup); each request is a streamed completion of `--isl`
random prompt tokens and exactly `--osl` generated ones.

Per setup: SLA attainment (the share of 10-second windows, by send time, whose p90 TTFT
and p90 ITL meet the targets; ITL per request is (latency - TTFT) / (tokens - 1)),
worker-seconds used (worker processes alive, sampled every second, draining ones
included), and requests lost (no complete answer). `--topology both` runs the
aggregated and the disaggregated fleets. A PNG shows load, workers and p90 latencies
over time per setup.

Usage:

    .venv/bin/python benchmarks/planner_bench.py                        # 10 minutes x 3 x 2
    .venv/bin/python benchmarks/planner_bench.py --minutes 4 --topology aggregated
    .venv/bin/python benchmarks/planner_bench.py --quick                # 2 minutes, aggregated

Full runs write benchmarks/results/planner.json and docs/images/planner.png.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from dynamo.llm.speculation_profile import SpeculationProfile, load_profile
from dynamo.planner.forecast import LoadForecast, LoadForecaster
from dynamo.planner.perf_model import DecodeModel, PrefillModel, fit_mocker_timing
from dynamo.planner.policy import PoolModels, Targets, size_pools
from dynamo.planner.pools import PoolRole, PoolSpec, Topology
from dynamo.runtime.ports import free_port
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_serving
from harness import (
    BenchError,
    format_table,
    guarded,
    host_info,
    log_dir,
    nats_server,
    percentile,
    resolve_model_arg,
    results_path,
    save_report,
    serving_parser,
    stream_request,
)

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "engine_configs" / "profiles" / "smollm2-135m-instruct" / "eagle3.profile.json"
PLOT = REPO / "docs" / "images" / "planner.png"
WINDOW_S = 10.0
PREFILL_MS_PER_TOKEN = 1.8  # the embedded model on this machine (dynamo.planner.args)
INTERVAL_S = 5.0
# (fraction of the run, fraction of the peak rate): low, ramp, middle, spike, middle, fall.
TRACE = (
    (0.00, 0.15), (0.12, 0.15), (0.35, 0.55), (0.50, 0.55), (0.53, 1.00), (0.63, 1.00),
    (0.66, 0.55), (0.78, 0.55), (0.88, 0.15), (1.00, 0.15),
)  # fmt: skip


def rate_fraction(t: float) -> float:
    """The trace's rate at `t` (fraction of the run), as a fraction of the peak."""
    for (t0, r0), (t1, r1) in itertools.pairwise(TRACE):
        if t0 <= t <= t1:
            return r0 + (r1 - r0) * (t - t0) / (t1 - t0) if t1 > t0 else r1
    return TRACE[-1][1]


def mean_fraction(steps: int = 1000) -> float:
    return sum(rate_fraction(i / steps) for i in range(steps)) / steps


def arrivals(
    duration_s: float, peak_rps: float, seed: int, shape: Callable[[float], float] = rate_fraction
) -> list[float]:
    """Poisson arrival times following `shape` (the trace by default; thinning of a
    peak-rate process)."""
    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak_rps)
        if t >= duration_s:
            return times
        if rng.random() < shape(t / duration_s):
            times.append(t)


def forecast_errors(times: list[float], duration_s: float) -> dict[str, float]:
    """Mean absolute error of three forecasts of the next interval's arrival rate over
    the trace, each fed the same per-interval rates: the planner's Kalman filter, the last
    value, and the mean of the last three."""
    bins = int(duration_s // INTERVAL_S)
    counts = [0] * bins
    for t in times:
        if int(t // INTERVAL_S) < bins:
            counts[int(t // INTERVAL_S)] += 1
    rates = [c / INTERVAL_S for c in counts]
    forecaster = LoadForecaster()
    errors: dict[str, list[float]] = {"kalman": [], "last value": [], "mean of 3": []}
    for i in range(bins - 1):
        forecaster.observe(rates[i], INTERVAL_S, counts[i], None, None)
        actual = rates[i + 1]
        errors["kalman"].append(abs(forecaster.forecast(1, 1).request_rate - actual))
        errors["last value"].append(abs(rates[i] - actual))
        recent = rates[max(0, i - 2) : i + 1]
        errors["mean of 3"].append(abs(sum(recent) / len(recent) - actual))
    return {name: sum(e) / len(e) for name, e in errors.items() if e}


@dataclass
class Sent:
    """One request as the client saw it."""

    at: float  # seconds since the run started
    ttft_s: float | None = None
    itl_s: float | None = None  # (latency - TTFT) / (tokens - 1)
    error: str | None = None


@dataclass
class SetupResult:
    name: str
    topology: str
    workers_min_max: dict[str, list[int]]
    attainment: float
    windows: int
    worker_seconds: float
    peak_rps: float
    requests: int
    lost: int
    ttft_p90_s: float
    itl_p90_s: float
    series: dict[str, list[Any]] = field(default_factory=dict)  # for the plot


def pool_specs(topology: Topology, low: int, high: int) -> dict[PoolRole, PoolSpec]:
    return {
        role: PoolSpec(role, "prefill" if role is PoolRole.PREFILL else "backend", low, high)
        for role in topology.roles
    }


def fleet_for(
    topology: Topology, rate: float, args: argparse.Namespace, profile: SpeculationProfile
) -> dict[PoolRole, int]:
    """The workers per pool the planner's model needs for a steady `rate`."""
    models = PoolModels(DecodeModel(profile, False), PrefillModel(PREFILL_MS_PER_TOKEN))
    needs = size_pools(
        pool_specs(topology, 1, 64), models, LoadForecast(rate, args.isl, args.osl),
        Targets(args.ttft_ms / 1000, args.itl_ms / 1000),
    )  # fmt: skip
    return {role: need.replicas for role, need in needs.items()}


def planner_argv(
    args: argparse.Namespace, topology: Topology, bounds: dict[PoolRole, tuple[int, int]],
    nats_url: str, namespace: str, frontend_url: str, metrics_port: int, logs: Path,
    worker_flags: list[str], speculation: str,
) -> list[str]:  # fmt: skip
    decode = bounds.get(PoolRole.DECODE) or bounds[PoolRole.AGGREGATED]
    prefill = bounds.get(PoolRole.PREFILL, (1, 1))
    flags = " ".join(worker_flags)
    return [
        sys.executable, "-m", "dynamo.planner",
        "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
        "--topology", topology.value, "--connector", "local", "--worker-kind", "mocker",
        "--model", args.model, "--served-model-name", args.served,
        "--namespace", namespace, "--nats-server", nats_url, "--frontend-url", frontend_url,
        "--profile", str(PROFILE), "--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN),
        "--min-decode-workers", str(decode[0]), "--max-decode-workers", str(decode[1]),
        "--min-prefill-workers", str(prefill[0]), "--max-prefill-workers", str(prefill[1]),
        "--decode-worker-args", flags, "--prefill-worker-args", flags,
        "--interval", str(INTERVAL_S), "--cooldown", str(3 * INTERVAL_S),
        "--scale-down-intervals", "3", "--default-isl", str(args.isl),
        "--default-osl", str(args.osl), "--metrics-port", str(metrics_port),
        "--log-dir", str(logs / "workers"), "--drain-timeout", "20",
        "--speculation", speculation,
    ]  # fmt: skip


async def send(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, sent: Sent, seed: int
) -> None:
    rng = random.Random(seed)
    body = {
        "model": args.served, "prompt": [rng.randrange(1000, 9000) for _ in range(args.isl)],
        "max_tokens": args.osl, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    try:
        got = await stream_request(session, url, body)
    except (BenchError, aiohttp.ClientError, TimeoutError) as exc:
        sent.error = repr(exc)[:200]
        return
    tokens = int(got.usage.get("completion_tokens") or 0)
    if tokens != args.osl:
        sent.error = f"{tokens} of {args.osl} tokens"
        return
    sent.ttft_s = got.ttft_s
    sent.itl_s = (got.latency_s - got.ttft_s) / max(tokens - 1, 1)


def worker_counts(planner_pid: int) -> dict[str, int]:
    """Worker processes alive under the planner, per pool (draining ones included)."""
    counts = {"prefill": 0, "decode": 0}
    try:
        children = psutil.Process(planner_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return counts
    for child in children:
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if "dynamo.mocker" in cmdline:
            counts["prefill" if "prefill" in cmdline else "decode"] += 1
    return counts


PLANNER_SERIES = (
    "dynamo_planner_worker_capacity_rps",
    "dynamo_planner_acceptance_length",
    "dynamo_planner_request_rate_forecast",
)


async def planner_readings(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The planner's capacity per worker (per pool), acceptance and forecast, now."""
    try:
        async with session.get(url) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    readings = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in PLANNER_SERIES:
                pool = sample.labels.get("pool")
                readings[sample.name + (f"/{pool}" if pool else "")] = sample.value
    return readings


async def drive(
    base_url: str, times: list[float], args: argparse.Namespace, planner_pid: int,
    metrics_url: str,
) -> tuple[list[Sent], list[tuple[float, dict[str, int]]], list[tuple[float, dict[str, float]]]]:  # fmt: skip
    """Send the trace's requests at their times; sample the workers and the planner's
    model every second."""
    url = f"{base_url}/v1/completions"
    sent: list[Sent] = []
    samples: list[tuple[float, dict[str, int]]] = []
    model: list[tuple[float, dict[str, float]]] = []
    start = time.monotonic()
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            now = time.monotonic() - start
            samples.append((now, worker_counts(planner_pid)))
            model.append((now, await planner_readings(session, metrics_url)))
            await asyncio.sleep(1.0)

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sampler = asyncio.create_task(sample())
        tasks = []
        for i, at in enumerate(times):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            record = Sent(at)
            sent.append(record)
            tasks.append(asyncio.create_task(send(session, url, args, record, seed=i)))
        await asyncio.gather(*tasks)
        done.set()
        await sampler
    return sent, samples, model


def windows_met(sent: list[Sent], targets: Targets) -> tuple[int, int, list[dict[str, float]]]:
    """(windows meeting both targets, windows with requests, per-window p90s)."""
    by_window: dict[int, list[Sent]] = {}
    for record in sent:
        by_window.setdefault(int(record.at // WINDOW_S), []).append(record)
    met, rows = 0, []
    for index in sorted(by_window):
        served = [r for r in by_window[index] if r.error is None]
        lost = len(by_window[index]) - len(served)
        ttft = (
            percentile([r.ttft_s for r in served if r.ttft_s is not None], 0.9)
            if served
            else math.inf
        )
        itl = (
            percentile([r.itl_s for r in served if r.itl_s is not None], 0.9)
            if served
            else math.inf
        )
        ok = not lost and ttft <= targets.ttft_s and itl <= targets.itl_s
        met += ok
        rows.append({"t": index * WINDOW_S, "ttft_p90": ttft, "itl_p90": itl, "ok": ok})
    return met, len(by_window), rows


def run_setup(
    name: str, topology: Topology, bounds: dict[PoolRole, tuple[int, int]],
    args: argparse.Namespace, nats_url: str, logs: Path, times: list[float],
    worker_flags: list[str], peak: float, speculation: str = "none",
) -> SetupResult:  # fmt: skip
    namespace = "plan" + uuid.uuid4().hex[:8]
    setup_logs = logs / f"{topology.value}-{name}"
    setup_logs.mkdir(parents=True, exist_ok=True)
    targets = Targets(args.ttft_ms / 1000, args.itl_ms / 1000)
    with running([]) as procs:
        frontend = FrontendProcess(
            "frontend", nats_url, setup_logs, namespace=namespace, extra=["--router-mode", "kv"]
        )
        procs.append(frontend)
        metrics_port = free_port()
        argv = planner_argv(
            args, topology, bounds, nats_url, namespace, frontend.base_url, metrics_port,
            setup_logs, worker_flags, speculation,
        )  # fmt: skip
        planner = ManagedProcess("planner", argv, setup_logs)
        procs.append(planner)
        wait_serving(frontend.base_url, args.served, procs, timeout=180)
        first = sum(low for low, _ in bounds.values())
        deadline = time.monotonic() + 120
        while sum(worker_counts(planner.pid).values()) < first and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3.0)  # every first worker registered and routable
        print(
            f"  {topology.value} / {name}: {len(times)} requests over {args.minutes} min",
            flush=True,
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        sent, samples, model = asyncio.run(
            drive(frontend.base_url, times, args, planner.pid, metrics_url)
        )
    met, windows, rows = windows_met(sent, targets)
    served = [r for r in sent if r.error is None]
    return SetupResult(
        name=name,
        topology=topology.value,
        workers_min_max={role.value: list(b) for role, b in bounds.items()},
        attainment=met / windows if windows else 0.0,
        windows=windows,
        worker_seconds=sum(sum(c.values()) for _, c in samples),
        peak_rps=peak,
        requests=len(sent),
        lost=len(sent) - len(served),
        ttft_p90_s=percentile([r.ttft_s for r in served if r.ttft_s is not None], 0.9),
        itl_p90_s=percentile([r.itl_s for r in served if r.itl_s is not None], 0.9),
        series={
            "workers": [(t, sum(c.values())) for t, c in samples],
            "model": model,
            "windows": rows,
            "arrivals": [r.at for r in sent],
            "errors": sorted({r.error for r in sent if r.error})[:5],
        },
    )


def plot(results: Sequence[SetupResult], minutes: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = sorted({r.topology for r in results})
    fig, axes = plt.subplots(3, len(topologies), figsize=(7 * len(topologies), 9), squeeze=False)
    duration = minutes * 60
    for col, topology in enumerate(topologies):
        load_ax, workers_ax, latency_ax = axes[:, col]
        peak = next(r.peak_rps for r in results if r.topology == topology)
        ts = [i * duration / 200 for i in range(201)]
        load_ax.plot(ts, [peak * rate_fraction(t / duration) for t in ts], color="black")
        load_ax.set_title(f"{topology}: offered load (req/s)")
        for result in (r for r in results if r.topology == topology):
            xs, ys = (
                zip(*result.series["workers"], strict=True)
                if result.series["workers"]
                else ((), ())
            )
            workers_ax.step(xs, ys, where="post", label=result.name)
            rows = result.series["windows"]
            latency_ax.plot(
                [row["t"] for row in rows], [row["itl_p90"] * 1000 for row in rows],
                marker=".", label=f"{result.name} ITL p90",
            )  # fmt: skip
        workers_ax.set_title("worker processes")
        workers_ax.legend()
        latency_ax.set_title("ITL p90 per 10 s window (ms)")
        latency_ax.set_xlabel("seconds")
        latency_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = serving_parser(__doc__, "planner.json")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the trace")
    parser.add_argument(
        "--topology",
        choices=("aggregated", "disaggregated", "both", "none"),
        default="both",
        help="the trace's topologies (none: only the speculation run)",
    )
    parser.add_argument(
        "--peak-rps",
        type=float,
        default=None,
        help="peak request rate (default: what --max-workers carry at 80%%)",
    )
    parser.add_argument("--max-workers", type=int, default=4, help="planner's maximum per pool")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--ttft-ms", type=float, default=1500.0)
    parser.add_argument("--itl-ms", type=float, default=80.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--speculation-minutes", type=float, default=4.0,
        help="length of the run whose acceptance falls halfway (0: skip it)",
    )  # fmt: skip
    parser.add_argument(
        "--plot", type=Path, default=None, help=f"PNG path (full runs: {PLOT.relative_to(REPO)})"
    )
    args = parser.parse_args()  # fmt: skip
    if args.quick:  # a smoke run
        args.minutes, args.topology, args.speculation_minutes = 2.0, "aggregated", 1.0
    model_dir, args.served = resolve_model_arg(args.model)
    args.model = str(model_dir)
    return guarded(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    profile = load_profile(PROFILE)
    fit = fit_mocker_timing(profile, speculative=False)
    worker_flags = fit.flags(PREFILL_MS_PER_TOKEN)
    named = {"both": ("aggregated", "disaggregated"), "none": ()}
    topologies = [Topology(t) for t in named.get(args.topology, (args.topology,))]
    results: list[SetupResult] = []
    errors: dict[str, dict[str, float]] = {}
    with log_dir("planner-bench", keep=args.keep_logs) as logs, nats_server(logs) as nats:
        for topology in topologies:
            peak = args.peak_rps or peak_for(topology, args, profile)
            mean = peak * mean_fraction()
            times = arrivals(args.minutes * 60, peak, args.seed)
            errors[topology.value] = forecast_errors(times, args.minutes * 60)
            sized = {"static-mean": fleet_for(topology, mean, args, profile),
                     "static-peak": fleet_for(topology, peak, args, profile)}  # fmt: skip
            print(
                f"{topology.value}: peak {peak:.1f} req/s, mean {mean:.1f} req/s; mocker "
                f"timing {' '.join(worker_flags)} (fit error {fit.worst_relative_error:.1%}); "
                f"fleets {sized}", flush=True,
            )  # fmt: skip
            setups = {"planner": {role: (1, args.max_workers) for role in topology.roles}}
            setups.update({n: {r: (c, c) for r, c in f.items()} for n, f in sized.items()})
            for name, bounds in setups.items():
                results.append(
                    run_setup(
                        name, topology, bounds, args, nats.url, logs, times, worker_flags, peak
                    )
                )
                report(results[-1])
        spec = run_speculation(args, profile, nats.url, logs) if args.speculation_minutes else None
    print_table(results)
    print(
        f"forecast of the next {INTERVAL_S:g} s's arrival rate, mean absolute error (req/s): {errors}"
    )
    data: dict[str, Any] = {
        "host": host_info(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "forecast_mae_rps": errors,
        "results": [asdict(r) for r in results],
    }  # fmt: skip
    if spec is not None:
        data["speculation"] = asdict(spec)
        print_table([spec])
    path = results_path(args, "planner.json")
    save_report(path, data)
    plot_path = args.plot or (PLOT if path is not None else None)
    if plot_path is not None:
        if results:
            plot(results, args.minutes, plot_path)
            print(f"plot: {plot_path}")
        if spec is not None:
            spec_path = plot_path.with_name(plot_path.stem + "_speculation.png")
            plot_speculation(spec, spec_path)
            print(f"plot: {spec_path}")
    return 0


# The embedded model's Eagle3 acceptance per position (its profile) as the mocker's
# conditional rates, and what it falls to halfway through the speculation run.
PROFILE_RATES = "0.432,0.473,0.551"
LOW_RATE = "0.15"


def run_speculation(
    args: argparse.Namespace, profile: SpeculationProfile, nats_url: str, logs: Path
) -> SetupResult:
    """A steady load on speculating workers (a fixed K = 3) whose acceptance falls from
    the profile's to a fraction of it halfway: the planner's capacity must follow."""
    duration = args.speculation_minutes * 60
    fit = fit_mocker_timing(profile, speculative=True)
    epoch = time.time() + 20  # the trace starts within 20 s; the change lands mid-run
    flags = [
        *fit.flags(PREFILL_MS_PER_TOKEN), "--num-speculative-tokens", "3",
        "--acceptance-rate", PROFILE_RATES, "--acceptance-clock-start", f"{epoch:.0f}",
        "--acceptance-rate-after", f"{duration / 2:.0f}:{LOW_RATE}",
    ]  # fmt: skip
    models = PoolModels(DecodeModel(profile, True, fixed_k=3), PrefillModel(PREFILL_MS_PER_TOKEN))
    targets = Targets(args.ttft_ms / 1000, args.itl_ms / 1000)
    load = LoadForecast(1.0, args.isl, args.osl)
    need = size_pools(pool_specs(Topology.AGGREGATED, 1, 64), models, load, targets)
    rate = 1.5 * need[PoolRole.AGGREGATED].capacity_rps  # two workers at the profile's
    times = arrivals(duration, rate, args.seed, shape=lambda _t: 1.0)
    print(f"speculation: {rate:.1f} req/s for {args.speculation_minutes:g} min", flush=True)
    bounds = {PoolRole.AGGREGATED: (1, args.max_workers + 2)}
    run_args = argparse.Namespace(**{**vars(args), "minutes": args.speculation_minutes})
    return run_setup(
        "planner, acceptance falls", Topology.AGGREGATED, bounds, run_args, nats_url, logs,
        times, flags, rate, speculation="3",
    )  # fmt: skip


def plot_speculation(result: SetupResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (model_ax, workers_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    model = result.series["model"]
    ts = [t for t, _ in model]
    capacity = [m.get("dynamo_planner_worker_capacity_rps/aggregated", math.nan) for _, m in model]
    acceptance = [m.get("dynamo_planner_acceptance_length", math.nan) for _, m in model]
    model_ax.plot(ts, capacity, label="capacity per worker (req/s)")
    model_ax.plot(ts, acceptance, label="measured acceptance length (tokens/step)")
    model_ax.set_title("the planner's model as acceptance falls (fixed K = 3)")
    model_ax.legend()
    if result.series["workers"]:
        xs, ys = zip(*result.series["workers"], strict=True)
        workers_ax.step(xs, ys, where="post")
    workers_ax.set_title("worker processes")
    workers_ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def peak_for(topology: Topology, args: argparse.Namespace, profile: SpeculationProfile) -> float:
    """The largest rate `--max-workers` per pool carry within the targets, times 0.8."""
    lo, hi = 0.0, 200.0
    for _ in range(40):
        mid = (lo + hi) / 2
        fits = all(n <= args.max_workers for n in fleet_for(topology, mid, args, profile).values())
        lo, hi = (mid, hi) if fits else (lo, mid)
    return 0.8 * lo


def report(result: SetupResult) -> None:
    print(
        f"    attainment {result.attainment:.2f} over {result.windows} windows, "
        f"{result.worker_seconds:.0f} worker-s, {result.lost} lost of {result.requests}"
        + (f" ({result.series['errors']})" if result.lost else ""),
        flush=True,
    )


def print_table(results: Sequence[SetupResult]) -> None:
    rows = []
    for result in results:
        peak = next(
            (r for r in results if r.topology == result.topology and r.name == "static-peak"), None
        )
        ratio = (
            result.worker_seconds / peak.worker_seconds
            if peak and peak.worker_seconds
            else math.nan
        )
        rows.append([
            result.topology, result.name, f"{result.attainment:.2f}", f"{result.worker_seconds:.0f}",
            f"{ratio:.2f}x", str(result.lost), f"{result.ttft_p90_s * 1000:.0f}",
            f"{result.itl_p90_s * 1000:.0f}",
        ])  # fmt: skip
    print(format_table(
        ["topology", "setup", "attainment", "worker-s", "vs peak", "lost", "TTFT p90 ms", "ITL p90 ms"],
        rows, align="<<>>>>>>",
    ))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
