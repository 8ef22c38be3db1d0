"""KV cache tiers benchmark: mocker workers without and with a second (host-memory) tier.

A working set of shared prefixes larger than the workers' device tiers together, served by
simulated workers (`dynamo.mocker`, real-speed step times) behind a frontend in
`--router-mode kv`, once per setup, each on a fresh stack (cold caches, a fresh router):

* ``device only``: no second tier: a prefix evicted from a worker's device pool is gone and
  its next request computes it again;
* ``host tier``: ``--kv-host-blocks``: evicted blocks move to host memory, and a request of
  a prefix found there loads it back (``--kv-onboard-ms-per-token``, a tenth of a prefill)
  instead of computing it; the router weighs such a hit at ``--kv-host-tier-weight`` 0.75;
* ``host tier, router blind``: the same workers, the router's host weight 0: it sees the
  host-tier blocks but gives them no value, so what routing adds to the tier shows apart.

Per setup: the hit rate over prompt tokens (device hits, host hits: from the workers'
own counters, so what the engines found, not what the router predicted), time to first
token p50/p90 (streamed, from the client), and throughput (requests and output tokens per
second over the measured phase). A warm-up pass sends each prefix once first (cold
misses, the same in every setup); the measured phase then draws prefixes at random
(Zipf-like: a few hot, a long tail) at a fixed concurrency.

Everything runs in this process on one event loop (mockers, frontend, client) over a
private nats-server, so the absolute latencies include that loop's own work; compare the
setups with one another.

    .venv/bin/python benchmarks/kv_tier_bench.py          # about 3 minutes
    .venv/bin/python benchmarks/kv_tier_bench.py --quick  # under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.mocker.timing import TimingModel
from dynamo.testing.mocker_clusters import MockerCluster, mockers_behind_frontend
from dynamo.testing.mocker_stacks import mock_engine_config
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
    warn_if_busy,
)

RESULTS_FILE = "kv_tier.json"
BLOCK_SIZE = 16
MODEL = "smollm2-tiers"


@dataclass(frozen=True)
class Shape:
    """The workload and the cluster (full or `--quick`)."""

    workers: int
    device_blocks: int  # per worker
    host_blocks: int  # per worker, when the setup has the tier
    prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    max_tokens: int
    requests: int
    concurrency: int

    @property
    def working_set_blocks(self) -> int:
        return self.prefixes * self.prefix_tokens // BLOCK_SIZE


FULL = Shape(
    workers=4,
    device_blocks=256,
    host_blocks=1024,
    prefixes=48,
    prefix_tokens=512,
    suffix_tokens=24,
    max_tokens=8,
    requests=400,
    concurrency=8,
)
QUICK = Shape(
    workers=2,
    device_blocks=160,
    host_blocks=640,
    prefixes=16,
    prefix_tokens=512,
    suffix_tokens=24,
    max_tokens=8,
    requests=120,
    concurrency=4,
)


@dataclass(frozen=True)
class Setup:
    name: str
    host_blocks: bool  # whether the workers have the second tier
    host_weight: float  # the router's --kv-host-tier-weight


SETUPS = (
    Setup("device only", host_blocks=False, host_weight=0.75),
    Setup("host tier", host_blocks=True, host_weight=0.75),
    Setup("host tier, router blind", host_blocks=True, host_weight=0.0),
)


@dataclass(frozen=True)
class Result:
    setup: str
    requests: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    requests_per_s: float
    output_tokens_per_s: float

    @property
    def hit_rate(self) -> float:
        return (self.device_hit_tokens + self.host_hit_tokens) / max(self.prompt_tokens, 1)

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / max(self.prompt_tokens, 1)


# --------------------------------------------------------------------------- workload


def prefix_tokens(group: int, shape: Shape) -> list[int]:
    """Group `group`'s shared prefix: token ids of its own range (no tokenizer needed)."""
    start = 1000 + group * shape.prefix_tokens
    return list(range(start, start + shape.prefix_tokens))


def build_requests(shape: Shape, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts: each prefix once; measured prompts: Zipf-like draws)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 0.6 for rank in range(shape.prefixes)]
    suffix_base = 1000 + shape.prefixes * shape.prefix_tokens

    def prompt(group: int, index: int) -> list[int]:
        start = suffix_base + (index * 7919) % 20000
        return prefix_tokens(group, shape) + list(range(start, start + shape.suffix_tokens))

    warm = [prompt(group, group) for group in range(shape.prefixes)]
    groups = rng.choices(range(shape.prefixes), weights=weights, k=shape.requests)
    measured = [prompt(group, shape.prefixes + i) for i, group in enumerate(groups)]
    return warm, measured


# --------------------------------------------------------------------------- one setup


async def stream_one(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> float:
    """Send one streamed completion; its time to first token in ms."""
    began = time.perf_counter()
    first: float | None = None
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    return ((first or time.perf_counter()) - began) * 1000.0


async def run_prompts(
    client: openai.AsyncOpenAI, prompts: Sequence[list[int]], shape: Shape
) -> list[float]:
    """All `prompts` at `shape.concurrency` in flight; their TTFTs in order sent."""
    queue = list(enumerate(prompts))
    ttfts = [0.0] * len(prompts)

    async def worker() -> None:
        while queue:
            index, prompt = queue.pop(0)
            ttfts[index] = await stream_one(client, prompt, shape.max_tokens)

    await asyncio.gather(*(worker() for _ in range(shape.concurrency)))
    return ttfts


def engine_totals(stack: MockerCluster) -> tuple[int, int, int]:
    """(prompt tokens, cached prompt tokens, of those loaded back from the host tier)
    over every worker's engine."""
    counters = [w.backend.engine.counters for w in stack.workers]
    return (
        sum(c.prompt_tokens for c in counters),
        sum(c.cached_prompt_tokens for c in counters),
        sum(c.onboarded_tokens for c in counters),
    )


async def run_setup(
    setup: Setup, shape: Shape, nats_url: str, model_dir: Path, work: Path, seed: int
) -> Result:
    config = mock_engine_config(
        model_dir,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=shape.device_blocks,
        max_model_len=shape.device_blocks * BLOCK_SIZE // 2,
        kv_host_blocks=shape.host_blocks if setup.host_blocks else 0,
        timing=TimingModel(),
    )
    router = RouterSettings(mode=RouterMode.KV, kv_host_tier_weight=setup.host_weight)
    warm, measured = build_requests(shape, seed)
    async with mockers_behind_frontend(
        nats_url,
        model_dir,
        work / "tok",
        model=MODEL,
        count=shape.workers,
        engine_config=config,
        router=router,
        namespace_prefix="tierbench",
    ) as stack:
        async with openai.AsyncOpenAI(
            base_url=f"{stack.base}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            await run_prompts(client, warm, shape)
            before = engine_totals(stack)
            began = time.perf_counter()
            ttfts = await run_prompts(client, measured, shape)
            elapsed = time.perf_counter() - began
            after = engine_totals(stack)
    prompt, cached, onboarded = (b - a for a, b in zip(before, after, strict=True))
    return Result(
        setup=setup.name,
        requests=len(measured),
        prompt_tokens=prompt,
        device_hit_tokens=cached - onboarded,
        host_hit_tokens=onboarded,
        ttft_p50_ms=percentile(ttfts, 0.5),
        ttft_p90_ms=percentile(ttfts, 0.9),
        requests_per_s=len(measured) / elapsed,
        output_tokens_per_s=len(measured) * shape.max_tokens / elapsed,
    )


# --------------------------------------------------------------------------- report


def render(results: Sequence[Result], shape: Shape) -> str:
    device_total = shape.workers * shape.device_blocks
    headers = [
        "setup",
        "hit rate",
        "device hits",
        "host hits",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "req/s",
        "out tok/s",
    ]
    rows = [
        [
            r.setup,
            f"{r.hit_rate:.3f}",
            f"{r.device_hit_tokens / max(r.prompt_tokens, 1):.3f}",
            f"{r.host_hit_rate:.3f}",
            f"{r.ttft_p50_ms:.1f}",
            f"{r.ttft_p90_ms:.1f}",
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
        ]
        for r in results
    ]
    title = (
        f"kv tiers: {shape.workers} mocker workers x {shape.device_blocks} device blocks "
        f"({device_total} in all) vs a working set of {shape.working_set_blocks} blocks "
        f"({shape.prefixes} prefixes of {shape.prefix_tokens} tokens); host tier "
        f"{shape.host_blocks} blocks per worker; {shape.requests} requests at "
        f"concurrency {shape.concurrency}"
    )
    return f"{title}\n{format_table(headers, rows)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = serving_parser(__doc__, RESULTS_FILE)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prefix draws")
    args: argparse.Namespace = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    model_dir, _ = resolve_model_arg(args.model)

    def body() -> int:
        warn_if_busy()
        results: list[Result] = []
        with ExitStack() as stack:
            logs = stack.enter_context(log_dir("kv-tier-bench-", keep=args.keep_logs))
            nats_url = stack.enter_context(nats_server(logs)).url
            for setup in SETUPS:
                print(f"running: {setup.name} ...", flush=True)
                result = asyncio.run(run_setup(setup, shape, nats_url, model_dir, logs, args.seed))
                results.append(result)
        print(render(results, shape))
        report: dict[str, Any] = {
            "shape": asdict(shape),
            "results": [
                {**asdict(r), "hit_rate": r.hit_rate, "host_hit_rate": r.host_hit_rate}
                for r in results
            ],
            "host": host_info(),
        }
        save_report(results_path(args, RESULTS_FILE), report)
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
