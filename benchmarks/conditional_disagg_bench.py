"""Conditional disaggregation against always-remote prefill, side by side in one run.

One set of disaggregated workers (prefill and decode) and two frontends on it, one per
policy: `--disagg-prefill remote` (every prompt takes the prefill leg, as before the
policy existed) and `--disagg-prefill conditional` (the default: the decode worker
prefills short prompts, prompts it caches, and takes prefills off a saturated prefill
pool). Each policy runs the same shape of mixed workload in turn (`--rounds`, the order
alternating), with its own token salt so neither finds the other's prefixes cached, and
the same Poisson arrivals (open loop: a policy that serves faster is not sent more work,
so each class is compared at the same offered load):

* `short`: a short prompt (tens of tokens);
* `long_new`: a long prompt opening a new shared prefix (a "system prompt" of hundreds or
  thousands of tokens plus a question);
* `long_shared`: the same prefix with another question, sent after its group's first.

Printed per engine: TTFT p50/p90 per class and policy, the ratio conditional / remote
(below 1: conditional is faster), output tokens/s, and the frontend's decisions by
reason. Two fleets:

* `vllm`: one prefill and one decode `dynamo.vllm` worker (the CPU KV connector through a
  shared directory, as `launch/disagg.sh`);
* `mocker`: `dynamo.mocker` prefill and decode workers (two of each), whose KV transfer
  is simulated (docs/mocker.md).

`--sweep` (vLLM) measures what the default `--disagg-local-prefill-tokens` rests on: TTFT
against prompt length at one request at a time, remote against local prefill, fitted to
`a + b * tokens` each. A remote prefill adds `(a_r - a_l) + (b_r - b_l) * n` to the
request's TTFT and spares the decode worker `b_l * n` of computation (the stall its other
streams would see); the two are equal at `n* = (a_r - a_l) / (2 * b_l - b_r)`, the
break-even prompt length printed.

Usage:

    .venv/bin/python benchmarks/conditional_disagg_bench.py             # both fleets
    .venv/bin/python benchmarks/conditional_disagg_bench.py --engine mocker --quick
    .venv/bin/python benchmarks/conditional_disagg_bench.py --engine vllm --sweep
    .venv/bin/python benchmarks/conditional_disagg_bench.py --engine vllm --sweep --split-cores
    .venv/bin/python benchmarks/conditional_disagg_bench.py --engine mocker --rate 60 --queue-tokens 0,1024,4096

Full runs write benchmarks/results/conditional_disagg.json (`--json` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from dynamo.frontend.engine.prefill_policy import PrefillReason
from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.command_lines import worker_argv
from dynamo.testing.http import http_get, metric_values
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running
from harness import (
    CPU_ENGINE_FLAGS,
    ROOT,
    format_table,
    guarded,
    host_info,
    log_dir,
    nats_server,
    percentile,
    resolve_model_arg,
    save_report,
    split_cores,
    stream_request,
)

RESULTS_FILE = "conditional_disagg.json"
POLICIES = ("remote", "conditional")
CLASSES = ("short", "long_new", "long_shared")
DECISIONS = "dynamo_frontend_prefill_decisions_total"
FALLBACKS = "dynamo_frontend_prefill_fallbacks_total"
START_TIMEOUT_S = 300.0
VOCAB = (1000, 20000)  # token ids drawn from here: plain tokens of the embedded model


@dataclass(frozen=True)
class Shape:
    """One policy's workload and how it is sent."""

    groups: int  # shared prefixes
    repeats: int  # long_shared requests per prefix
    shorts: int
    long_tokens: int
    short_tokens: int
    question_tokens: int
    output_tokens: int
    rate: float  # requests per second, Poisson arrivals: the same offered load for each policy


# Rates below what the always-remote policy serves (open loop: a faster policy gets no
# more work, so every class is compared at the same load).
SHAPES = {
    ("vllm", False): Shape(6, 3, 24, 640, 40, 24, 32, 0.8),
    ("vllm", True): Shape(2, 2, 6, 640, 40, 24, 16, 0.8),
    ("mocker", False): Shape(24, 4, 96, 2048, 48, 32, 64, 24.0),
    ("mocker", True): Shape(6, 2, 16, 2048, 48, 32, 32, 16.0),
}


@dataclass(frozen=True)
class Request:
    kind: str
    token_ids: list[int]


def build_workload(shape: Shape, salt: int) -> list[Request]:
    """Every group's first long request, interleaved with half of the shorts, then the
    shared-prefix repeats interleaved with the other half: a repeat is sent after its
    group's first (under load it may still be in flight)."""
    rng = random.Random(salt)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    prefixes = [ids(shape.long_tokens - shape.question_tokens) for _ in range(shape.groups)]
    shorts = [Request("short", ids(shape.short_tokens)) for _ in range(shape.shorts)]
    firsts = [Request("long_new", p + ids(shape.question_tokens)) for p in prefixes]
    repeats = [
        Request("long_shared", p + ids(shape.question_tokens))
        for _ in range(shape.repeats)
        for p in prefixes
    ]
    half = len(shorts) // 2
    return interleave(firsts, shorts[:half]) + interleave(repeats, shorts[half:])


def interleave(a: Sequence[Request], b: Sequence[Request]) -> list[Request]:
    """`a` and `b` evenly mixed, in their own orders."""
    merged = [(i / max(1, len(a)), 0, r) for i, r in enumerate(a)]
    merged += [((i + 0.5) / max(1, len(b)), 1, r) for i, r in enumerate(b)]
    return [r for _, _, r in sorted(merged, key=lambda m: (m[0], m[1]))]


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Sample:
    kind: str
    ttft_s: float
    latency_s: float
    output_tokens: int
    cached_tokens: int


async def run_one(
    session: aiohttp.ClientSession, base: str, served: str, request: Request, max_tokens: int
) -> Sample:
    """One streamed completion of `request`'s token ids, `max_tokens` tokens exactly."""
    body = {
        "model": served,
        "prompt": request.token_ids,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streamed = await stream_request(session, f"{base}/v1/completions", body)
    return Sample(
        request.kind,
        streamed.ttft_s,
        streamed.latency_s,
        int(streamed.usage.get("completion_tokens") or 0),
        streamed.cached_tokens,
    )


async def run_all(
    base: str, served: str, requests: Sequence[Request], shape: Shape, seed: int
) -> tuple[list[Sample], float]:
    """The requests in order, arriving at `shape.rate` per second (exponential gaps drawn
    from `seed`), whatever is still in flight; (samples, wall seconds)."""
    gaps = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        due = 0.0
        tasks = []
        for request in requests:
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(
                run_one(session, base, served, request, shape.output_tokens)
            ))  # fmt: skip
            due += gaps.expovariate(shape.rate)
        samples = await asyncio.gather(*tasks)
        return list(samples), time.perf_counter() - start


def decisions(frontend: FrontendProcess) -> dict[str, float]:
    """The frontend's prefill decisions so far, by reason (those made at least once)."""
    _, text = http_get(f"{frontend.base_url}/metrics")
    counts = {
        r.value: sum(metric_values(text, DECISIONS, {"reason": r.value})) for r in PrefillReason
    }
    return {reason: n for reason, n in counts.items() if n}


def fallbacks(frontend: FrontendProcess) -> float:
    _, text = http_get(f"{frontend.base_url}/metrics")
    return sum(metric_values(text, FALLBACKS, {}))


def measure_policies(
    frontends: dict[str, FrontendProcess],
    names: Sequence[str],
    served: str,
    shape: Shape,
    rounds: int,
) -> dict[str, dict[str, Any]]:
    """Each named frontend's runs, `rounds` times, the order reversed every other round
    (so neither policy always runs first), every run with a token salt of its own; per
    frontend, the pooled per-class TTFT, throughput and the decisions made."""
    before = {name: (decisions(frontends[name]), fallbacks(frontends[name])) for name in names}
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    walls = dict.fromkeys(names, 0.0)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else list(reversed(names)):
            print(f"  round {round_ + 1}/{rounds}: {name}", flush=True)
            salt = 1000 * (round_ + 1) + names.index(name)
            requests = build_workload(shape, salt)
            base = frontends[name].base_url
            got, wall = asyncio.run(run_all(base, served, requests, shape, seed=round_))
            samples[name] += got
            walls[name] += wall
    return {
        name: summarise(samples[name], walls[name], frontends[name], *before[name])
        for name in names
    }


def summarise(
    samples: Sequence[Sample],
    wall: float,
    frontend: FrontendProcess,
    decided_before: dict[str, float],
    fell_before: float,
) -> dict[str, Any]:
    """Per-class TTFT, throughput, and the decisions since `decided_before`."""
    by_class: dict[str, dict[str, float]] = {}
    for kind in CLASSES:
        ttfts = [s.ttft_s for s in samples if s.kind == kind]
        if ttfts:
            by_class[kind] = {
                "requests": len(ttfts),
                "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
                "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
            }
    decided = decisions(frontend)
    return {
        "classes": by_class,
        "output_tokens_per_s": round(sum(s.output_tokens for s in samples) / wall, 2),
        "wall_s": round(wall, 2),
        "cached_tokens": sum(s.cached_tokens for s in samples),
        "decisions": {k: n - decided_before.get(k, 0.0) for k, n in sorted(decided.items())},
        "fallbacks": fallbacks(frontend) - fell_before,
    }


# --------------------------------------------------------------------------- fleets


@contextmanager
def fleet(
    engine: str,
    model_dir: Path,
    logs: Path,
    *,
    pin: bool = False,
    variants: dict[str, list[str]] | None = None,
) -> Iterator[dict[str, FrontendProcess]]:
    """NATS, the disaggregated workers of `engine`, and one frontend per policy (kv
    router mode) and per extra variant (name -> its frontend flags), until every frontend
    routes to the prefill workers. `pin` (vLLM): the prefill engine on half of the cores,
    the decode engine on the other half."""
    namespace = f"cond-{engine}"
    logs.mkdir(parents=True, exist_ok=True)
    with nats_server(logs) as nats, running([]) as procs:
        prefill_workers = 1 if engine == "vllm" else 2
        cores = split_cores() if pin and engine == "vllm" else {}
        for role, argv in worker_commands(engine, model_dir, nats.url, namespace).items():
            env = {"DYN_KV_SHARED_STORAGE_PATH": str(logs / "kv-transfer"), **cores.get(role, {})}
            procs.append(ManagedProcess(f"{engine}-{role}", argv, logs, env, cwd=ROOT))
        frontend_flags = {
            **{policy: ["--disagg-prefill", policy] for policy in POLICIES},
            # --sweep's reference: the decode worker prefills every prompt.
            "local": ["--disagg-local-prefill-tokens", "1000000"],
            **(variants or {}),
        }
        frontends: dict[str, FrontendProcess] = {}
        for name, flags in frontend_flags.items():
            frontends[name] = FrontendProcess(
                f"{namespace}-frontend-{name}", nats.url, logs, namespace=namespace,
                extra=["--router-mode", "kv", *flags], cwd=ROOT,
            )  # fmt: skip
            procs.append(frontends[name])
        for frontend in frontends.values():
            frontend.wait_for_model(DEFAULT_MODEL, timeout=START_TIMEOUT_S)
            frontend.wait_kv_router_workers(
                DEFAULT_MODEL, f"{namespace}/prefill/generate", prefill_workers
            )
        yield frontends


def worker_commands(
    engine: str, model_dir: Path, nats_url: str, namespace: str
) -> dict[str, list[str]]:
    """Role ("prefill", "decode") -> the argv of that role's worker process."""
    roles = {"prefill": "--is-prefill-worker", "decode": "--is-decode-worker"}
    if engine == "vllm":
        return {
            role: worker_argv(model_dir, nats_url, namespace, CPU_ENGINE_FLAGS, flag)
            for role, flag in roles.items()
        }
    mocker = ["--num-workers", "2", "--block-size", "32", "--num-gpu-blocks", "4096"]
    return {
        role: mocker_argv(model_dir, nats_url, namespace, *mocker, flag)
        for role, flag in roles.items()
    }


# --------------------------------------------------------------------------- sweep


SWEEP_LENGTHS = (32, 64, 128, 256, 512, 1024)


def sweep(frontends: dict[str, FrontendProcess], served: str, repeats: int) -> dict[str, Any]:
    """TTFT at one request at a time, remote against local prefill, per prompt length."""
    rows: dict[str, dict[int, float]] = {"remote": {}, "local": {}}
    rng = random.Random(7)
    for n in SWEEP_LENGTHS:
        for policy in rows:
            requests = [Request("sweep", [rng.randrange(*VOCAB) for _ in range(n)])
                        for _ in range(repeats)]  # fmt: skip
            samples = asyncio.run(one_at_a_time(frontends[policy].base_url, served, requests))
            rows[policy][n] = round(sorted(s.ttft_s for s in samples)[len(samples) // 2], 4)
            print(f"  sweep {policy:6} {n:5} tokens: TTFT p50 {rows[policy][n] * 1000:.0f} ms")
    fits = {policy: fit_line(rows[policy]) for policy in rows}
    (a_r, b_r), (a_l, b_l) = fits["remote"], fits["local"]
    denominator = 2 * b_l - b_r
    break_even = (a_r - a_l) / denominator if denominator > 0 else None
    return {
        "ttft_p50_s": {p: {str(n): v for n, v in r.items()} for p, r in rows.items()},
        "fit": {
            p: {"a_s": round(a, 5), "b_s_per_token": round(b, 7)} for p, (a, b) in fits.items()
        },
        "break_even_tokens": round(break_even) if break_even is not None else None,
    }


async def one_at_a_time(base: str, served: str, requests: Sequence[Request]) -> list[Sample]:
    """Each request after the previous one ended, one output token each."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return [await run_one(session, base, served, r, 1) for r in requests]


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares `a + b * x` through `points`."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - b * mean_x, b


# --------------------------------------------------------------------------- report


def render(engine: str, result: dict[str, Any]) -> str:
    remote, conditional = result["remote"], result["conditional"]
    rows = []
    for kind in CLASSES:
        r, c = remote["classes"].get(kind), conditional["classes"].get(kind)
        if r is None or c is None:
            continue
        rows.append([
            kind, str(r["requests"]),
            *(f"{r[k] * 1000:.0f} / {c[k] * 1000:.0f} ms ({c[k] / r[k]:.2f}x)"
              for k in ("ttft_p50_s", "ttft_p90_s")),
        ])  # fmt: skip
    rows.append([
        "output tok/s", "",
        f"{remote['output_tokens_per_s']:.1f} / {conditional['output_tokens_per_s']:.1f} "
        f"({conditional['output_tokens_per_s'] / remote['output_tokens_per_s']:.2f}x)", "",
    ])  # fmt: skip
    table = format_table(["class", "n", "TTFT p50 remote / cond", "TTFT p90 remote / cond"], rows)
    lines = [f"== {engine}: always-remote vs conditional prefill", table]
    for policy in POLICIES:
        made = ", ".join(f"{k} {v:.0f}" for k, v in result[policy]["decisions"].items())
        lines.append(f"  {policy} decisions: {made}; fallbacks {result[policy]['fallbacks']:.0f}")
    return "\n".join(lines)


def render_variants(result: dict[str, Any], names: Sequence[str]) -> str:
    """TTFT p50/p90 per class and throughput of each conditional variant."""
    rows = []
    for name in names:
        classes = result[name]["classes"]
        cells = [
            f"{classes[k]['ttft_p50_s'] * 1000:.0f} / {classes[k]['ttft_p90_s'] * 1000:.0f}"
            for k in CLASSES
        ]
        busy = result[name]["decisions"].get("prefill_pool_busy", 0)
        rows.append([name, *cells, f"{result[name]['output_tokens_per_s']:.1f}", f"{busy:.0f}"])
    headers = ["frontend", *(f"{k} p50 / p90 ms" for k in CLASSES), "tok/s", "pool busy"]
    return "--disagg-prefill-queue-tokens variants (conditional)\n" + format_table(headers, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("vllm", "mocker", "both"), default="both",
                        help="Which fleet to measure (default: both, mocker first).")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="A small smoke-sized workload.")
    parser.add_argument("--sweep", action="store_true",
                        help="vLLM: also measure TTFT against prompt length, remote vs local, "
                        "and print the break-even prompt length.")  # fmt: skip
    parser.add_argument("--sweep-repeats", type=int, default=5,
                        help="Requests per prompt length and policy in --sweep.")  # fmt: skip
    parser.add_argument("--split-cores", action="store_true",
                        help="vLLM: the prefill engine on half of the cores, the decode "
                        "engine on the other half (see docs/disaggregation.md: two engines "
                        "on the same cores slow each other for about a second after each "
                        "burst of work).")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2,
                        help="Runs of the workload per frontend, alternating the order "
                        "(default 2; their samples are pooled).")  # fmt: skip
    parser.add_argument("--rate", type=float, default=None,
                        help="Requests per second (default: the engine's, below what the "
                        "always-remote policy serves; raise it to saturate the prefill pool).")  # fmt: skip
    parser.add_argument("--queue-tokens", type=lambda t: [int(v) for v in t.split(",")],
                        default=[], metavar="N,N,...",
                        help="Mocker: also run conditional frontends with these "
                        "--disagg-prefill-queue-tokens values (0: the rule off), each with "
                        "a workload of its own, and print them side by side.")  # fmt: skip
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Model (the embedded default).")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"Where to write the numbers (full runs: benchmarks/results/{RESULTS_FILE}).")  # fmt: skip
    parser.add_argument("--keep-logs", action="store_true", help="Keep the process logs.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, served = resolve_model_arg(args.model)
    engines = ("mocker", "vllm") if args.engine == "both" else (args.engine,)
    report: dict[str, Any] = {"host": host_info(), "quick": args.quick}
    with log_dir("conditional-disagg", args.keep_logs) as logs:
        for engine in engines:
            shape = SHAPES[(engine, args.quick)]
            if args.rate is not None:
                shape = replace(shape, rate=args.rate)
            print(f"[{engine}] starting the fleet ({asdict(shape)})", flush=True)
            result: dict[str, Any] = {
                "shape": asdict(shape), "split_cores": args.split_cores, "rounds": args.rounds,
            }  # fmt: skip
            pin = args.split_cores and engine == "vllm"
            variants = {  # mocker only: a vLLM fleet on two cores is too slow for it
                f"queue={tokens}": ["--disagg-prefill-queue-tokens", str(tokens)]
                for tokens in (args.queue_tokens if engine == "mocker" else [])
            }
            with fleet(engine, model_dir, logs / engine, pin=pin, variants=variants) as frontends:
                names = [*POLICIES, *variants]
                result.update(measure_policies(frontends, names, served, shape, args.rounds))
                if args.sweep and engine == "vllm":
                    result["sweep"] = sweep(frontends, served, args.sweep_repeats)
            print(render(engine, result), flush=True)
            if variants:
                print(render_variants(result, ["conditional", *variants]), flush=True)
            if "sweep" in result:
                print(f"  break-even prompt length: {result['sweep']['break_even_tokens']} tokens")
            report[engine] = result
    path = args.json or (None if args.quick else ROOT / "benchmarks" / "results" / RESULTS_FILE)
    save_report(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(lambda: main(sys.argv[1:])))
