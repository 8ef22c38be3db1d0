"""Disaggregated (1 prefill + 1 decode worker) vs aggregated (1 worker) serving.

Two topologies, one after the other (never at the same time), on the same cores with the
same engine flags, each behind its own nats-server and frontend:

* agg:    `python -m dynamo.vllm` (prefill and decode in one engine);
* disagg: `python -m dynamo.vllm --is-prefill-worker` + `--is-decode-worker`, the KV cache
  moved by the worker's default CPU connector (DiskKvConnector, vLLM's ExampleConnector
  format: safetensors files in a directory both workers share), as `launch/disagg.sh` runs
  them.

Each is measured through the frontend with vLLM's own serving benchmark
(`vllm.benchmarks.serve`, random dataset, 512 tokens in / 128 out, ignore-eos, greedy,
/v1/completions) at concurrency 1 and 8: TTFT p50/p90, ITL p50/p90 and output tokens/s,
printed side by side with the ratio disagg / agg (below 1 is better for latencies, above 1
for tokens/s), plus the CPU the whole stack spent per generated token. Before measuring,
the disagg stack is probed until a request really goes through the prefill worker; the
frontend's prefill-fallback counter is read around the runs, so a run in which decode had
to prefill by itself is reported as such.

What to expect on a 2-core CPU machine: disaggregation does *not* win here, and the script
says so. Its benefit on GPUs is that long prefills stop interrupting other requests'
decode steps, each side on its own accelerator. Here the two engines share the same two
cores (each step of one slows the other: vLLM binds both engines' OpenMP threads to every
core, and those threads spin a few milliseconds after each parallel region), every
prompt's KV is written to disk by the prefill worker and read back by the decode worker,
and each request takes two trips through the frontend and NATS. The numbers measure that
cost honestly; they say nothing about disaggregation on GPUs. `--split-cores` binds the
prefill engine to half of the cores and the decode engine to the other half (the
aggregated worker keeps all of them): no thread contention, but half the compute each.

Usage:

    .venv/bin/python benchmarks/disagg_bench.py            # full run (several minutes)
    .venv/bin/python benchmarks/disagg_bench.py --quick    # short smoke run
    .venv/bin/python benchmarks/disagg_bench.py --split-cores --json /tmp/split.json

Full runs write benchmarks/results/disagg.json (`--json` elsewhere; quick runs write only
when it is given). Logs of every process go to a temporary directory that is printed (kept
with `--keep-logs`, or on failure).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dynamo.testing.http import http_post_json, metric_total
from dynamo.testing.processes import wait_while_alive
from harness import (
    CPU_ENGINE_FLAGS,
    OMP_BIND,
    BenchError,
    RunResult,
    Scenario,
    Stack,
    add_order_arg,
    dynamo_stack,
    format_table,
    guarded,
    host_info,
    in_order,
    measure_in_turn,
    measure_scenarios,
    results_path,
    save_report,
    serving_parser,
    split_cores,
    workload,
)

# The same engine flags for every worker of both topologies (as in overhead_bench.py).
ENGINE_FLAGS = CPU_ENGINE_FLAGS

INPUT_LEN = 512
OUTPUT_LEN = 128

# Topology name -> worker part name -> that worker's extra flags (started in this order).
TOPOLOGIES: dict[str, dict[str, list[str]]] = {
    "agg": {"worker": []},
    "disagg": {"prefill": ["--is-prefill-worker"], "decode": ["--is-decode-worker"]},
}

FALLBACKS = "dynamo_frontend_prefill_fallbacks_total"
PROBE_TIMEOUT_S = 120.0
SAME_WITHIN = 0.03  # ratios within 3% of 1 count as a tie


def scenarios(quick: bool) -> list[Scenario]:
    """Concurrency 1 (latency) and 8 (load); few prompts in quick mode. The seeds differ
    per scenario and are the same for both topologies: both see the same prompts."""
    sizes = {"c1": 4, "c8": 16} if quick else {"c1": 16, "c8": 64}
    return [
        Scenario("c1", 1, sizes["c1"], seed=11, input_len=INPUT_LEN, output_len=OUTPUT_LEN),
        Scenario("c8", 8, sizes["c8"], seed=12, input_len=INPUT_LEN, output_len=OUTPUT_LEN),
    ]


# --------------------------------------------------------------------------- measure


def wait_until_disaggregated(stack: Stack, served: str, timeout: float) -> float:
    """Seconds until a probe request is served through the prefill worker: the frontend
    may list the model as soon as the decode worker registers, before it knows the
    prefill worker, and would then let decode prefill by itself (counted in FALLBACKS)."""

    def probe() -> bool:
        before = metric_total(stack.metrics_url, FALLBACKS)
        # Over two KV blocks: the connector transfers only whole blocks.
        prompt = f"probe {uuid.uuid4().hex}: " + "a short sentence about nothing. " * 16
        body = {"model": served, "prompt": prompt, "max_tokens": 2}
        status, text = http_post_json(f"{stack.base_url}/v1/completions", body)
        if status != 200:
            raise BenchError(f"probe request failed with {status}: {text[:500]}")
        return metric_total(stack.metrics_url, FALLBACKS) == before

    what = "a request served by the prefill worker"
    return wait_while_alive(probe, stack.procs, timeout=timeout, what=what)


@dataclass
class TopologyResult:
    """The runs of one topology and the prefills decode had to do by itself meanwhile."""

    runs: dict[str, RunResult]
    prefill_fallbacks: float


def measure_topology(
    name: str,
    model_dir: Path,
    served: str,
    runs: list[Scenario],
    work_dir: Path,
    *,
    start_timeout: float,
    pin: bool = False,
) -> TopologyResult:
    """Start one topology, run every scenario through its frontend, stop it. `pin`: the
    disagg engines get half of the cores each (see `split_cores`)."""
    print(f"[{name}] starting", flush=True)
    env = {"DYN_KV_SHARED_STORAGE_PATH": str(work_dir / f"kv-transfer-{name}")}
    worker_env = split_cores() if pin and name == "disagg" else {}
    for part, extra in worker_env.items():
        print(f"  {part} engine on cores {extra[OMP_BIND]}", flush=True)
    with dynamo_stack(
        model_dir,
        served,
        TOPOLOGIES[name],
        engine_flags=ENGINE_FLAGS,
        namespace=f"bench-{name}",
        log_dir=work_dir,
        timeout=start_timeout,
        env=env,
        worker_env=worker_env,
    ) as stack:
        if name == "disagg":
            took = wait_until_disaggregated(stack, served, PROBE_TIMEOUT_S)
            print(f"  prefill worker in the path after {took:.0f}s", flush=True)
        before = metric_total(stack.metrics_url, FALLBACKS)
        results = measure_scenarios(stack, model_dir, served, runs, work_dir, name)
        fallbacks = metric_total(stack.metrics_url, FALLBACKS) - before
    if fallbacks:
        print(f"  WARNING: decode prefilled {fallbacks:.0f} requests by itself", flush=True)
    return TopologyResult(results, fallbacks)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Row:
    """One metric of one scenario in both topologies."""

    metric: str
    agg: float
    disagg: float
    higher_is_better: bool

    @property
    def ratio(self) -> float:
        """disagg / agg (0 when agg is 0)."""
        return self.disagg / self.agg if self.agg else 0.0

    @property
    def better(self) -> str:
        """'disagg', 'agg', or 'same' (within SAME_WITHIN)."""
        if not self.agg or abs(self.ratio - 1) <= SAME_WITHIN:
            return "same"
        return "disagg" if (self.ratio > 1) == self.higher_is_better else "agg"


def compare(agg: dict[str, RunResult], disagg: dict[str, RunResult]) -> list[Row]:
    """The metrics of every scenario, side by side."""
    rows = []
    for scenario, a in agg.items():
        d = disagg[scenario]
        c = f"c={scenario.removeprefix('c')}"
        rows += [
            Row(f"{c} TTFT p50 (ms)", a.median_ttft_ms, d.median_ttft_ms, False),
            Row(f"{c} TTFT p90 (ms)", a.p90_ttft_ms, d.p90_ttft_ms, False),
            Row(f"{c} ITL p50 (ms)", a.median_itl_ms, d.median_itl_ms, False),
            Row(f"{c} ITL p90 (ms)", a.p90_itl_ms, d.p90_itl_ms, False),
            Row(f"{c} output tok/s", a.output_throughput, d.output_throughput, True),
            Row(f"{c} CPU ms/token", a.cpu_ms_per_token, d.cpu_ms_per_token, False),
        ]
    return rows


def render_table(rows: list[Row]) -> str:
    """The comparison as a plain-text table."""
    cells = [
        [r.metric, f"{r.agg:.2f}", f"{r.disagg:.2f}", f"{r.ratio:.3f}x", r.better] for r in rows
    ]
    return format_table(["metric", "agg", "disagg", "disagg/agg", "better"], cells, "<>>><")


def verdict(rows: list[Row], fallbacks: float, split: bool) -> str:
    """A few honest lines under the table."""
    wins = [r.metric for r in rows if r.better == "disagg"]
    sharing = (
        "each engine has half of the cores the aggregated one had"
        if split
        else "the prefill and decode engines share the same cores (their OpenMP threads compete)"
    )
    lines = [
        f"disaggregated better on: {', '.join(wins) if wins else 'nothing'}.",
        f"On a small CPU machine {sharing} and every prompt's KV goes through disk: "
        "disaggregation is not expected to win overall here. Its benefit on GPUs (prefills "
        "not interrupting decode, each side on its own accelerator) needs separate hardware.",
    ]
    if fallbacks:
        lines.append(
            f"NOTE: {fallbacks:.0f} disagg requests were prefilled by the decode worker itself "
            "(prefill fallback): those were served aggregated."
        )
    return "\n".join(lines)


def report_json(
    served: str,
    quick: bool,
    runs: list[Scenario],
    measured: dict[str, TopologyResult],
    rows: list[Row],
    split: bool,
) -> dict[str, Any]:
    """Everything measured, for benchmarks/results/disagg.json."""
    return {
        "model": served,
        "engine_flags": ENGINE_FLAGS,
        "topologies": TOPOLOGIES,
        "split_cores": split,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "quick": quick,
        **host_info(),
        "scenarios": [asdict(s) for s in runs],
        **{
            name: {k: asdict(v) for k, v in result.runs.items()}
            for name, result in measured.items()
        },
        "disagg_prefill_fallbacks": measured["disagg"].prefill_fallbacks,
        "comparison": [asdict(r) | {"ratio": r.ratio, "better": r.better} for r in rows],
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = serving_parser(__doc__, "disagg.json")
    add_order_arg(parser, list(TOPOLOGIES))
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="bind the prefill engine to half of the cores and the decode engine to the other "
        "half (default: both engines on all cores, as launch/disagg.sh runs them)",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Measure both topologies, print the comparison, write the JSON."""
    work = workload(args, scenarios)
    measured = measure_in_turn(
        work,
        {
            name: partial(
                measure_topology,
                name,
                *work,
                start_timeout=args.start_timeout,
                pin=args.split_cores,
            )
            for name in in_order(args, list(TOPOLOGIES))
        },
        log_prefix="disagg-bench-",
        keep_logs=args.keep_logs,
    )

    rows = compare(measured["agg"].runs, measured["disagg"].runs)
    print(f"\ndisaggregated vs aggregated{' (quick run)' if args.quick else ''}:")
    print(render_table(rows))
    print()
    print(verdict(rows, measured["disagg"].prefill_fallbacks, args.split_cores))
    save_report(
        results_path(args, "disagg.json"),
        report_json(work.served, args.quick, work.runs, measured, rows, args.split_cores),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
