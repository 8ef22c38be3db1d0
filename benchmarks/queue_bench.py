"""A burst of three times the fleet's capacity: the busy queue against an immediate 503.

Two simulated workers (`python -m dynamo.mocker`, 20 ms a decode step, 8 sequences at a
time each, 64 output tokens a request) behind one frontend in kv mode that counts a worker
busy once a request waits in its queue (`--busy-waiting-requests 1`). Requests arrive at
a steady three times the fleet's nominal capacity (workers x sequences / request time)
for `--seconds` (30 by default); one in ten carries `priority: -1`, the rest the default
0. Three setups, one after the other on fresh processes:

* `no-queue`: `--busy-queue-size 0`, today's behaviour before the queue: a request that
  finds every worker busy gets 503 with Retry-After at once;
* `queue`: the default busy queue (bounded, priority order, `--busy-queue-timeout`
  seconds, 30 by default: a request still waiting then gets its 503);
* `queue, 2 replicas`: the same load alternating between two frontends over the same
  workers (each with its own queue and KV router, bookings shared by replica sync): per
  replica, how many of its requests completed and their TTFT, to see that neither
  replica's queue starves.

Per setup: requests sent, completed, answered 503 (at once, or after waiting), lost (no
answer at all: must be 0), TTFT p50/p99 of the completed requests, and the same for the
priority -1 requests alone. No retries: what a client does with a 503 is its own policy.

Usage:

    .venv/bin/python benchmarks/queue_bench.py            # 30 s bursts (about 5 minutes)
    .venv/bin/python benchmarks/queue_bench.py --quick    # 8 s bursts

Full runs write benchmarks/results/queue.json (`--json` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_serving
from harness import (
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
)

WORKERS = 2
MAX_NUM_SEQS = 8
DECODE_MS = 20.0
OUTPUT_TOKENS = 64
BURST_FACTOR = 3.0
URGENT_EVERY = 10  # one request in ten has priority -1
QUEUE_TIMEOUT_S = 30.0
SERVED = "queue-bench"


@dataclass(frozen=True)
class Setup:
    name: str
    frontend_flags: tuple[str, ...] = ()
    replicas: int = 1  # frontends over the same workers; requests alternate between them


SETUPS = (
    Setup("no-queue", ("--busy-queue-size", "0")),
    Setup("queue"),
    Setup("queue, 2 replicas", replicas=2),
)


@dataclass
class Outcome:
    """What one request got."""

    urgent: bool
    replica: int = 0  # which frontend it was sent to
    status: int | None = None  # None: no answer at all (lost)
    ttft_s: float | None = None  # completed requests only
    elapsed_s: float = 0.0


@dataclass
class SetupResult:
    setup: str
    sent: int
    completed: int
    refused_at_once: int  # 503 within a second
    refused_after_waiting: int  # 503 after waiting in the queue
    lost: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    urgent_ttft_p50_s: float | None
    urgent_ttft_p99_s: float | None
    # Per frontend replica: (completed, sent, TTFT p50 s) - a fair queue starves none.
    per_replica: list[tuple[int, int, float | None]]
    # Shortest and longest wait of the requests answered 503 after waiting (the deadline).
    refused_after_waiting_s: tuple[float, float] | None = None


def capacity_per_s() -> float:
    """Requests a second the fleet completes when every sequence slot is busy."""
    return WORKERS * MAX_NUM_SEQS / (OUTPUT_TOKENS * DECODE_MS / 1000)


async def one_request(session: aiohttp.ClientSession, bases: list[str], i: int) -> Outcome:
    urgent = i % URGENT_EVERY == 0
    replica = i % len(bases)
    body = {
        "model": SERVED,
        "prompt": f"Request {i}: tell me something long.",
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "priority": -1 if urgent else 0,
    }
    outcome = Outcome(urgent, replica)
    started = time.monotonic()
    try:
        async with session.post(f"{bases[replica]}/v1/completions", json=body) as resp:
            if resp.status == 200:
                async for line in resp.content:
                    if line.startswith(b"data:") and outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - started
                    if line.strip() == b"data: [DONE]":
                        outcome.status = 200
            else:
                await resp.read()
                outcome.status = resp.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        print(f"request {i} got no answer: {exc!r}", file=sys.stderr)
    outcome.elapsed_s = time.monotonic() - started
    return outcome


async def burst(bases: list[str], seconds: float) -> list[Outcome]:
    """Open-loop arrivals at BURST_FACTOR x capacity for `seconds`; waits for every answer."""
    rate = BURST_FACTOR * capacity_per_s()
    count = round(rate * seconds)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=QUEUE_TIMEOUT_S + 120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()
        tasks = []
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(one_request(session, bases, i)))
        return list(await asyncio.gather(*tasks))


def _span(values: list[float]) -> tuple[float, float] | None:
    return (round(min(values), 3), round(max(values), 3)) if values else None


def summarize(setup: Setup, outcomes: list[Outcome]) -> SetupResult:
    done = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    urgent = [o.ttft_s for o in done if o.urgent and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    refused = [o for o in outcomes if o.status == 503]

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    def replica(index: int) -> tuple[int, int, float | None]:
        mine = [o.ttft_s for o in done if o.replica == index and o.ttft_s is not None]
        sent = sum(o.replica == index for o in outcomes)
        return len(mine), sent, pct(mine, 0.5)

    return SetupResult(
        setup=setup.name,
        sent=len(outcomes),
        completed=len(done),
        refused_at_once=sum(o.elapsed_s < 1.0 for o in refused),
        refused_after_waiting=sum(o.elapsed_s >= 1.0 for o in refused),
        lost=sum(o.status is None for o in outcomes),
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p99_s=pct(ttfts, 0.99),
        urgent_ttft_p50_s=pct(urgent, 0.5),
        urgent_ttft_p99_s=pct(urgent, 0.99),
        per_replica=[replica(i) for i in range(setup.replicas)],
        refused_after_waiting_s=_span([o.elapsed_s for o in refused if o.elapsed_s >= 1.0]),
    )


def measure(setup: Setup, model: Path, seconds: float, logs: Path) -> SetupResult:
    here = logs / setup.name.replace(",", "").replace(" ", "-")
    here.mkdir(parents=True, exist_ok=True)
    with nats_server(here) as nats:
        namespace = "queue" + uuid.uuid4().hex[:8]
        worker_flags = [
            "--max-num-seqs", str(MAX_NUM_SEQS), "--decode-ms-per-step", str(DECODE_MS),
            "--prefill-ms-per-token", "0.01", "--num-gpu-blocks", "4096",
        ]  # fmt: skip
        procs: list[ManagedProcess] = [
            ManagedProcess(
                f"mocker-{i}",
                mocker_argv(model, nats.url, namespace, *worker_flags, served_model_name=SERVED),
                here,
            )
            for i in range(WORKERS)
        ]
        frontend_flags = [
            "--router-mode", "kv", "--busy-waiting-requests", "1",
            "--busy-queue-timeout", str(QUEUE_TIMEOUT_S), *setup.frontend_flags,
        ]  # fmt: skip
        frontends = [
            FrontendProcess(
                f"frontend-{i}", nats.url, here, namespace=namespace, extra=frontend_flags
            )
            for i in range(setup.replicas)
        ]
        procs += frontends
        with running(procs):
            for frontend in frontends:
                wait_serving(frontend.base_url, SERVED, procs, timeout=120)
            time.sleep(2.0)  # the routers have every worker's first load report
            print(f"{setup.name}: a {seconds:g} s burst at {BURST_FACTOR:g}x capacity ...")
            outcomes = asyncio.run(burst([f.base_url for f in frontends], seconds))
    return summarize(setup, outcomes)


def render(results: list[SetupResult]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    def row(r: SetupResult) -> list[str]:
        counts = [r.sent, r.completed, r.refused_at_once, r.refused_after_waiting, r.lost]
        times = [r.ttft_p50_s, r.ttft_p99_s, r.urgent_ttft_p50_s, r.urgent_ttft_p99_s]
        return [r.setup, *map(str, counts), *map(ms, times)]

    headers = [
        "setup", "sent", "completed", "503 at once", "503 after wait", "lost",
        "TTFT p50 ms", "TTFT p99 ms", "urgent p50 ms", "urgent p99 ms",
    ]  # fmt: skip
    table = format_table(headers, [row(r) for r in results])
    replicas = [
        f"{r.setup}: replica {i}: {done}/{sent} completed, TTFT p50 {ms(p50)} ms"
        for r in results
        if len(r.per_replica) > 1
        for i, (done, sent, p50) in enumerate(r.per_replica)
    ]
    return "\n".join([table, *replicas])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = serving_parser(__doc__, "queue.json")
    parser.add_argument(
        "--seconds", type=float, default=None, help="burst length (default 30; --quick: 8)"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    model, _ = resolve_model_arg(args.model)
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    print(
        f"capacity {capacity_per_s():.1f} requests/s ({WORKERS} workers x {MAX_NUM_SEQS} "
        f"sequences, {OUTPUT_TOKENS} tokens at {DECODE_MS:g} ms a step); burst "
        f"{BURST_FACTOR:g}x for {seconds:g} s"
    )
    with log_dir("queue-bench", args.keep_logs) as logs:
        results = [measure(setup, model, seconds, logs) for setup in SETUPS]
    print(f"\nbusy queue vs an immediate 503 ({BURST_FACTOR:g}x capacity for {seconds:g} s)")
    print(render(results))
    report = {
        "host": host_info(),
        "seconds": seconds,
        "capacity_per_s": capacity_per_s(),
        "burst_factor": BURST_FACTOR,
        "results": [asdict(r) for r in results],
    }
    save_report(results_path(args, "queue.json"), report)
    return 0 if all(r.lost == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
