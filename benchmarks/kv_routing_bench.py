"""KV-aware routing vs round-robin on a shared-prefix workload, two real vLLM workers.

One run starts a private nats-server, two `python -m dynamo.vllm` workers on the embedded
model and two frontends over the *same* workers: one in `--router-mode kv`, one in
`round-robin`. The workload is `--groups` long system prompts (one per "tenant"), each
asked `--per-group` different questions, sent in a fixed shuffled order with
`--concurrency` streams in flight. Each mode runs on cold caches (both workers'
`clear_kv_blocks` is called before each phase), kv first.

Reported per mode: time to first token (p50, p90), end-to-end latency (p50) and the
prefix-cache hit rate the workers report (cached prompt tokens / prompt tokens, from each
response's usage); for kv also the router's predicted hit rate (`GET /debug/kv`).
The headline numbers are the p50 TTFT ratio kv / round-robin (below 1: kv is faster) and
the two hit rates. Results go to benchmarks/results/kv_routing.json.

    .venv/bin/python benchmarks/kv_routing_bench.py [--groups 8] [--per-group 4]
        [--prefix-tokens 1000] [--kv-blocks N]

`--kv-blocks` caps each worker's KV cache (vLLM `--num-gpu-blocks-override`): with a
cache too small for every prefix on every worker, round-robin thrashes while kv keeps
each prefix on one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dynamo.runtime import DistributedRuntime
from dynamo.runtime.nats_server import NatsServer

NAMESPACE = "bench-kv"
COMPONENT = "backend"
MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results" / "kv_routing.json"
START_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Child:
    """A child process logging to a file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"{self.name} exited:\n" + "\n".join(tail))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def worker_argv(nats_url: str, kv_blocks: int | None, max_model_len: int) -> list[str]:
    argv = [
        sys.executable, "-m", "dynamo.vllm",
        "--model", MODEL,
        "--namespace", NAMESPACE,
        "--component", COMPONENT,
        "--nats-server", nats_url,
        "--enforce-eager",
        "--block-size", "32",
        "--max-model-len", str(max_model_len),
        "--seed", "0",
    ]  # fmt: skip
    if kv_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(kv_blocks)]
    return argv


def frontend_argv(nats_url: str, port: int, mode: str, overlap_weight: float) -> list[str]:
    argv = [
        sys.executable, "-m", "dynamo.frontend",
        "--http-host", "127.0.0.1",
        "--http-port", str(port),
        "--namespace", NAMESPACE,
        "--nats-server", nats_url,
        "--router-mode", mode,
    ]  # fmt: skip
    if mode == "kv":
        argv += ["--kv-overlap-score-weight", str(overlap_weight)]
    return argv


@dataclass
class Cluster:
    """The processes of one run and the frontends' base URLs by router mode."""

    children: list[Child]
    bases: dict[str, str]

    def check_alive(self) -> None:
        for child in self.children:
            child.check_alive()


@contextlib.contextmanager
def cluster(args: argparse.Namespace, nats_url: str, log_dir: Path) -> Iterator[Cluster]:
    """Two workers and one frontend per router mode, all stopped on exit."""
    children: list[Child] = []
    try:
        argv = worker_argv(nats_url, args.kv_blocks, args.max_model_len)
        children += [Child(f"worker{i}", argv, log_dir) for i in range(2)]
        ports = {"kv": free_port(), "round-robin": free_port()}
        children += [
            Child(
                f"frontend-{mode}",
                frontend_argv(nats_url, port, mode, args.kv_overlap_score_weight),
                log_dir,
            )
            for mode, port in ports.items()
        ]
        yield Cluster(children, {mode: f"http://127.0.0.1:{p}" for mode, p in ports.items()})
    finally:
        for child in reversed(children):
            child.stop()
        print(f"logs in {log_dir}", file=sys.stderr)


async def wait_ready(base: str, running: Cluster) -> None:
    """Until the frontend routes to both workers (fails fast if a process died)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            running.check_alive()
            with contextlib.suppress(aiohttp.ClientError, KeyError, ValueError):
                async with session.get(f"{base}/health") as resp:
                    body = await resp.json(content_type=None)
                    if len(body["models"].get(MODEL, {}).get("instances", [])) == 2:
                        return
            await asyncio.sleep(1)
    raise TimeoutError(f"{base} not ready after {START_TIMEOUT_S}s")


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    group: int
    question: str
    system: str


def build_workload(groups: int, per_group: int, prefix_tokens: int, seed: int) -> list[Request]:
    """`groups` distinct long system prompts × `per_group` questions, shuffled so that
    neither router sees a group's requests at regular positions."""
    words_per_fact = 12  # about 14 tokens per sentence below
    facts = max(1, prefix_tokens // (words_per_fact + 2))
    requests = []
    for g in range(groups):
        body = " ".join(
            f"Record {i} of tenant {g}: value {(g * 7919 + i * 104729) % 100000} is on file."
            for i in range(facts)
        )
        system = f"You are the assistant of tenant {g}. Use only these records. {body}"
        for q in range(per_group):
            requests.append(Request(g, f"Question {q}: what is record {q * 3 + 1}?", system))
    random.Random(seed).shuffle(requests)
    return requests


@dataclass
class Sample:
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
                    raise RuntimeError(f"worker {instance_id:x} did not clear: {result}")
        await client.close()
    finally:
        await runtime.shutdown(drain_timeout=1.0)


async def router_view(base: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/debug/kv") as resp:
        routers = (await resp.json(content_type=None))["models"][MODEL]
    return routers[f"{NAMESPACE}/{COMPONENT}/generate"]


# --------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarise(samples: list[Sample]) -> dict[str, float]:
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


async def measure(args: argparse.Namespace, nats_url: str, running: Cluster) -> dict[str, Any]:
    """Warm both engines, then the workload through each router on cold caches."""
    bases = running.bases
    for base in bases.values():
        await wait_ready(base, running)
    workload = build_workload(args.groups, args.per_group, args.prefix_tokens, args.seed)
    warmup = [Request(-1, f"Warm-up {i}.", "You are terse.") for i in range(4)]
    await run_phase(bases["round-robin"], warmup, 2, 4)  # both engines warm
    results: dict[str, Any] = {}
    for mode in ("kv", "round-robin"):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    parser.add_argument("--per-group", type=int, default=4, help="requests per prefix")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="approx. prefix length")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--kv-blocks", type=int, default=None, help="cap each worker's KV cache")
    parser.add_argument(
        "--kv-overlap-score-weight", type=float, default=1.0, help="the kv frontend's weight"
    )
    parser.add_argument("--max-model-len", type=int, default=4096, help="per worker")
    parser.add_argument("--seed", type=int, default=0, help="shuffle of the request order")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="kv-bench-"))
    with NatsServer() as nats, cluster(args, nats.url, log_dir) as running:
        results = asyncio.run(measure(args, nats.url, running))
    kv, rr = results["kv"], results["round-robin"]
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "ttft_p50_ratio_kv_over_round_robin": round(kv["ttft_p50_ms"] / rr["ttft_p50_ms"], 3),
        "ttft_mean_ratio_kv_over_round_robin": round(kv["ttft_mean_ms"] / rr["ttft_mean_ms"], 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for mode_results in report["results"].values():
        mode_results.pop("samples", None)  # in the file, not on the screen
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
