"""Structured output overhead: output tokens/s with and without a JSON schema.

One stack (a private nats-server, one `dynamo.vllm` worker with the CPU engine flags, the
frontend), measured through /v1/chat/completions at concurrency 1 and 8 with the same
prompts twice: unconstrained, and with `response_format` `json_schema` (vLLM's structured
outputs, xgrammar compiling the schema and masking every step's logits on CPU). Greedy,
`max_tokens` fixed. The output lengths differ between the two (the schema ends the answer
when the JSON closes), so the comparison is in rates: aggregate output tokens/s, and per
request its decode rate (completion tokens after the first / time after the first token),
whose median says what the grammar costs each step; TTFT p50 includes compiling the schema
(cached by xgrammar after the first request with it).

Usage:

    .venv/bin/python benchmarks/structured_output_bench.py            # full run
    .venv/bin/python benchmarks/structured_output_bench.py --quick    # short smoke run

Full runs write benchmarks/results/structured_output.json (`--json` elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from dynamo.testing.chat_bodies import PEOPLE_TO_DESCRIBE
from harness import (
    CPU_ENGINE_FLAGS,
    dynamo_stack,
    guarded,
    log_dir,
    resolve_model_arg,
    results_path,
    serving_parser,
    stream_request,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 32},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
SUBJECTS = PEOPLE_TO_DESCRIBE
MAX_TOKENS = 128


@dataclass(frozen=True)
class Result:
    mode: str  # "free" or "json_schema"
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    decode_tokens_per_s_p50: float
    ttft_ms_p50: float


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, schema: bool
) -> tuple[int, float, float]:
    """(completion tokens, TTFT s, decode time s) of one streamed request."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Describe {prompt} as JSON."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA},
        }
    streamed = await stream_request(session, url, body)
    tokens = int(streamed.usage.get("completion_tokens") or 0)
    return tokens, streamed.ttft_s, streamed.latency_s - streamed.ttft_s


async def _measure(base: str, model: str, schema: bool, concurrency: int, n: int) -> Result:
    url = f"{base}/v1/chat/completions"
    prompts = [SUBJECTS[i % len(SUBJECTS)] + f" (#{i})" for i in range(n)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    samples: list[tuple[int, float, float]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            samples.append(await _one(session, url, model, queue.get_nowait(), schema))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _one(session, url, model, SUBJECTS[0], schema)  # warm-up (compiles the schema)
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    total = sum(s[0] for s in samples)
    decode = [(s[0] - 1) / s[2] for s in samples if s[0] > 1 and s[2] > 0]
    return Result(
        mode="json_schema" if schema else "free",
        concurrency=concurrency,
        requests=len(samples),
        output_tokens=total,
        wall_s=round(wall, 3),
        tokens_per_s=round(total / wall, 2),
        decode_tokens_per_s_p50=round(statistics.median(decode), 2) if decode else 0.0,
        ttft_ms_p50=round(statistics.median(s[1] for s in samples) * 1000, 1),
    )


def main() -> int:
    parser = serving_parser(__doc__, "structured_output.json")
    args = parser.parse_args()
    model_dir, served = resolve_model_arg(args.model)
    per_level = {1: 4, 8: 16} if args.quick else {1: 12, 8: 48}

    def body() -> int:
        results: list[Result] = []
        with log_dir("so-bench", keep=args.keep_logs) as logs:
            with dynamo_stack(
                model_dir,
                served,
                {"worker": []},
                engine_flags=CPU_ENGINE_FLAGS,
                namespace="sobench" + uuid.uuid4().hex[:6],
                log_dir=logs,
                timeout=args.start_timeout,
            ) as stack:
                for concurrency, n in per_level.items():
                    for schema in (False, True):
                        r = asyncio.run(_measure(stack.base_url, served, schema, concurrency, n))
                        results.append(r)
                        print(
                            f"  c={r.concurrency} {r.mode:<11} {r.tokens_per_s:8.1f} tok/s  "
                            f"decode p50 {r.decode_tokens_per_s_p50:6.1f} tok/s/req  "
                            f"TTFT p50 {r.ttft_ms_p50:7.1f} ms  ({r.output_tokens} tokens)",
                            flush=True,
                        )
        print("structured output vs free text (output tokens/s, json_schema / free)")
        for concurrency in per_level:
            free, constrained = (
                r for r in results if r.concurrency == concurrency
            )  # in order: free, json_schema
            ratio = constrained.tokens_per_s / free.tokens_per_s if free.tokens_per_s else 0.0
            print(f"  c={concurrency}: {ratio:.3f}")
        out = results_path(args, "structured_output.json")
        if out is not None:
            out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
            print(f"wrote {out}")
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
