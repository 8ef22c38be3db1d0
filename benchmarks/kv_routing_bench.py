"""KV-aware routing vs round-robin on a shared-prefix workload, two real vLLM workers.

One run starts a private nats-server, two `python -m dynamo.vllm` workers on the embedded
model and two frontends over the *same* workers: one in `--router-mode kv`, one in
`round-robin`. The workload is `--groups` long system prompts (one per "tenant"), each
asked `--per-group` different questions (twelve question shapes of different lengths), sent
in a fixed shuffled order with `--concurrency` streams in flight. Each mode runs on cold
caches (both workers' `clear_kv_blocks` is called before each phase), kv first.

Reported per mode: time to first token (p50, p90), end-to-end latency (p50) and the
prefix-cache hit rate the workers report (cached prompt tokens / prompt tokens, from each
response's usage); for kv also the router's predicted hit rate (`GET /debug/kv`).

Targets: p50 TTFT with kv at least 2x better than round-robin (ratio kv / rr <= 0.5) and
a prefix-cache hit rate >= 80% with kv. Each group's first request must miss, so no router
can beat the *best possible* hit rate, printed beside the measured one: the block-aligned
prefix every request shares with an earlier one, over all prompt tokens (the prompts are
tokenized here with the model's chat template, as the frontend does; the count is checked
against the workers'). The default 8 groups x 12 questions allow 0.89. The same bound for
round-robin over two workers (each worker misses each group once) is 0.81 with unbounded
caches. By default each worker's KV cache is capped at 256 blocks (`--kv-blocks`, 0 for
no cap): room for about half the tenants' prefixes, as in a shared cluster. Round-robin
then thrashes while kv keeps each prefix on one worker. With one request in flight
(`--concurrency 1`, the default) kv can follow every prefix; with two, it also weighs
load (`--kv-overlap-score-weight`) and gives up some hits to use the idle worker.

    .venv/bin/python benchmarks/kv_routing_bench.py [--groups 8] [--per-group 12]
        [--prefix-tokens 1000] [--kv-blocks N]
    .venv/bin/python benchmarks/kv_routing_bench.py --quick     # 4 x 6 requests, no file

Full runs write benchmarks/results/kv_routing.json (`--out` elsewhere; quick runs write
only when `--out` is given).

`--kv-blocks` caps each worker's KV cache (vLLM `--num-gpu-blocks-override`): with a
cache too small for every prefix on every worker, round-robin thrashes while kv keeps
each prefix on one worker. Logs go to a temporary directory that is printed (kept with
`--keep-logs`, or on failure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dynamo.llm.models import resolve_model
from dynamo.runtime import DistributedRuntime
from dynamo.testing.http import fetch_json
from dynamo.testing.processes import (
    FrontendProcess,
    ManagedProcess,
    running,
    wait_for_instances,
    worker_argv,
)
from harness import (
    RESULTS_DIR,
    ROOT,
    BenchError,
    format_table,
    guarded,
    host_info,
    log_dir,
    nats_server,
    percentile,
    save_report,
)

NAMESPACE = "bench-kv"
COMPONENT = "backend"
MODEL = "smollm2-135m-instruct"
RESULTS = RESULTS_DIR / "kv_routing.json"
START_TIMEOUT_S = 300.0
BLOCK_SIZE = 32
MODES = ("kv", "round-robin")

TARGET_TTFT_RATIO = 0.5  # kv p50 TTFT / round-robin p50 TTFT
TARGET_HIT_RATE = 0.8  # kv prefix-cache hit rate

# (groups, per_group) of a full and of a quick run.
FULL_SHAPE = (8, 12)
QUICK_SHAPE = (4, 6)

# Varied suffixes: the questions differ in wording and length, not only in a number.
QUESTIONS = (
    "What is the value of record {a}?",
    "Is the value of record {a} above 50000? Answer yes or no.",
    "Which is larger, record {a} or record {b}? Give both values.",
    "List the values of records {a}, {b} and {c}, separated by commas.",
    "How many digits does the value of record {a} have?",
    "Give the sum of records {a} and {b}, then say whether it is even.",
    "Repeat record {a} word for word.",
    "What is the difference between record {b} and record {a}?",
    "Name one record whose value is below 20000, and quote it.",
    "Which record comes right after record {a}, and what is its value?",
    "Quote the first record and the last record on file for this tenant.",
    "In one short sentence: what kind of data do records {a} to {c} hold?",
)


# --------------------------------------------------------------------------- processes


# Room for about half of the default workload's prefixes (8 x ~1,000 tokens = ~250 blocks)
# plus requests in flight: a shared cluster's cache cannot hold every tenant on every
# worker, which is where routing by cache content pays.
DEFAULT_KV_BLOCKS = 256


def engine_flags(kv_blocks: int | None, max_model_len: int) -> list[str]:
    """The workers' engine flags; `kv_blocks` caps the KV cache (None: vLLM sizes it)."""
    flags = ["--enforce-eager", "--block-size", str(BLOCK_SIZE)]
    flags += ["--max-model-len", str(max_model_len), "--seed", "0"]
    if kv_blocks:
        flags += ["--num-gpu-blocks-override", str(kv_blocks)]
    return flags


@contextlib.contextmanager
def cluster(args: argparse.Namespace, nats_url: str, logs: Path) -> Iterator[dict[str, str]]:
    """Two workers and one frontend per router mode, until every frontend routes to both
    workers; yields the frontends' base URLs by mode. Everything is stopped on exit."""
    flags = engine_flags(args.kv_blocks, args.max_model_len)
    with running([]) as procs:
        for i in range(2):
            argv = worker_argv(MODEL, nats_url, NAMESPACE, flags, "--component", COMPONENT)
            procs.append(ManagedProcess(f"worker{i}", argv, logs, cwd=ROOT))
        bases: dict[str, str] = {}
        for mode in MODES:
            extra = ["--router-mode", mode]
            if mode == "kv":
                extra += ["--kv-overlap-score-weight", str(args.kv_overlap_score_weight)]
            frontend = FrontendProcess(
                f"frontend-{mode}", nats_url, logs, namespace=NAMESPACE, extra=extra, cwd=ROOT
            )
            procs.append(frontend)
            bases[mode] = frontend.base_url
        for base in bases.values():
            wait_for_instances(base, MODEL, 2, procs, timeout=START_TIMEOUT_S)
        yield bases


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    """One chat request of the workload: a tenant's system prompt and a question."""

    group: int
    question: str
    system: str


def system_prompt(group: int, prefix_tokens: int) -> str:
    """A tenant's long system prompt of about `prefix_tokens` tokens."""
    words_per_fact = 12  # about 14 tokens per sentence below
    facts = max(1, prefix_tokens // (words_per_fact + 2))
    body = " ".join(
        f"Record {i} of tenant {group}: value {(group * 7919 + i * 104729) % 100000} is on file."
        for i in range(facts)
    )
    return f"You are the assistant of tenant {group}. Use only these records. {body}"


def question(group: int, index: int) -> str:
    """The `index`-th question to a tenant: shape and record numbers vary with both."""
    shape = QUESTIONS[(index + group) % len(QUESTIONS)]
    a = (index * 7 + group * 3) % 60 + 1
    return f"Question {index}: " + shape.format(a=a, b=a + 5, c=a + 9)


def build_workload(groups: int, per_group: int, prefix_tokens: int, seed: int) -> list[Request]:
    """`groups` distinct long system prompts × `per_group` questions, shuffled so that
    neither router sees a group's requests at regular positions."""
    requests = []
    for g in range(groups):
        system = system_prompt(g, prefix_tokens)
        requests += [Request(g, question(g, q), system) for q in range(per_group)]
    random.Random(seed).shuffle(requests)
    return requests


def prompt_token_ids(workload: Sequence[Request]) -> list[list[int]]:
    """Each request's prompt as the frontend builds it: the model's chat template rendered
    as text, then tokenized without special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)), local_files_only=True)
    ids = []
    for request in workload:
        messages = [
            {"role": "system", "content": request.system},
            {"role": "user", "content": request.question},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return ids


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def best_possible_hit_rate(
    prompts: Sequence[Sequence[int]], block_size: int, workers: int = 1
) -> float:
    """The hit rate with unbounded caches when request `i` (in sending order) runs on
    worker `i % workers`: each request reuses the full blocks it shares with an earlier
    request on the same worker (never its last token, which the engine always computes),
    over all prompt tokens. `workers=1` is an ideal router, which keeps every prefix on
    one worker; `workers=2` is round-robin over two workers."""
    cached = 0
    for i, prompt in enumerate(prompts):
        earlier = prompts[i % workers : i : workers]
        shared = max((common_prefix_len(prompt, e) for e in earlier), default=0)
        cached += min(shared, len(prompt) - 1) // block_size * block_size
    total = sum(len(p) for p in prompts)
    return cached / total if total else 0.0


# --------------------------------------------------------------------------- requests


@dataclass
class Sample:
    """What one request measured."""

    group: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int


async def run_one(
    session: aiohttp.ClientSession, base: str, request: Request, max_tokens: int
) -> Sample:
    """One streamed chat request; TTFT is the arrival of the first content chunk."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": request.system},
            {"role": "user", "content": request.question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        group=request.group,
        ttft_s=ttft if ttft is not None else latency,
        latency_s=latency,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0)),
    )


async def run_phase(
    base: str, workload: list[Request], concurrency: int, max_tokens: int
) -> list[Sample]:
    """The whole workload through one frontend, `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(request: Request) -> Sample:
            async with gate:
                return await run_one(session, base, request, max_tokens)

        return list(await asyncio.gather(*(one(r) for r in workload)))


async def clear_caches(nats_url: str) -> None:
    """Both workers drop their prefix caches (a cold start for the next phase)."""
    runtime = await DistributedRuntime.connect(nats_url, name="bench")
    try:
        endpoint = runtime.namespace(NAMESPACE).component(COMPONENT).endpoint("clear_kv_blocks")
        client = await endpoint.client(wait_for_instances=10)
        for instance_id in client.instance_ids():
            async for result in client.direct({}, instance_id):
                if not result.get("cleared"):
                    raise BenchError(f"worker {instance_id:x} did not clear: {result}")
        await client.close()
    finally:
        await runtime.shutdown(drain_timeout=1.0)


async def router_view(base: str) -> dict[str, Any]:
    """The kv frontend's router state for the workers' endpoint (`GET /debug/kv`)."""
    routers = (await fetch_json(f"{base}/debug/kv"))["models"][MODEL]
    return routers[f"{NAMESPACE}/{COMPONENT}/generate"]


# --------------------------------------------------------------------------- measure


def summarise(samples: list[Sample]) -> dict[str, float]:
    """TTFT and latency percentiles and the hit rate the workers reported."""
    ttfts = [s.ttft_s for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    return {
        "requests": len(samples),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1000, 1),
        "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 1),
        "latency_p50_ms": round(statistics.median(s.latency_s for s in samples) * 1000, 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
    }


async def measure(
    args: argparse.Namespace, nats_url: str, bases: dict[str, str], workload: list[Request]
) -> dict[str, Any]:
    """Warm both engines, then the workload through each router on cold caches."""
    warmup = [Request(-1, f"Warm-up {i}.", "You are terse.") for i in range(4)]
    await run_phase(bases["round-robin"], warmup, 2, 4)  # both engines warm
    results: dict[str, Any] = {}
    for mode in MODES:
        await clear_caches(nats_url)
        await asyncio.sleep(1.0)  # let the kv router apply the clears
        began = time.perf_counter()
        samples = await run_phase(bases[mode], workload, args.concurrency, args.max_tokens)
        results[mode] = summarise(samples) | {
            "wall_s": round(time.perf_counter() - began, 1),
            # The machine may be shared: a loaded host skews a phase, so say so.
            "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "samples": [asdict(sample) for sample in samples],
        }
        headline = {k: v for k, v in results[mode].items() if k != "samples"}
        print(f"{mode:>12}: {headline}", file=sys.stderr)
    results["kv"]["router_predicted_hit_rate"] = (await router_view(bases["kv"]))["routing"][
        "hit_rate"
    ]
    return results


# --------------------------------------------------------------------------- report


def build_report(
    args: argparse.Namespace,
    results: dict[str, Any],
    best: dict[str, float],
    expected_tokens: int,
) -> dict[str, Any]:
    """The JSON report: config, per-mode results, ratios, best possible hit rate, targets."""
    kv, rr = results["kv"], results["round-robin"]
    ratio = round(kv["ttft_p50_ms"] / rr["ttft_p50_ms"], 3)
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **host_info(),
        "results": results,
        "ttft_p50_ratio_kv_over_round_robin": ratio,
        "ttft_mean_ratio_kv_over_round_robin": round(kv["ttft_mean_ms"] / rr["ttft_mean_ms"], 3),
        "best_possible_hit_rate": round(best["kv"], 4),
        "best_possible_hit_rate_round_robin": round(best["round-robin"], 4),
        "expected_prompt_tokens": expected_tokens,
        "targets": {
            "ttft_p50_ratio_max": TARGET_TTFT_RATIO,
            "kv_hit_rate_min": TARGET_HIT_RATE,
            "ttft_met": ratio <= TARGET_TTFT_RATIO,
            "hit_rate_met": kv["prefix_cache_hit_rate"] >= TARGET_HIT_RATE,
            "hit_rate_reachable": best["kv"] >= TARGET_HIT_RATE,
        },
    }


def render_summary(report: dict[str, Any]) -> str:
    """kv and round-robin side by side, with the targets."""
    kv, rr = report["results"]["kv"], report["results"]["round-robin"]
    targets = report["targets"]
    met = {True: "yes", False: "NO"}
    rows = [
        [
            "TTFT p50 (ms)",
            f"{kv['ttft_p50_ms']:.0f}",
            f"{rr['ttft_p50_ms']:.0f}",
            f"kv/rr {report['ttft_p50_ratio_kv_over_round_robin']:.3f} <= {TARGET_TTFT_RATIO}",
            met[targets["ttft_met"]],
        ],
        ["TTFT p90 (ms)", f"{kv['ttft_p90_ms']:.0f}", f"{rr['ttft_p90_ms']:.0f}", "", ""],
        ["TTFT mean (ms)", f"{kv['ttft_mean_ms']:.0f}", f"{rr['ttft_mean_ms']:.0f}", "", ""],
        ["latency p50 (ms)", f"{kv['latency_p50_ms']:.0f}", f"{rr['latency_p50_ms']:.0f}", "", ""],
        [
            "prefix-cache hit rate",
            f"{kv['prefix_cache_hit_rate']:.3f}",
            f"{rr['prefix_cache_hit_rate']:.3f}",
            f"kv >= {TARGET_HIT_RATE}",
            met[targets["hit_rate_met"]],
        ],
        [
            "best possible hit rate",
            f"{report['best_possible_hit_rate']:.3f}",
            f"{report['best_possible_hit_rate_round_robin']:.3f}",
            "(unbounded caches)",
            "",
        ],
        ["router predicted hit rate", f"{kv['router_predicted_hit_rate']:.3f}", "", "", ""],
        ["wall time (s)", f"{kv['wall_s']:.0f}", f"{rr['wall_s']:.0f}", "", ""],
    ]
    return format_table(["metric", "kv", "round-robin", "target", "met"], rows, "<>><<")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); fills the quick or full shape."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 groups x 6: a smoke run")
    parser.add_argument("--groups", type=int, default=None, help="distinct shared prefixes (8)")
    parser.add_argument("--per-group", type=int, default=None, help="requests per prefix (12)")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="approx. prefix length")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight (1; 2 loads both workers)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=DEFAULT_KV_BLOCKS,
        help=f"cap each worker's KV cache in blocks (default {DEFAULT_KV_BLOCKS}; 0: no cap)",
    )
    parser.add_argument(
        "--kv-overlap-score-weight", type=float, default=1.0, help="the kv frontend's weight"
    )
    parser.add_argument("--max-model-len", type=int, default=4096, help="per worker")
    parser.add_argument("--seed", type=int, default=0, help="shuffle of the request order")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"the JSON report (default: {RESULTS})"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the log directory")
    args = parser.parse_args(argv)
    groups, per_group = QUICK_SHAPE if args.quick else FULL_SHAPE
    args.groups = groups if args.groups is None else args.groups
    args.per_group = per_group if args.per_group is None else args.per_group
    if args.out is None and not args.quick:
        args.out = RESULTS
    return args


def run(args: argparse.Namespace) -> int:
    """Build the workload, measure both routers, print and write the report."""
    workload = build_workload(args.groups, args.per_group, args.prefix_tokens, args.seed)
    prompts = prompt_token_ids(workload)
    best = {
        "kv": best_possible_hit_rate(prompts, BLOCK_SIZE),
        "round-robin": best_possible_hit_rate(prompts, BLOCK_SIZE, workers=2),
    }
    print(
        f"{len(workload)} requests ({args.groups} groups x {args.per_group}), "
        f"~{sum(map(len, prompts)) // len(prompts)} prompt tokens each; best possible hit "
        f"rate {best['kv']:.3f} (round-robin over two workers: {best['round-robin']:.3f})",
        file=sys.stderr,
    )
    with (
        log_dir("kv-bench-", keep=args.keep_logs) as logs,
        nats_server(logs) as nats,
        cluster(args, nats.url, logs) as bases,
    ):
        print(f"logs in {logs}", file=sys.stderr)
        results = asyncio.run(measure(args, nats.url, bases, workload))
    report = build_report(args, results, best, sum(map(len, prompts)))
    save_report(args.out, report)
    for mode_results in report["results"].values():
        mode_results.pop("samples", None)  # in the file, not on the screen
    print(json.dumps(report, indent=2))
    print(f"\nkv vs round-robin{' (quick run)' if args.quick else ''}:")
    print(render_summary(report))
    if report["expected_prompt_tokens"] != report["results"]["kv"]["prompt_tokens"]:
        print(
            f"note: the workers counted {report['results']['kv']['prompt_tokens']} prompt "
            f"tokens, this script's tokenization {report['expected_prompt_tokens']}: the best "
            "possible hit rate is approximate",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
