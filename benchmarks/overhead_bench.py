"""Frontend overhead: the same vLLM engine served directly and through Dynamo.

Two servers with the same engine flags:

* direct: `python -m vllm.entrypoints.openai.api_server --model DIR <engine flags>`;
* dynamo: nats-server + `python -m dynamo.vllm --model DIR <engine flags>` +
  `python -m dynamo.frontend`.

Each is measured with vLLM's own serving benchmark (`vllm.benchmarks.serve`, random
dataset, 256 tokens in / 128 out, ignore-eos, greedy, /v1/completions). Concurrency 16
runs one server at a time (nothing else on the cores while its CPU is counted).
Concurrency 1 runs with both servers up, in alternating rounds (direct then dynamo, then
dynamo then direct, ...) on the same prompts per round: one token every ~40 ms on two
shared cores drifts by more than the millisecond asked about, so a delta is only
meaningful between runs minutes apart at most, and the reported delta is the median of
the per-round deltas.

* concurrency 16: output tokens/s of dynamo ÷ direct   (target >= 0.95);
* concurrency 1:  p50 TTFT added by dynamo             (target <= 10 ms),
                  p50 ITL added by dynamo              (target <= 1 ms);
* concurrency 16: CPU per generated token of the processes around the engine: our
                  frontend + worker process + nats-server ÷ vLLM's API server process
                  (target <= 1.0x; the engine core and its workers are left out of both);
* idle (info):    the same processes' CPU per second with the server up and no request
                  (20 s after the c=16 run), and the c=16 serving CPU per token without
                  that idle part: what being up costs, apart from what each token costs.

`--profile` adds one more c=16 run of dynamo with py-spy on the frontend and the worker
process, and prints where their CPU goes (`benchmarks/flame.py`).

Usage:

    .venv/bin/python benchmarks/overhead_bench.py            # full run (several minutes)
    .venv/bin/python benchmarks/overhead_bench.py --quick    # short smoke run

Prints a table and writes the raw numbers as JSON (`--json`). Logs of every process go
to a temporary directory that is printed (kept with `--keep-logs`, or on failure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from flame import profile_while
from harness import (
    CPU_ENGINE_FLAGS,
    RunResult,
    Scenario,
    Stack,
    add_order_arg,
    cpu_delta,
    dynamo_stack,
    format_table,
    guarded,
    host_info,
    in_order,
    log_dir,
    measure_in_turn,
    measure_scenarios,
    results_path,
    save_report,
    serving_parser,
    vllm_direct_stack,
    workload,
)

ENGINE_FLAGS = CPU_ENGINE_FLAGS  # both servers get the same

INPUT_LEN = 256
OUTPUT_LEN = 128

TARGET_THROUGHPUT_RATIO = 0.95
TARGET_TTFT_ADDED_MS = 10.0
TARGET_ITL_ADDED_MS = 1.0
TARGET_SERVING_CPU_RATIO = 1.0  # the Python around the engine: ours at most vLLM's

# The processes that serve around the engine (tokenize, detokenize, HTTP, transport):
# vLLM's API server process against our frontend, worker process and nats-server. The
# engine core and its workers (`<part>/VLLM::...` children) are the same engine in both.
PROFILED_PARTS = ("frontend", "worker")  # our Python processes around the engine
SERVING_PARTS = {"vllm-direct": ("api_server",), "dynamo": ("frontend", "worker", "nats")}

# A server under test: given the model dir, served name, log dir and start timeout, a
# context manager that yields the running stack.
ServerFactory = Callable[[Path, str, Path, float], AbstractContextManager[Stack]]


IDLE_S = 20.0
IDLE_SETTLE_S = 5.0
C1_ROUNDS = 6
C1_PROMPTS_PER_ROUND = 4


def scenarios(quick: bool) -> list[Scenario]:
    """c16 (throughput and CPU), one server at a time; few prompts in quick mode."""
    return [
        Scenario(
            "c16", 16, 32 if quick else 160, seed=1, input_len=INPUT_LEN, output_len=OUTPUT_LEN
        )
    ]


def c1_rounds(quick: bool) -> list[Scenario]:
    """The c1 (latency) rounds, each with prompts of its own (no round is helped by the
    prefix cache of another), the same for both servers within a round."""
    rounds, prompts = (2, 2) if quick else (C1_ROUNDS, C1_PROMPTS_PER_ROUND)
    return [
        Scenario(f"c1-r{i}", 1, prompts, seed=100 + i, input_len=INPUT_LEN, output_len=OUTPUT_LEN)
        for i in range(rounds)
    ]


def direct_vllm(
    model_dir: Path, served: str, logs: Path, timeout: float
) -> AbstractContextManager[Stack]:
    """vLLM's own API server with `ENGINE_FLAGS`."""
    return vllm_direct_stack(model_dir, served, ENGINE_FLAGS, logs, timeout)


def dynamo(
    model_dir: Path, served: str, logs: Path, timeout: float
) -> AbstractContextManager[Stack]:
    """nats-server + one `dynamo.vllm` worker with `ENGINE_FLAGS` + the frontend."""
    return dynamo_stack(
        model_dir,
        served,
        {"worker": []},
        engine_flags=ENGINE_FLAGS,
        namespace="overhead",
        log_dir=logs,
        timeout=timeout,
    )


# The servers compared, in the order they are measured (`--dynamo-first` reverses it).
SERVERS: list[tuple[str, ServerFactory]] = [("vllm-direct", direct_vllm), ("dynamo", dynamo)]


def measure_server(
    label: str,
    server: ServerFactory,
    model_dir: Path,
    served: str,
    runs: list[Scenario],
    work_dir: Path,
    *,
    start_timeout: float,
    idle: dict[str, dict[str, float]],
    profiles: dict[str, Any] | None = None,
    keep_profiles: Path | None = None,
) -> dict[str, RunResult]:
    """Start one server, run every scenario against it, measure its idle CPU (into
    `idle[label]`), stop it. With `profiles` (a dict to fill), one more run of the first
    scenario follows under py-spy on the processes of `PROFILED_PARTS` (raw profiles kept
    beside `keep_profiles`)."""
    print(f"[{label}] starting", flush=True)
    with server(model_dir, served, work_dir, start_timeout) as stack:
        results = measure_scenarios(stack, model_dir, served, runs, work_dir, label)
        idle[label] = idle_cpu_ms_per_s(stack)
        print(f"  idle: {idle[label]} CPU ms per second", flush=True)
        if profiles is not None:
            scenario = replace(runs[0], name=f"profile-{runs[0].name}")
            print(f"  profiling {label} at c={scenario.concurrency} (py-spy)", flush=True)
            profiles.update(
                profile_while(
                    {part: stack.pids[part] for part in PROFILED_PARTS if part in stack.pids},
                    lambda: measure_scenarios(
                        stack, model_dir, served, [scenario], work_dir, label
                    ),
                    work_dir,
                    keep_profiles,
                )
            )
        return results


def idle_cpu_ms_per_s(stack: Stack, seconds: float = IDLE_S) -> dict[str, float]:
    """CPU milliseconds per second of each part of a stack that is up with no request
    (after `IDLE_SETTLE_S` for the last run's stragglers): what it costs to be up."""
    time.sleep(IDLE_SETTLE_S)
    before = stack.cpu_seconds()
    time.sleep(seconds)
    spent = cpu_delta(before, stack.cpu_seconds())
    return {part: round(1000 * value / seconds, 2) for part, value in spent.items()}


def measure_c1_interleaved(
    servers: list[tuple[str, ServerFactory]],
    model_dir: Path,
    served: str,
    rounds: list[Scenario],
    work_dir: Path,
    *,
    start_timeout: float,
) -> list[dict[str, RunResult]]:
    """Both servers up at once; each round runs on one, then the other (the first of the
    pair alternates), so that slow drift of the machine falls on both sides of a delta."""
    with ExitStack() as running:
        stacks: dict[str, Stack] = {}
        for label, server in servers:
            print(f"[{label}] starting for the c=1 rounds", flush=True)
            stacks[label] = running.enter_context(
                server(model_dir, served, work_dir, start_timeout)
            )
        results: list[dict[str, RunResult]] = []
        for i, scenario in enumerate(rounds):
            order = [label for label, _ in servers]
            if i % 2:
                order.reverse()
            pair = {}
            for label in order:
                print(f"[{label}] round {i + 1}/{len(rounds)}", flush=True)
                stacks[label].check_alive()
                pair[label] = measure_scenarios(
                    stacks[label], model_dir, served, [scenario], work_dir, label
                )[scenario.name]
            results.append(pair)
        return results


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class C1Summary:
    """The c=1 rounds in a few numbers: each side's median of its rounds' p50s, and the
    median (and range) of the per-round deltas dynamo - direct."""

    direct_ttft_ms: float
    dynamo_ttft_ms: float
    ttft_added_ms: float
    direct_itl_ms: float
    dynamo_itl_ms: float
    itl_added_ms: float
    itl_added_range_ms: tuple[float, float]


def summarise_c1(rounds: list[dict[str, RunResult]]) -> C1Summary:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    direct = [r["vllm-direct"] for r in rounds]
    dyn = [r["dynamo"] for r in rounds]
    itl_deltas = [y.median_itl_ms - d.median_itl_ms for d, y in zip(direct, dyn, strict=True)]
    ttft_deltas = [y.median_ttft_ms - d.median_ttft_ms for d, y in zip(direct, dyn, strict=True)]
    return C1Summary(
        direct_ttft_ms=med([d.median_ttft_ms for d in direct]),
        dynamo_ttft_ms=med([y.median_ttft_ms for y in dyn]),
        ttft_added_ms=med(ttft_deltas),
        direct_itl_ms=med([d.median_itl_ms for d in direct]),
        dynamo_itl_ms=med([y.median_itl_ms for y in dyn]),
        itl_added_ms=med(itl_deltas),
        itl_added_range_ms=(min(itl_deltas), max(itl_deltas)),
    )


@dataclass(frozen=True)
class Row:
    """One line of the comparison: both values, the ratio or delta, the target."""

    metric: str
    direct: float
    dynamo: float
    value: float  # ratio or delta
    unit: str
    target: str
    met: bool | None  # None: informational, no target


def compare(
    direct: dict[str, RunResult],
    dyn: dict[str, RunResult],
    c1: C1Summary,
    idle: dict[str, dict[str, float]],
) -> list[Row]:
    """The headline ratios and deltas of dynamo against vLLM direct."""
    d16, y16 = direct["c16"], dyn["c16"]
    ratio = y16.output_throughput / d16.output_throughput
    ttft, itl = c1.ttft_added_ms, c1.itl_added_ms
    cpu = y16.cpu_ms_per_token / d16.cpu_ms_per_token if d16.cpu_ms_per_token else 0.0
    direct_serving = serving_cpu_ms_per_token(d16, SERVING_PARTS["vllm-direct"])
    dynamo_serving = serving_cpu_ms_per_token(y16, SERVING_PARTS["dynamo"])
    serving = dynamo_serving / direct_serving if direct_serving else 0.0
    idle_direct = sum(idle["vllm-direct"].get(p, 0.0) for p in SERVING_PARTS["vllm-direct"])
    idle_dynamo = sum(idle["dynamo"].get(p, 0.0) for p in SERVING_PARTS["dynamo"])
    busy_direct = direct_serving - idle_direct * d16.duration_s / max(1, d16.output_tokens)
    busy_dynamo = dynamo_serving - idle_dynamo * y16.duration_s / max(1, y16.output_tokens)
    return [
        Row(
            "c=16 output tok/s",
            d16.output_throughput,
            y16.output_throughput,
            ratio,
            "x",
            f">= {TARGET_THROUGHPUT_RATIO:.2f}x",
            ratio >= TARGET_THROUGHPUT_RATIO,
        ),
        Row(
            "c=1 p50 TTFT (ms)",
            c1.direct_ttft_ms,
            c1.dynamo_ttft_ms,
            ttft,
            "ms",
            f"<= +{TARGET_TTFT_ADDED_MS:g} ms",
            ttft <= TARGET_TTFT_ADDED_MS,
        ),
        Row(
            "c=1 p50 ITL (ms)",
            c1.direct_itl_ms,
            c1.dynamo_itl_ms,
            itl,
            "ms",
            f"<= +{TARGET_ITL_ADDED_MS:g} ms",
            itl <= TARGET_ITL_ADDED_MS,
        ),
        Row(
            "c=16 serving CPU ms/token",
            direct_serving,
            dynamo_serving,
            serving,
            "x",
            f"<= {TARGET_SERVING_CPU_RATIO:.2f}x",
            serving <= TARGET_SERVING_CPU_RATIO,
        ),
        # No target: what being up costs, and the serving CPU per token without it.
        Row(
            "idle serving CPU ms/s",
            idle_direct,
            idle_dynamo,
            idle_dynamo / idle_direct if idle_direct else 0.0,
            "x",
            "(info)",
            None,
        ),
        Row(
            "c=16 serving CPU ms/token, idle part removed",
            busy_direct,
            busy_dynamo,
            busy_dynamo / busy_direct if busy_direct else 0.0,
            "x",
            "(info)",
            None,
        ),
        # No target: how much more CPU the whole stack burns per generated token.
        Row(
            "c=16 CPU ms/token",
            d16.cpu_ms_per_token,
            y16.cpu_ms_per_token,
            cpu,
            "x",
            "(info)",
            None,
        ),
    ]


def serving_cpu_ms_per_token(result: RunResult, parts: tuple[str, ...]) -> float:
    """CPU milliseconds per generated token of the processes in `parts` alone (their
    engine children left out)."""
    seconds = sum(result.server_cpu_s.get(part, 0.0) for part in parts)
    return 1000 * seconds / max(1, result.output_tokens)


def render_table(rows: list[Row]) -> str:
    """The comparison as a plain-text table."""
    headers = ["metric", "vLLM direct", "dynamo", "ratio/delta", "target", "met"]
    cells = [
        [
            r.metric,
            f"{r.direct:.2f}",
            f"{r.dynamo:.2f}",
            f"{r.value:.3f}x" if r.unit == "x" else f"{r.value:+.2f} ms",
            r.target,
            "" if r.met is None else "yes" if r.met else "NO",
        ]
        for r in rows
    ]
    return format_table(headers, cells, align="<>>><<")


def report_json(
    served: str,
    quick: bool,
    runs: list[Scenario],
    direct: dict[str, RunResult],
    dyn: dict[str, RunResult],
    c1: list[dict[str, RunResult]],
    idle: dict[str, dict[str, float]],
    rows: list[Row],
    all_met: bool,
) -> dict[str, Any]:
    """Everything measured, for benchmarks/results/overhead.json."""
    return {
        "model": served,
        "engine_flags": ENGINE_FLAGS,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "quick": quick,
        **host_info(),
        "scenarios": [asdict(s) for s in runs],
        "direct": {k: asdict(v) for k, v in direct.items()},
        "dynamo": {k: asdict(v) for k, v in dyn.items()},
        "c1_rounds": [{label: asdict(r) for label, r in pair.items()} for pair in c1],
        "c1_summary": asdict(summarise_c1(c1)),
        "idle_cpu_ms_per_s": idle,
        "comparison": [asdict(r) for r in rows],
        "all_targets_met": all_met,
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = serving_parser(__doc__, "overhead.json")
    add_order_arg(parser, [label for label, _ in SERVERS])
    parser.add_argument(
        "--fail-on-miss", action="store_true", help="exit with 3 when a target is missed"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after dynamo's measured runs, one more c=16 run with py-spy on the frontend "
        "and the worker process (benchmarks/flame.py); summaries printed and in the JSON",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Measure both servers, print the comparison, write the JSON."""
    work = workload(args, scenarios)
    model_dir, served, runs = work
    servers = in_order(args, SERVERS)
    profiles: dict[str, Any] = {}
    idle: dict[str, dict[str, float]] = {}
    json_path = results_path(args, "overhead.json")
    measured = measure_in_turn(
        work,
        {
            label: partial(
                measure_server,
                label,
                server,
                *work,
                start_timeout=args.start_timeout,
                idle=idle,
                profiles=profiles if args.profile and label == "dynamo" else None,
                keep_profiles=json_path,
            )
            for label, server in servers
        },
        log_prefix="overhead-bench-",
        keep_logs=args.keep_logs,
    )
    direct, dyn = measured["vllm-direct"], measured["dynamo"]
    with log_dir("overhead-bench-c1-", keep=args.keep_logs) as logs:
        c1 = measure_c1_interleaved(
            servers,
            model_dir,
            served,
            c1_rounds(args.quick),
            logs,
            start_timeout=args.start_timeout,
        )
    summary = summarise_c1(c1)

    rows = compare(direct, dyn, summary, idle)
    print()
    print(render_table(rows))
    low, high = summary.itl_added_range_ms
    print(f"c=1 p50 ITL added per round: {low:+.2f} to {high:+.2f} ms ({len(c1)} rounds)")
    all_met = all(r.met for r in rows if r.met is not None)
    print(
        f"\nall targets met: {'yes' if all_met else 'no'}" + (" (quick run)" if args.quick else "")
    )
    report = report_json(served, args.quick, runs, direct, dyn, c1, idle, rows, all_met)
    report["profiles"] = profiles
    save_report(json_path, report)
    return 3 if args.fail_on_miss and not all_met else 0


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
