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
load (`--kv-overlap-score-weight`): at 1.0 it gave up some hits to use the idle worker,
at the default 2.0 it keeps a prefix's worker while that one runs at most one more.

    .venv/bin/python benchmarks/kv_routing_bench.py [--groups 8] [--per-group 12]
        [--prefix-tokens 1000] [--kv-blocks N]
    .venv/bin/python benchmarks/kv_routing_bench.py --quick     # 4 x 6 requests, no file

Full runs write benchmarks/results/kv_routing.json (`--out` elsewhere; quick runs write
only when `--out` is given).

`--kv-blocks` caps each worker's KV cache (vLLM `--num-gpu-blocks-override`): with a
cache too small for every prefix on every worker, round-robin thrashes while kv keeps
each prefix on one worker. Logs go to a temporary directory that is printed (kept with
`--keep-logs`, or on failure).

Mocker scale (`--mocker`): the same kind of workload at cluster scale on simulated
workers. By default 24 tenants, each a distinct shared prefix of 800 tokens (`--groups`,
`--prefix-tokens`, counted with the model's tokenizer), 12 questions each, in one seeded
shuffled order, streamed through `/v1/completions` (16 tokens each) with 16 and then 64
requests in flight (`--concurrency 16,64`), to 16 simulated workers (one `python -m
dynamo.mocker --num-workers 16` process, `--workers`) whose KV caches hold about 9 of the
prompts each (`--worker-prefixes`; `--kv-blocks` sets the blocks directly), 32-token blocks,
real step times (`--speed-up 1`). Each configuration of `--configs` runs at each
concurrency on a fresh mocker and frontend (cold caches, a fresh router), `--repeats 3`
times, the runs interleaved (a run takes seconds, so one alone is noisy: +-0.04 in hit
rate between runs):

    kv              our frontend, --router-mode kv (KV events)
    kv-no-events    our frontend --router-mode kv --no-kv-events, workers publishing none
    round-robin     our frontend, --router-mode round-robin (also: random)
    dynamo          the reference: ai-dynamo 1.6.1's frontend --router-mode kv and its own
                    mocker with the same shape (benchmarks/dynamo_reference.py installs it
                    into ~/.cache/dynamo-bench/ on first use; if that fails the run says
                    why in one line and measures ours only)

A configuration takes extra frontend flags after a colon, e.g. `--configs
'kv,kv:--kv-overlap-score-weight=2,dynamo:--router-kv-overlap-score-credit=2'`;
`--frontend-arg=FLAG` (repeatable) goes to all of ours, `--mocker-arg` to our mocker,
`--reference-arg` to Dynamo's frontend.

Reported per configuration and concurrency: the prefix hit rate the workers saw (cached
prompt tokens / prompt tokens, from every response's `usage.prompt_tokens_details`;
ours is cross-checked against the mocker's `/metrics`), the best possible hit rate (as
above), their ratio, the ratio to Dynamo's at the same concurrency, TTFT p50 / p90 (the
two mockers' step-time models differ: compare TTFT within a stack), and the router's
predicted hit rate (ours: `GET /debug/kv`; Dynamo: each response's
`nvext.timing.kv_hit_rate`): the mean over the runs, with the hit rate's range. Full
runs write benchmarks/results/kv_routing_mocker.json (per run, without the requests'
numbers unless `--samples`).

    .venv/bin/python benchmarks/kv_routing_bench.py --mocker       # about 3 minutes
    .venv/bin/python benchmarks/kv_routing_bench.py --mocker --quick  # under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dynamo.llm.kv_router.scheduler_defaults import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.models import resolve_model
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.ports import free_port
from dynamo.testing.command_lines import worker_argv
from dynamo.testing.http import fetch_json, http_get, metric_values
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_for_instances
from dynamo_reference import (
    DEFAULT_VENV,
    MockerShape,
    Reference,
    reference_or_reason,
    reference_stack,
)
from harness import (
    FAILURES,
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
    stream_request,
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
    streamed = await stream_request(
        session,
        f"{base}/v1/chat/completions",
        body,
        lambda chunk: any(c["delta"].get("content") for c in chunk.get("choices", [])),
    )
    return Sample(
        group=request.group,
        ttft_s=streamed.ttft_s,
        latency_s=streamed.latency_s,
        prompt_tokens=int(streamed.usage.get("prompt_tokens", 0)),
        cached_tokens=streamed.cached_tokens,
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


def summarise(samples: Sequence[Sample | CompletionSample]) -> dict[str, float]:
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


# --------------------------------------------------------------------------- mocker scale


MOCKER_RESULTS = RESULTS_DIR / "kv_routing_mocker.json"
MOCKER_CONFIGS = "kv,kv-no-events,round-robin,dynamo"
# (tenants, questions each, workers, prompts one worker's cache holds, concurrencies,
# runs of each configuration)
MOCKER_FULL = (24, 12, 16, 9.0, (16, 64), 3)
MOCKER_QUICK = (8, 6, 4, 3.0, (4, 16), 1)
MOCKER_PREFIX_TOKENS = 800
MOCKER_MAX_MODEL_LEN = 2048
MOCKER_START_TIMEOUT_S = 120.0
# The options of the mocker mode only: refused without --mocker.
MOCKER_ONLY = (
    "configs",
    "workers",
    "worker_prefixes",
    "speed_up",
    "frontend_arg",
    "mocker_arg",
    "reference_arg",
    "reference_venv",
    "repeats",
    "samples",
)

REFERENCE = "dynamo"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# Per preset: the frontend's flags and our mocker's flags (the reference's mocker has none).
PRESETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kv": (("--router-mode", "kv"), ()),
    "kv-no-events": (("--router-mode", "kv", "--no-kv-events"), ("--no-kv-events",)),
    "round-robin": (("--router-mode", "round-robin"), ()),
    "random": (("--router-mode", "random"), ()),
    REFERENCE: (("--router-mode", "kv"), ()),
}

HIT_RATE_SOURCES = {
    "ours": "usage.prompt_tokens_details.cached_tokens of each response: the prefix-cache "
    "hit our mocker found when it first admitted the request (cross-checked: "
    "dynamo_worker_cached_prompt_tokens / dynamo_worker_prompt_tokens on its /metrics)",
    REFERENCE: "usage.prompt_tokens_details.cached_tokens of each response, which Dynamo's "
    "frontend passes on from its mocker (a worker-side count: with --router-mode round-robin "
    "a prompt's first request reports 0, a repeat on the same worker its full blocks)",
}
PREDICTED_SOURCES = {
    "ours": "GET /debug/kv routing: overlap blocks / prompt blocks of the requests routed",
    REFERENCE: "nvext.timing.kv_hit_rate of each response (the KV router's overlap / prompt "
    "blocks for that request), weighted by prompt tokens",
}


@dataclass(frozen=True)
class StackConfig:
    """One configuration of `--configs`: a preset and extra frontend flags."""

    label: str
    preset: str
    flags: tuple[str, ...] = ()

    @property
    def reference(self) -> bool:
        return self.preset == REFERENCE


def parse_configs(text: str) -> list[StackConfig]:
    """`PRESET[:FLAGS]` items separated by commas (FLAGS split like a shell would)."""
    configs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        preset, _, flags = item.partition(":")
        if preset not in PRESETS:
            raise ValueError(f"--configs: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        configs.append(StackConfig(item, preset, tuple(shlex.split(flags))))
    if not configs:
        raise ValueError("--configs: no configuration")
    if len({c.label for c in configs}) != len(configs):
        raise ValueError("--configs: a configuration is named twice")
    return configs


def mocker_defaults(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.Namespace:
    """Fill the mocker mode's defaults (full or quick shape) and parse its lists."""
    tenants, per_tenant, workers, prefixes, concurrency, repeats = (
        MOCKER_QUICK if args.quick else MOCKER_FULL
    )
    defaults = {
        "groups": tenants,
        "per_group": per_tenant,
        "prefix_tokens": MOCKER_PREFIX_TOKENS,
        "workers": workers,
        "worker_prefixes": prefixes,
        "speed_up": 1.0,
        "max_model_len": MOCKER_MAX_MODEL_LEN,
        "reference_venv": DEFAULT_VENV,
        "frontend_arg": [],
        "mocker_arg": [],
        "reference_arg": [],
        "repeats": repeats,
        "samples": False,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.concurrency = (
            [int(c) for c in args.concurrency.split(",") if c.strip()]
            if args.concurrency
            else list(concurrency)
        )
        args.configs = parse_configs(args.configs or MOCKER_CONFIGS)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency: positive numbers, e.g. 16,64")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    if args.out is None and not args.quick:
        args.out = MOCKER_RESULTS
    return args


# ------------------------------------------------------------------ mocker: workload


def fitted_system_prompt(group: int, tokens: int, count: Callable[[str], int]) -> str:
    """`system_prompt(group, ...)` with as many records as fit in `tokens` tokens by
    `count` (the model's tokenizer): a first guess in proportion, then one record fewer
    at a time."""
    text = system_prompt(group, tokens)
    budget = max(14, tokens * tokens // max(1, count(text)) + 28)
    text = system_prompt(group, budget)
    while count(text) > tokens and budget > 14:
        budget -= 14  # system_prompt puts one record per 14 tokens of its budget
        text = system_prompt(group, budget)
    return text


def completion_prompt(request: Request) -> str:
    """A request's `/v1/completions` prompt: the tenant's prefix, then its question."""
    return f"{request.system}\n\n{request.question}\nAnswer:"


@dataclass(frozen=True)
class MockerWorkload:
    """The requests in sending order, their prompts, and the prompts' token ids."""

    requests: list[Request]
    prompts: list[str]
    token_ids: list[list[int]]
    prefix_tokens: list[int]  # per tenant


def build_mocker_workload(args: argparse.Namespace) -> MockerWorkload:
    """`--groups` tenants of `--prefix-tokens` shared tokens, `--per-group` questions each,
    shuffled with `--seed`; tokenized as the frontends do for `/v1/completions`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)), local_files_only=True)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True))

    systems = [fitted_system_prompt(g, args.prefix_tokens, count) for g in range(args.groups)]
    requests = [
        Request(g, question(g, q), systems[g])
        for g in range(args.groups)
        for q in range(args.per_group)
    ]
    random.Random(args.seed).shuffle(requests)
    prompts = [completion_prompt(r) for r in requests]
    ids = [list(tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    return MockerWorkload(requests, prompts, ids, [count(s) for s in systems])


def mocker_shape(args: argparse.Namespace, workload: MockerWorkload) -> MockerShape:
    """Both mockers' shape; the KV cache holds `--worker-prefixes` average prompts unless
    `--kv-blocks` says otherwise."""
    mean_len = statistics.fmean(len(ids) for ids in workload.token_ids)
    kv_blocks = args.kv_blocks or math.ceil(args.worker_prefixes * math.ceil(mean_len / BLOCK_SIZE))
    longest = max(len(ids) for ids in workload.token_ids) + args.max_tokens
    if longest > args.max_model_len:
        raise BenchError(f"a prompt + --max-tokens is {longest} tokens, > --max-model-len")
    if kv_blocks * BLOCK_SIZE < args.max_model_len:
        raise BenchError(
            f"{kv_blocks} KV blocks of {BLOCK_SIZE} cannot hold one --max-model-len "
            f"({args.max_model_len}) request, which our mocker requires: lower --max-model-len"
        )
    return MockerShape(args.workers, BLOCK_SIZE, kv_blocks, args.max_model_len, args.speed_up)


# ------------------------------------------------------------------ mocker: requests


@dataclass
class CompletionSample:
    """What one streamed `/v1/completions` request measured."""

    group: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    predicted_hit_rate: float | None = None  # Dynamo's nvext.timing.kv_hit_rate


async def run_completion(
    session: aiohttp.ClientSession,
    base: str,
    group: int,
    prompt: str,
    max_tokens: int,
    timing: bool,
) -> CompletionSample:
    """One streamed completion; TTFT is the arrival of the first chunk with text.
    `timing` asks Dynamo's frontend for its routing figures (`nvext`)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if timing:
        body["nvext"] = {"extra_fields": ["timing"]}
    streamed = await stream_request(
        session,
        f"{base}/v1/completions",
        body,
        lambda chunk: any(c.get("text") for c in chunk.get("choices") or []),
    )
    predicted = None
    for chunk in streamed.chunks:
        hit = ((chunk.get("nvext") or {}).get("timing") or {}).get("kv_hit_rate")
        predicted = float(hit) if hit is not None else predicted
    return CompletionSample(
        group=group,
        ttft_s=streamed.ttft_s,
        latency_s=streamed.latency_s,
        prompt_tokens=int(streamed.usage.get("prompt_tokens") or 0),
        cached_tokens=streamed.cached_tokens,
        predicted_hit_rate=predicted,
    )


async def run_completions(
    base: str,
    requests: Sequence[tuple[int, str]],
    concurrency: int,
    max_tokens: int,
    timing: bool,
) -> list[CompletionSample]:
    """`(group, prompt)` requests in order, `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=max(100, concurrency))
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=connector
    ) as session:

        async def one(group: int, prompt: str) -> CompletionSample:
            async with gate:
                return await run_completion(session, base, group, prompt, max_tokens, timing)

        return list(await asyncio.gather(*(one(g, p) for g, p in requests)))


def mocker_token_counts(metrics_url: str) -> tuple[float, float]:
    """(prompt tokens, cached prompt tokens) our mocker's workers counted so far."""
    _, text = http_get(metrics_url)

    def total(name: str) -> float:
        return sum(metric_values(text, f"{name}_total") or metric_values(text, name))

    return total("dynamo_worker_prompt_tokens"), total("dynamo_worker_cached_prompt_tokens")


async def our_routing(base: str, key: str) -> dict[str, int] | None:
    """Our kv router's tally for the workers' endpoint (None: not a kv router)."""
    try:
        view = (await fetch_json(f"{base}/debug/kv"))["models"][MODEL][key]
    except (KeyError, TypeError, aiohttp.ClientError):
        return None
    return view.get("routing")


@dataclass
class PhaseProbe:
    """Where a phase reads its extra figures: our mocker's metrics, our router's state."""

    metrics_url: str | None = None
    router_key: str | None = None
    timing: bool = False  # ask for Dynamo's nvext timing


async def measure_phase(
    base: str,
    workload: MockerWorkload,
    concurrency: int,
    max_tokens: int,
    probe: PhaseProbe,
) -> dict[str, Any]:
    """Warm the frontend up (two short prompts), then the workload; its summary with the
    metrics' and the router's hit rates over the workload alone."""
    warmup = [(-1, f"Warm-up {i}.") for i in range(2)]
    await run_completions(base, warmup, 2, 2, probe.timing)
    metrics_before = mocker_token_counts(probe.metrics_url) if probe.metrics_url else None
    routing_before = await our_routing(base, probe.router_key) if probe.router_key else None
    began = time.perf_counter()
    requests = [(r.group, p) for r, p in zip(workload.requests, workload.prompts, strict=True)]
    samples = await run_completions(base, requests, concurrency, max_tokens, probe.timing)
    wall = time.perf_counter() - began
    result: dict[str, Any] = summarise(samples) | {"wall_s": round(wall, 2)}
    result["metrics_hit_rate"] = None
    if metrics_before is not None and probe.metrics_url:
        prompt, cached = (
            after - before
            for after, before in zip(
                mocker_token_counts(probe.metrics_url), metrics_before, strict=True
            )
        )
        result["metrics_hit_rate"] = round(cached / prompt, 4) if prompt else None
    result["router_predicted_hit_rate"] = None
    routing_after = await our_routing(base, probe.router_key) if probe.router_key else None
    if routing_before is not None and routing_after is not None:
        blocks = routing_after["request_blocks"] - routing_before["request_blocks"]
        overlap = routing_after["overlap_blocks"] - routing_before["overlap_blocks"]
        result["router_predicted_hit_rate"] = round(overlap / blocks, 4) if blocks else None
    predicted = [(s.predicted_hit_rate, s.prompt_tokens) for s in samples]
    if probe.timing and all(p is not None for p, _ in predicted):
        weight = sum(n for _, n in predicted)
        if weight:
            value = sum(p * n for p, n in predicted if p is not None) / weight
            result["router_predicted_hit_rate"] = round(value, 4)
    seen: set[int] = set()
    repeat_misses = 0
    for sample in samples:  # in sending order
        repeat_misses += sample.group in seen and sample.cached_tokens == 0
        seen.add(sample.group)
    result["repeat_misses"] = repeat_misses
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    result["samples"] = [asdict(s) for s in samples]
    return result


# ------------------------------------------------------------------ mocker: stacks


@contextlib.contextmanager
def our_stack(
    args: argparse.Namespace,
    config: StackConfig,
    shape: MockerShape,
    *,
    nats_url: str,
    namespace: str,
    logs: Path,
) -> Iterator[tuple[str, PhaseProbe, list[str], list[str]]]:
    """One `python -m dynamo.mocker --num-workers N` process and one frontend of ours, in
    `namespace`, until the frontend lists every worker; yields its base URL, the phase's
    probes, and the frontend's and mocker's extra flags."""
    frontend_flags, mocker_flags = (list(f) for f in PRESETS[config.preset])
    if args.kv_overlap_score_weight is not None and config.preset.startswith("kv"):
        frontend_flags += ["--kv-overlap-score-weight", str(args.kv_overlap_score_weight)]
    frontend_flags += [*args.frontend_arg, *config.flags]
    mocker_flags += args.mocker_arg
    metrics_port = free_port()
    argv = mocker_argv(
        MODEL, nats_url, namespace,
        "--num-workers", str(shape.workers),
        "--block-size", str(shape.block_size),
        "--num-gpu-blocks", str(shape.kv_blocks),
        "--max-model-len", str(shape.max_model_len),
        "--speed-up", str(shape.speed_up),
        "--system-port", str(metrics_port),
        *mocker_flags,
    )  # fmt: skip
    with running([]) as procs:
        procs.append(ManagedProcess(f"{namespace}-mocker", argv, logs, cwd=ROOT))
        frontend = FrontendProcess(
            f"{namespace}-frontend",
            nats_url,
            logs,
            namespace=namespace,
            extra=frontend_flags,
            cwd=ROOT,
        )
        procs.append(frontend)
        wait_for_instances(
            frontend.base_url, MODEL, shape.workers, procs, timeout=MOCKER_START_TIMEOUT_S
        )
        probe = PhaseProbe(
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            router_key=f"{namespace}/{COMPONENT}/generate",  # None from a router without state
        )
        yield frontend.base_url, probe, frontend_flags, mocker_flags


def run_mocker_phase(
    args: argparse.Namespace,
    config: StackConfig,
    concurrency: int,
    shape: MockerShape,
    workload: MockerWorkload,
    *,
    index: int,
    logs: Path,
    nats_url: str | None,
    reference: Reference | None,
) -> dict[str, Any]:
    """One configuration at one concurrency on a fresh stack (cold caches)."""
    namespace = f"kvm{index}"
    began = time.perf_counter()
    record: dict[str, Any] = {
        "config": config.label,
        "stack": REFERENCE if config.reference else "ours",
        "concurrency": concurrency,
    }
    if config.reference:
        assert reference is not None
        frontend_flags = [*PRESETS[REFERENCE][0], *args.reference_arg, *config.flags]
        record |= {"frontend_flags": frontend_flags, "mocker_flags": []}
        with reference_stack(
            reference,
            Path(resolve_model(MODEL)),
            MODEL,
            shape,
            namespace=namespace,
            log_dir=logs,
            frontend_args=frontend_flags,
            timeout=MOCKER_START_TIMEOUT_S,
        ) as stack:
            record["start_s"] = round(time.perf_counter() - began, 1)
            probe = PhaseProbe(timing=True)
            record |= asyncio.run(
                measure_phase(stack.base_url, workload, concurrency, args.max_tokens, probe)
            )
        return record
    assert nats_url is not None
    with our_stack(args, config, shape, nats_url=nats_url, namespace=namespace, logs=logs) as (
        base,
        probe,
        frontend_flags,
        mocker_flags,
    ):
        record |= {"frontend_flags": frontend_flags, "mocker_flags": mocker_flags}
        record["start_s"] = round(time.perf_counter() - began, 1)
        record |= asyncio.run(measure_phase(base, workload, concurrency, args.max_tokens, probe))
    return record


def phase_line(phase: dict[str, Any], best: float) -> str:
    """One progress line per phase."""
    head = f"{phase['config']:>28} C={phase['concurrency']:<3} run {phase['repeat'] + 1}"
    if "error" in phase:
        return f"{head} FAILED: {phase['error']}"
    predicted = phase["router_predicted_hit_rate"]
    return (
        f"{head} hit rate {phase['prefix_cache_hit_rate']:.3f} "
        f"({phase['prefix_cache_hit_rate'] / best:.2f} of best), router predicted "
        f"{'-' if predicted is None else f'{predicted:.3f}'}, TTFT p50 "
        f"{phase['ttft_p50_ms']:.0f} ms p90 {phase['ttft_p90_ms']:.0f} ms; "
        f"{phase['wall_s']:.1f}s (+{phase['start_s']:.0f}s start)"
    )


def summarise_runs(phases: Sequence[dict[str, Any]], best: float) -> list[dict[str, Any]]:
    """Per configuration and concurrency, over its runs: mean hit rate (and range), its
    ratio to the best possible and to Dynamo's at the same concurrency, mean router
    prediction, TTFT percentiles over every request of every run, mean wall time."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for phase in phases:
        grouped.setdefault((phase["config"], phase["concurrency"]), []).append(phase)
    summary = []
    for (label, concurrency), runs in grouped.items():
        ok = [p for p in runs if "error" not in p]
        entry: dict[str, Any] = {
            "config": label,
            "stack": runs[0]["stack"],
            "concurrency": concurrency,
            "runs": len(ok),
            "failed_runs": len(runs) - len(ok),
        }
        if ok:
            hits = [p["prefix_cache_hit_rate"] for p in ok]
            predicted = [
                p["router_predicted_hit_rate"]
                for p in ok
                if p["router_predicted_hit_rate"] is not None
            ]
            ttfts = [s["ttft_s"] for p in ok for s in p["samples"]]
            entry |= {
                "hit_rate": round(statistics.fmean(hits), 4),
                "hit_rate_min": min(hits),
                "hit_rate_max": max(hits),
                "hit_rate_over_best": round(statistics.fmean(hits) / best, 4),
                "router_predicted_hit_rate": (
                    round(statistics.fmean(predicted), 4) if predicted else None
                ),
                "repeat_misses": round(statistics.fmean(p["repeat_misses"] for p in ok), 1),
                "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
                "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1000, 1),
                "wall_s": round(statistics.fmean(p["wall_s"] for p in ok), 2),
            }
        summary.append(entry)
    reference = {
        e["concurrency"]: e["hit_rate"] for e in summary if e["stack"] == REFERENCE and e["runs"]
    }
    for entry in summary:
        ref = reference.get(entry["concurrency"])
        hit = entry.get("hit_rate")
        entry["hit_rate_over_dynamo"] = round(hit / ref, 4) if hit is not None and ref else None
    return summary


def render_mocker_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary: hit rate (and its range over the runs), against the best possible and
    against Dynamo's at the same concurrency, router prediction, TTFT."""
    rows = []
    for entry in summary:
        head = [entry["config"], str(entry["concurrency"])]
        if not entry["runs"]:
            rows.append([*head, "failed", *[""] * 7])
            continue
        low, high = entry["hit_rate_min"], entry["hit_rate_max"]
        versus = entry["hit_rate_over_dynamo"]
        predicted = entry["router_predicted_hit_rate"]
        rows.append(
            [
                *head,
                f"{entry['hit_rate']:.3f}",
                f"{low:.3f}-{high:.3f}" if entry["runs"] > 1 else "",
                f"{entry['hit_rate_over_best']:.3f}",
                "-" if versus is None else f"{versus:.3f}",
                "-" if predicted is None else f"{predicted:.3f}",
                f"{entry['ttft_p50_ms']:.0f}",
                f"{entry['ttft_p90_ms']:.0f}",
                f"{entry['wall_s']:.1f}",
            ]
        )
    headers = [
        "config",
        "C",
        "hit rate",
        "range",
        "hit/best",
        "hit/dynamo",
        "predicted",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "wall s",
    ]
    return format_table(headers, rows)


def run_mocker(args: argparse.Namespace) -> int:
    """Build the workload, install the reference if asked for, measure every
    configuration at every concurrency, print the table and write the report."""
    run_began = time.perf_counter()
    workload = build_mocker_workload(args)
    shape = mocker_shape(args, workload)
    best = best_possible_hit_rate(workload.token_ids, BLOCK_SIZE)
    best_rr = best_possible_hit_rate(workload.token_ids, BLOCK_SIZE, workers=shape.workers)
    mean_len = statistics.fmean(len(ids) for ids in workload.token_ids)
    print(
        f"{len(workload.requests)} requests ({args.groups} tenants x {args.per_group}), "
        f"~{statistics.fmean(workload.prefix_tokens):.0f}-token prefixes, ~{mean_len:.0f} "
        f"prompt tokens each; {shape.workers} workers of {shape.kv_blocks} blocks of "
        f"{BLOCK_SIZE} (~{shape.kv_blocks * BLOCK_SIZE / mean_len:.1f} prompts each), "
        f"speed-up {shape.speed_up:g}; best possible hit rate {best:.3f} (round-robin, "
        f"unbounded caches: {best_rr:.3f})",
        file=sys.stderr,
        flush=True,
    )
    configs: list[StackConfig] = args.configs
    reference: Reference | None = None
    reference_info: dict[str, Any] = {"requested": any(c.reference for c in configs)}
    if reference_info["requested"]:
        reference, reason = reference_or_reason(args.reference_venv, sys.stderr)
        if reference is None:
            reference_info["unavailable"] = reason
            configs = [c for c in configs if not c.reference]
        else:
            reference_info |= {
                "version": reference.version,
                "venv": str(args.reference_venv),
                "install_s": reference.install_s,
            }
    phases = []
    with (
        log_dir("kv-mocker-bench-", keep=args.keep_logs) as logs,
        contextlib.ExitStack() as stack,
    ):
        print(f"logs in {logs}", file=sys.stderr, flush=True)
        nats_url = None
        if any(not c.reference for c in configs):
            nats_url = stack.enter_context(nats_server(logs)).url
        runs = [
            (repeat, config, concurrency)
            for repeat in range(args.repeats)
            for config in configs
            for concurrency in args.concurrency
        ]
        reference_failed = False
        for repeat, config, concurrency in runs:
            if config.reference and reference_failed:
                continue  # one failure says enough; do not wait for it again
            try:
                phase = run_mocker_phase(
                    args,
                    config,
                    concurrency,
                    shape,
                    workload,
                    index=len(phases),
                    logs=logs,
                    nats_url=nats_url,
                    reference=reference,
                )
            except (*FAILURES, aiohttp.ClientError, TimeoutError) as exc:
                if not config.reference:
                    raise
                # The reference failing must not cost us our own numbers.
                reference_failed = True
                text = ANSI_ESCAPE.sub("", str(exc))  # Dynamo's logs are coloured
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                reason = " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else repr(exc)
                phase = {
                    "config": config.label,
                    "stack": REFERENCE,
                    "concurrency": concurrency,
                    "error": reason[:400] + " (its later runs skipped)",
                    "error_detail": text[-3000:],  # the log directory may be gone
                }
            phase["repeat"] = repeat
            phases.append(phase)
            print(phase_line(phase, best), file=sys.stderr, flush=True)
    report = {
        "mode": "mocker",
        "config": {
            key: (
                str(value)
                if isinstance(value, Path)
                else [c.label for c in value]
                if key == "configs"
                else value
            )
            for key, value in vars(args).items()
        },
        **host_info(),
        "workload": {
            "requests": len(workload.requests),
            "tenants": args.groups,
            "per_tenant": args.per_group,
            "prefix_tokens_mean": round(statistics.fmean(workload.prefix_tokens), 1),
            "prompt_tokens_mean": round(mean_len, 1),
            "expected_prompt_tokens": sum(len(ids) for ids in workload.token_ids),
            "endpoint": "/v1/completions (streamed)",
            "shape": asdict(shape),
            "best_possible_hit_rate": round(best, 4),
            "best_possible_hit_rate_round_robin": round(best_rr, 4),
        },
        "reference": reference_info,
        "hit_rate_sources": HIT_RATE_SOURCES,
        "router_predicted_sources": PREDICTED_SOURCES,
        "summary": summarise_runs(phases, best),
        "phases": phases,
        "run_s": round(time.perf_counter() - run_began, 1),
    }
    if not args.samples:
        for phase in phases:
            phase.pop("samples", None)
    save_report(args.out, report)
    print(
        f"\nmocker scale{' (quick run)' if args.quick else ''}: best possible hit rate "
        f"{best:.3f}; {args.repeats} run(s) each, mean hit rate and range"
    )
    print(render_mocker_table(report["summary"]))
    print("hit rate: cached prompt tokens / prompt tokens as the workers reported them:")
    for stack_name in ("ours", REFERENCE):
        if any(p["stack"] == stack_name for p in phases):
            print(f"  {stack_name}: {HIT_RATE_SOURCES[stack_name]}")
    checks = [
        abs(p["metrics_hit_rate"] - p["prefix_cache_hit_rate"])
        for p in phases
        if p.get("metrics_hit_rate") is not None
    ]
    if checks:
        print(f"  ours vs our mocker's /metrics: largest difference {max(checks):.4f}")
    print("predicted: the router's own expectation:")
    for stack_name in ("ours", REFERENCE):
        if any(p["stack"] == stack_name for p in phases):
            print(f"  {stack_name}: {PREDICTED_SOURCES[stack_name]}")
    expected = report["workload"]["expected_prompt_tokens"]
    for phase in phases:
        if "error" not in phase and phase["prompt_tokens"] != expected:
            print(
                f"note: {phase['config']} C={phase['concurrency']} counted "
                f"{phase['prompt_tokens']} prompt tokens, this script {expected}",
                file=sys.stderr,
            )
    print(f"run time {report['run_s']:.0f}s", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); fills the quick or full shape of the
    chosen mode. Options of the mocker mode are refused without `--mocker` (and absent from
    the vLLM mode's report)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 groups x 6")
    parser.add_argument(
        "--groups", type=int, default=None, help="distinct shared prefixes (8; --mocker: 24)"
    )
    parser.add_argument("--per-group", type=int, default=None, help="requests per prefix (12)")
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=None,
        help="approx. prefix length (1000; --mocker: 800, tokenizer-counted)",
    )
    parser.add_argument(
        "--concurrency",
        default=None,
        help="requests in flight (1; 2 loads both workers; --mocker: a list, 16,64)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help=f"cap each worker's KV cache in blocks (default {DEFAULT_KV_BLOCKS}; 0: no cap; "
        "--mocker: from --worker-prefixes)",
    )
    parser.add_argument(
        "--kv-overlap-score-weight",
        type=float,
        default=None,
        help="the kv frontend's weight (the frontend's default, 2.0; --mocker: passed to our "
        "kv configs when given)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="per worker (4096; --mocker: 2048)"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle of the request order")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the JSON report (default: {RESULTS}; --mocker: {MOCKER_RESULTS})",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the log directory")
    mocker = parser.add_argument_group("mocker scale (--mocker)")
    mocker.add_argument(
        "--mocker", action="store_true", help="simulated workers at scale (see above)"
    )
    mocker.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated PRESET[:FLAGS] (default {MOCKER_CONFIGS}); presets: "
        + ", ".join(PRESETS),
    )
    mocker.add_argument("--workers", type=int, default=None, help="simulated workers (16)")
    mocker.add_argument(
        "--worker-prefixes",
        type=float,
        default=None,
        help="prompts one worker's KV cache holds (9): sets the cache's blocks",
    )
    mocker.add_argument("--speed-up", type=float, default=None, help="both mockers' speed-up (1)")
    mocker.add_argument(
        "--frontend-arg",
        action="append",
        default=None,
        metavar="FLAG",
        help="extra flag for each of our frontends (repeat; use --frontend-arg=--flag=value)",
    )
    mocker.add_argument(
        "--mocker-arg", action="append", default=None, metavar="FLAG", help="for our mocker"
    )
    mocker.add_argument(
        "--reference-arg",
        action="append",
        default=None,
        metavar="FLAG",
        help="extra flag for Dynamo's frontend (repeat)",
    )
    mocker.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each configuration and concurrency, interleaved, averaged (3; quick 1)",
    )
    mocker.add_argument(
        "--samples",
        action="store_const",
        const=True,
        default=None,
        help="keep every request's numbers in the JSON report (large)",
    )
    mocker.add_argument(
        "--reference-venv",
        type=Path,
        default=None,
        help=f"virtualenv of the reference (default {DEFAULT_VENV})",
    )
    args = parser.parse_args(argv)
    if args.mocker:
        return mocker_defaults(parser, args)
    given = [name for name in MOCKER_ONLY if getattr(args, name) is not None]
    if given:
        parser.error(f"--{given[0].replace('_', '-')} needs --mocker")
    for name in ("mocker", *MOCKER_ONLY):
        delattr(args, name)
    groups, per_group = QUICK_SHAPE if args.quick else FULL_SHAPE
    args.groups = groups if args.groups is None else args.groups
    args.per_group = per_group if args.per_group is None else args.per_group
    args.prefix_tokens = 1000 if args.prefix_tokens is None else args.prefix_tokens
    try:
        args.concurrency = 1 if args.concurrency is None else int(args.concurrency)
    except ValueError:
        parser.error(f"--concurrency {args.concurrency}: one number without --mocker")
    args.kv_blocks = DEFAULT_KV_BLOCKS if args.kv_blocks is None else args.kv_blocks
    if args.kv_overlap_score_weight is None:
        args.kv_overlap_score_weight = DEFAULT_OVERLAP_SCORE_WEIGHT
    args.max_model_len = 4096 if args.max_model_len is None else args.max_model_len
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
    args = parse_args(argv)
    return guarded(lambda: run_mocker(args) if getattr(args, "mocker", False) else run(args))


if __name__ == "__main__":
    sys.exit(main())
