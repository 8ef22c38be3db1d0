"""Beam search: what serving it costs here against vLLM's own server.

vLLM runs beam search in its OpenAI server, not in its engine: one single-token request
per live beam and step. This stack does the same in the frontend
(`dynamo.frontend.engine.beam_search`), so each step also crosses NATS to the worker and back.
This script measures what that costs, side by side in one run:

* both servers up at once with the same engine flags: `python -m
  vllm.entrypoints.openai.api_server`, and nats-server + `dynamo.vllm` + `dynamo.frontend`;
* `/v1/completions`, one request at a time, `max_tokens` tokens each with `ignore_eos`
  (every request does the same work on both), for greedy, then `use_beam_search` with
  each width of `--widths`;
* in rounds: each round sends every prompt to one server, then the other, the first of the
  pair alternating, so slow drift of the machine falls on both sides of a ratio; a round
  uses its own prompts, so no round is helped by another's prefix cache;
* reports the median seconds per request of each server and mode, the ratio this stack /
  vLLM, and each mode's cost against greedy on the same server.

Usage:

    .venv/bin/python benchmarks/beam_search_bench.py            # full run (~6 minutes)
    .venv/bin/python benchmarks/beam_search_bench.py --quick    # short smoke run

Prints a table and writes the raw numbers as JSON (`--json`, default
`benchmarks/results/beam_search.json` for full runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

from dynamo.testing.http import http_post_json
from harness import (
    CPU_ENGINE_FLAGS,
    BenchError,
    Stack,
    dynamo_stack,
    format_table,
    guarded,
    host_info,
    log_dir,
    resolve_model_arg,
    results_path,
    save_report,
    serving_parser,
    vllm_direct_stack,
    warn_if_busy,
)

SERVERS = ("vllm-direct", "dynamo")

# Short everyday openings: the search's cost is per step and beam, not per prompt token.
SUBJECTS = (
    "the history of the bicycle",
    "how bread rises",
    "why the sky is blue",
    "the rules of chess",
    "how a refrigerator works",
    "the life of honey bees",
    "what makes a good password",
    "how tides happen",
    "the first steam engines",
    "how vaccines train the body",
    "why leaves change colour",
    "how a compiler works",
)


@dataclass(frozen=True)
class Mode:
    """A way of decoding: greedy (`width` 0) or beam search with `width` beams."""

    width: int

    @property
    def name(self) -> str:
        return "greedy" if self.width == 0 else f"{self.width} beams"

    def body(self, served: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": served,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if self.width:
            body.update(use_beam_search=True, n=self.width)
        return body


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = serving_parser(
        __doc__, "beam_search.json", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--widths",
        default="2,4",
        help="comma-separated beam widths to measure beside greedy (default 2,4)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per request (default 32)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (default 3; --quick: 1)"
    )
    parser.add_argument(
        "--prompts", type=int, default=4, help="prompts per round (default 4; --quick: 2)"
    )
    args = parser.parse_args(argv)
    try:
        args.widths = [int(w) for w in args.widths.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--widths takes comma-separated integers, not {args.widths!r}")
    if not args.widths or any(w < 2 for w in args.widths):
        parser.error("--widths: every beam width must be at least 2")
    if args.quick:
        args.rounds, args.prompts = 1, 2
    if args.rounds < 1 or args.prompts < 1:
        parser.error("--rounds and --prompts must be at least 1")
    if args.rounds * args.prompts > len(SUBJECTS):
        parser.error(f"--rounds x --prompts may be at most {len(SUBJECTS)} (distinct prompts)")
    return args


def prompt_of(subject: str) -> str:
    return f"Here is a short explanation of {subject}, written for a curious reader:"


def timed_request(stack: Stack, body: dict[str, Any], timeout: float = 300.0) -> float:
    """Seconds one `/v1/completions` request took; a status other than 200 is an error."""
    start = time.perf_counter()
    status, text = http_post_json(f"{stack.base_url}/v1/completions", body, timeout)
    took = time.perf_counter() - start
    if status != 200:
        raise BenchError(f"{stack.base_url}: HTTP {status}: {text[:300]!r}")
    choices = json.loads(text).get("choices", [])
    want = body.get("n", 1)
    if len(choices) != want:
        raise BenchError(f"{stack.base_url}: {len(choices)} choices, not {want}")
    return took


@dataclass
class Timings:
    """Seconds per request, by server and mode name."""

    seconds: dict[str, dict[str, list[float]]]

    def median(self, server: str, mode: str) -> float:
        return statistics.median(self.seconds[server][mode])


def measure(
    stacks: dict[str, Stack], served: str, modes: list[Mode], args: argparse.Namespace
) -> Timings:
    """Every round: each mode, each prompt of the round, on both servers in turn."""
    seconds = {server: {m.name: [] for m in modes} for server in stacks}
    for r in range(args.rounds):
        subjects = SUBJECTS[r * args.prompts : (r + 1) * args.prompts]
        order = list(SERVERS) if r % 2 == 0 else list(reversed(SERVERS))
        for mode in modes:
            for server in order:
                stacks[server].check_alive()
                took = [
                    timed_request(stacks[server], mode.body(served, prompt_of(s), args.max_tokens))
                    for s in subjects
                ]
                seconds[server][mode.name].extend(took)
                print(
                    f"  round {r + 1}/{args.rounds} {mode.name:>8} {server:>11}: "
                    f"{statistics.median(took):.2f} s a request",
                    flush=True,
                )
    return Timings(seconds)


def table(timings: Timings, modes: list[Mode]) -> tuple[str, list[dict[str, Any]]]:
    rows, records = [], []
    greedy = {server: timings.median(server, "greedy") for server in SERVERS}
    for mode in modes:
        direct, ours = (timings.median(server, mode.name) for server in SERVERS)
        record = {
            "mode": mode.name,
            "vllm_direct_s": round(direct, 3),
            "dynamo_s": round(ours, 3),
            "ratio": round(ours / direct, 3),
            "vllm_direct_vs_greedy": round(direct / greedy["vllm-direct"], 2),
            "dynamo_vs_greedy": round(ours / greedy["dynamo"], 2),
        }
        records.append(record)
        rows.append(
            [
                mode.name,
                f"{direct:.2f} s ({record['vllm_direct_vs_greedy']:.1f}x greedy)",
                f"{ours:.2f} s ({record['dynamo_vs_greedy']:.1f}x greedy)",
                f"{record['ratio']:.2f}x",
            ]
        )
    headers = ["mode", "vLLM's server, s a request", "this stack, s a request", "ours / vLLM"]
    return format_table(headers, rows, align="<>>>"), records


def run(args: argparse.Namespace) -> int:
    model_dir, served = resolve_model_arg(args.model)
    modes = [Mode(0), *(Mode(w) for w in args.widths)]
    with log_dir("beam-search-bench-", keep=args.keep_logs) as logs, ExitStack() as up:
        print(
            f"model {served}; {args.max_tokens} tokens a request, ignore_eos; "
            f"{args.rounds} rounds of {args.prompts} prompts; logs in {logs}",
            flush=True,
        )
        warn_if_busy()
        stacks = {
            "vllm-direct": up.enter_context(
                vllm_direct_stack(model_dir, served, CPU_ENGINE_FLAGS, logs, args.start_timeout)
            ),
            "dynamo": up.enter_context(
                dynamo_stack(
                    model_dir,
                    served,
                    {"worker": []},
                    engine_flags=CPU_ENGINE_FLAGS,
                    namespace="beam-bench",
                    log_dir=logs,
                    timeout=args.start_timeout,
                )
            ),
        }
        timings = measure(stacks, served, modes, args)
    text, records = table(timings, modes)
    print("\nbeam search: this stack vs vLLM's own server")
    print(text)
    save_report(
        results_path(args, "beam_search.json"),
        {
            "host": host_info(),
            "model": served,
            "settings": {
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "prompts_per_round": args.prompts,
                "widths": args.widths,
                "engine_flags": list(CPU_ENGINE_FLAGS),
            },
            "rows": records,
            "seconds": asdict(timings)["seconds"],
        },
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
