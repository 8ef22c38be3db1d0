"""The serving stack's own cost at scale: this project against NVIDIA Dynamo 1.6.1, both
on simulated engines made nearly free, so what is measured is the frontend, the worker
process around the engine, and the transport between them.

Two stacks, one after the other on the same cores, each one frontend and one simulated
worker:

* reference: `ai-dynamo==1.6.1` (`benchmarks/dynamo_reference.py` installs it into a
  virtualenv of its own), its Rust frontend and its mocker (`--speedup-ratio`), with file
  discovery, the TCP request plane and the ZMQ event plane (no etcd, no NATS);
* ours: nats-server, `python -m dynamo.mocker --speed-up` and `python -m dynamo.frontend`
  (`--http-workers N` with `--http-workers`).

Each is driven by vLLM's serving benchmark (`vllm bench serve`: random dataset, 256 tokens
in / 128 out, ignore-eos, /v1/completions) at every `--concurrency`, on identical prompts
(the same seed per concurrency for both stacks). Per run it records requests/s and the
CPU time each process used during the run (user + system, read from /proc through
psutil, children included), divided by the requests completed.

Usage:

    .venv/bin/python benchmarks/scale_bench.py                   # c = 1, 16, 64, 256
    .venv/bin/python benchmarks/scale_bench.py --quick           # fewer prompts
    .venv/bin/python benchmarks/scale_bench.py --http-workers 2  # ours with 2 processes
    .venv/bin/python benchmarks/scale_bench.py --no-reference --profile 16

`--profile C` adds one more run of ours at concurrency C (after the measured ones, so the
profiler's cost is in no number of the table) with py-spy attached to our frontend and
mocker, and prints where their CPU goes (`benchmarks/flame.py`: shares by layer, the
functions with the most own and inclusive samples); the raw profiles are kept beside
the JSON (`<json stem>.profile-<process>.txt`).

Prints one table per stack and the ratios (ours / reference), and writes the numbers as
JSON (`--json`, default benchmarks/results/scale.json). When the reference cannot be
installed (no package index, say), the script says why and still measures ours.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.llm.models import DEFAULT_MODEL, resolve_model
from dynamo.runtime.ports import free_port
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_serving
from dynamo_reference import (
    DEFAULT_VENV,
    MockerShape,
    Reference,
    reference_or_reason,
    reference_stack,
)
from flame import profile_while
from harness import (
    RunResult,
    Scenario,
    Stack,
    announce,
    format_table,
    guarded,
    host_info,
    log_dir,
    measure_scenarios,
    nats_server,
    nats_server_pid,
    save_report,
)

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCIES = (1, 16, 64, 256)
INPUT_LEN = 256
OUTPUT_LEN = 128
# Nearly free engines: a step of the simulated worker takes a thousandth of its modelled
# time, so the serving stack around it is what bounds throughput.
SPEED_UP = 1000.0
SHAPE = MockerShape(workers=1, block_size=32, kv_blocks=16384, max_model_len=2048, speed_up=0)
START_TIMEOUT_S = 120.0
# The acceptance targets: ours / reference.
TARGET_FRONTEND_CPU_RATIO = 1.0  # at most, at c=16 and c=64
TARGET_THROUGHPUT_RATIO = 1.0  # at least, at c=16 and c=64
TARGET_CONCURRENCIES = (16, 64)


def num_prompts(concurrency: int, quick: bool) -> int:
    """Enough requests for a steady state at `concurrency` (several rounds of it)."""
    return max(64 if quick else 200, (2 if quick else 4) * concurrency)


def scenarios(concurrencies: Sequence[int], quick: bool) -> list[Scenario]:
    return [
        Scenario(f"c{c}", c, num_prompts(c, quick), seed=1000 + c, input_len=INPUT_LEN,
                 output_len=OUTPUT_LEN)
        for c in concurrencies
    ]  # fmt: skip


# --------------------------------------------------------------------------- our stack


@contextmanager
def our_stack(
    model_dir: Path,
    served: str,
    shape: MockerShape,
    logs: Path,
    *,
    router_mode: str,
    http_workers: int,
) -> Iterator[Stack]:
    """nats-server, one `python -m dynamo.mocker` process and one frontend (of
    `http_workers` processes), until the frontend serves `served`. Parts: `frontend`
    (the whole process tree with `--http-workers`), `mocker`, `nats`."""
    namespace = "scale"
    with nats_server(logs) as nats, running([]) as procs:
        mocker = mocker_argv(
            model_dir, nats.url, namespace,
            "--num-workers", str(shape.workers),
            "--block-size", str(shape.block_size),
            "--num-gpu-blocks", str(shape.kv_blocks),
            "--max-model-len", str(shape.max_model_len),
            "--speed-up", str(shape.speed_up),
            "--system-port", str(free_port()),
            served_model_name=served,
        )  # fmt: skip
        procs.append(ManagedProcess("ours-mocker", mocker, logs, cwd=ROOT))
        extra = ["--router-mode", router_mode]
        if http_workers > 1:
            extra += ["--http-workers", str(http_workers)]
        frontend = FrontendProcess("ours-frontend", nats.url, logs, namespace=namespace,
                                   extra=extra, cwd=ROOT)  # fmt: skip
        procs.append(frontend)
        took = wait_serving(frontend.base_url, served, procs, timeout=START_TIMEOUT_S)
        print(f"  ours ready in {took:.0f}s", flush=True)
        pids = {"frontend": frontend.pid, "mocker": procs[0].pid, "nats": nats_server_pid(nats)}
        yield Stack(frontend.base_url, pids, tuple(procs))


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Point:
    """One stack at one concurrency: requests/s and CPU milliseconds per request by part."""

    concurrency: int
    requests_per_s: float
    cpu_ms_per_request: dict[str, float]
    p50_ttft_ms: float
    p50_itl_ms: float

    @classmethod
    def of(cls, concurrency: int, run: RunResult) -> Point:
        parts: dict[str, float] = {}
        for key, seconds in run.server_cpu_s.items():
            part = key.split("/")[0]  # children (the frontend's workers) count to their part
            parts[part] = parts.get(part, 0.0) + seconds
        per_request = {p: round(1000 * s / max(1, run.completed), 2) for p, s in parts.items()}
        return cls(
            concurrency,
            round(run.completed / run.duration_s, 1),
            per_request,
            round(run.median_ttft_ms, 1),
            round(run.median_itl_ms, 2),
        )


def stack_table(points: Sequence[Point]) -> str:
    parts = sorted({p for point in points for p in point.cpu_ms_per_request})
    headers = ["c", "req/s", "p50 TTFT ms", "p50 ITL ms", *(f"{p} CPU ms/req" for p in parts)]
    rows = [
        [
            str(point.concurrency),
            f"{point.requests_per_s:.1f}",
            f"{point.p50_ttft_ms:.1f}",
            f"{point.p50_itl_ms:.2f}",
            *(f"{point.cpu_ms_per_request.get(p, 0.0):.2f}" for p in parts),
        ]
        for point in points
    ]
    return format_table(headers, rows)


def ratio(ours: float, reference: float) -> float | None:
    return round(ours / reference, 2) if reference > 0 else None


def compare(ours: Sequence[Point], reference: Sequence[Point]) -> list[dict[str, Any]]:
    """Per concurrency: ours / reference for requests/s and for each part's CPU per
    request (frontend to frontend, worker process to worker process), and whether the
    targets hold where they apply."""
    by_c = {p.concurrency: p for p in reference}
    rows = []
    for point in ours:
        ref = by_c.get(point.concurrency)
        if ref is None:
            continue
        row: dict[str, Any] = {
            "concurrency": point.concurrency,
            "requests_per_s": ratio(point.requests_per_s, ref.requests_per_s),
            "frontend_cpu": ratio(
                point.cpu_ms_per_request.get("frontend", 0.0),
                ref.cpu_ms_per_request.get("frontend", 0.0),
            ),
            "worker_cpu": ratio(
                point.cpu_ms_per_request.get("mocker", 0.0),
                ref.cpu_ms_per_request.get("mocker", 0.0),
            ),
        }
        if point.concurrency in TARGET_CONCURRENCIES:
            row["met"] = (
                row["requests_per_s"] is not None
                and row["requests_per_s"] >= TARGET_THROUGHPUT_RATIO
                and row["frontend_cpu"] is not None
                and row["frontend_cpu"] <= TARGET_FRONTEND_CPU_RATIO
            )
        rows.append(row)
    return rows


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    table = [
        [
            str(row["concurrency"]),
            cell(row["requests_per_s"]),
            cell(row["frontend_cpu"]),
            cell(row["worker_cpu"]),
            {True: "yes", False: "NO"}.get(row.get("met"), "-"),
        ]
        for row in rows
    ]
    headers = ["c", "req/s", "frontend CPU/req", "worker CPU/req", "targets met"]
    return format_table(headers, table)


# --------------------------------------------------------------------------- run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=list(CONCURRENCIES),
        help="client concurrencies to measure, each a separate `vllm bench serve` run",
    )
    parser.add_argument("--quick", action="store_true", help="fewer prompts per run")
    parser.add_argument("--http-workers", type=int, default=1, help="our frontend's --http-workers")
    parser.add_argument(
        "--router-mode",
        default="round-robin",
        choices=["round-robin", "kv"],
        help="both frontends' --router-mode (one worker: what it costs, not where it sends)",
    )
    parser.add_argument(
        "--speed-up", type=float, default=SPEED_UP, help="both mockers' speed-up factor"
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="measure only ours (no ai-dynamo)"
    )
    parser.add_argument(
        "--reference-venv",
        type=Path,
        default=DEFAULT_VENV,
        help="virtualenv for ai-dynamo (created and filled when missing)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "scale.json",
        help="where the numbers go ('-' for nowhere)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="C",
        help="after the measured runs, profile ours with py-spy at concurrency C",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log")
    args = parser.parse_args(argv)
    if args.http_workers < 1 or min(args.concurrency) < 1:
        parser.error("--http-workers and --concurrency must be at least 1")
    return args


def install_reference(args: argparse.Namespace) -> Reference | None:
    """The reference, or None (with the reason printed) when it cannot be had."""
    if args.no_reference:
        return None
    print(f"reference: ai-dynamo in {args.reference_venv} ...", flush=True)
    return reference_or_reason(args.reference_venv)[0]


def measure(
    label: str, stack: Stack, model_dir: Path, served: str, runs: Sequence[Scenario], logs: Path
) -> list[Point]:
    results = measure_scenarios(stack, model_dir, served, runs, logs, label)
    return [Point.of(s.concurrency, results[s.name]) for s in runs]


def profile(
    args: argparse.Namespace, stack: Stack, model_dir: Path, served: str, logs: Path
) -> dict[str, Any]:
    """One more run at `--profile` concurrency under py-spy (`flame.profile_while`)."""
    scenario = scenarios([args.profile], args.quick)[0]
    scenario = Scenario(**{**scenario.__dict__, "name": f"profile-c{args.profile}"})
    print(f"  profiling ours at c={args.profile} (py-spy)", flush=True)
    return profile_while(
        {part: stack.pids[part] for part in ("frontend", "mocker")},
        lambda: measure_scenarios(stack, model_dir, served, [scenario], logs, "ours"),
        logs,
        None if str(args.json) == "-" else args.json,
        subprocesses=args.http_workers > 1,  # the HTTP worker processes are children
    )


def run(args: argparse.Namespace) -> int:
    model_dir = Path(resolve_model(DEFAULT_MODEL))
    served = DEFAULT_MODEL
    runs = scenarios(args.concurrency, args.quick)
    shape = MockerShape(**{**SHAPE.__dict__, "speed_up": args.speed_up})
    reference = install_reference(args)
    points: dict[str, list[Point]] = {}
    profiles: dict[str, Any] = {}
    with log_dir("scale-bench-", keep=args.keep_logs) as logs:
        print(f"mockers at speed-up {args.speed_up:g}", flush=True)
        announce(served, model_dir, runs, logs)
        if reference is not None:
            print("reference (ai-dynamo frontend + mocker):", flush=True)
            with reference_stack(
                reference, model_dir, served, shape, namespace="reference", log_dir=logs,
                frontend_args=("--router-mode", args.router_mode), timeout=START_TIMEOUT_S,
            ) as stack:  # fmt: skip
                points["reference"] = measure("reference", stack, model_dir, served, runs, logs)
        label = "ours" if args.http_workers == 1 else f"ours ({args.http_workers} http workers)"
        print(f"{label}:", flush=True)
        with our_stack(
            model_dir, served, shape, logs,
            router_mode=args.router_mode, http_workers=args.http_workers,
        ) as stack:  # fmt: skip
            points["ours"] = measure("ours", stack, model_dir, served, runs, logs)
            if args.profile:
                profiles = profile(args, stack, model_dir, served, logs)

    print("\nscale bench results (CPU per request: user + system, children included)")
    for name, stack_points in points.items():
        print(f"\n{name}:\n{stack_table(stack_points)}")
    comparison = compare(points["ours"], points.get("reference", []))
    if comparison:
        print(f"\nours / reference:\n{ratio_table(comparison)}")
    report = {
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "speed_up": args.speed_up,
        "router_mode": args.router_mode,
        "http_workers": args.http_workers,
        "quick": args.quick,
        "reference_version": reference.version if reference else None,
        "points": {name: [p.__dict__ for p in ps] for name, ps in points.items()},
        "ratios": comparison,
        "profiles": profiles,
        "host": host_info(),
    }
    save_report(None if str(args.json) == "-" else args.json, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
