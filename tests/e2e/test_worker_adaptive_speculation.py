"""Adaptive speculation (`--speculation-adapt full`) end to end on the embedded model.

One worker runs what `make run` runs (the n-gram preset, the profile shipped for the
embedded model, adaptation on; a short window so that the test moves K in seconds), behind
a frontend in KV mode. The session's worker without speculation gives the greedy reference.

Claims:
- low-acceptance traffic (sampled at temperature 2: n-gram's drafts are almost never the
  token drawn) drives K to 0, in the worker's `/metrics` and in the K its load reports give
  the router; from then on vLLM's draft counter grows only by the scheduler's probes (one
  draft token per sequence after 50 steps at K=0), against about one draft token per
  generated token at the preset's static K;
- high-acceptance traffic (greedy requests to repeat a passage) brings K back;
- the greedy answers served while K moved are the target's own (as bf16 allows:
  `dynamo.testing.greedy`);
- every `/debug/kv` sample taken meanwhile books each request in flight on the worker with
  the K the worker last reported;
- a request that turns speculation off for itself is not drafted for beside requests that
  are (its per-request statistics say so).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_engines import NGRAM_SPEC, REPO

from dynamo.testing.command_lines import cpu_engine_flags
from dynamo.testing.greedy import (
    ReferenceToken,
    assert_same_greedy,
    reference_from_chat_logprobs,
)
from dynamo.testing.http import http_get, http_post_json, kv_router_view, metric_values
from dynamo.testing.processes import FrontendProcess, WorkerProcess

NAMESPACE = "e2e-adaptive"
COMPONENT = "adaptive"
ENDPOINT = f"{NAMESPACE}/{COMPONENT}/generate"
MODEL = "smollm2-135m-instruct"
PROFILE = REPO / "engine_configs" / "profiles" / MODEL / "ngram.profile.json"
ADAPT_FLAGS = [
    "--speculation-profile", str(PROFILE), "--speculation-adapt", "full",
    "--speculation-window", "30", "--speculation-warmup", "16",
]  # fmt: skip
CONCURRENCY = 4
HARD_TOKENS = 64
REPEAT_TOKENS = 96
PHASE_TIMEOUT_S = 240.0
END_OF_TURN = frozenset({b"<|im_end|>"})
HARD_PROMPTS = [
    json.loads(line)["prompt"]
    for line in (REPO / "benchmarks" / "prompts" / "hard.jsonl").read_text().splitlines()[:16]
]
REPEAT_PROMPTS = [
    json.loads(line)["prompt"]
    for line in (REPO / "benchmarks" / "prompts" / "repeat_edit.jsonl").read_text().splitlines()
][:CONCURRENCY]
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
STEPS_AT_K = "dynamo_worker_spec_decode_k_steps_total"


@dataclass
class Stack:
    worker: WorkerProcess
    frontend: FrontendProcess
    plain_frontend: FrontendProcess


@pytest.fixture(scope="module")
def stack(
    embedded_model: Path, nats_url: str, e2e_log_dir: Path, plain_worker: WorkerProcess
) -> Iterator[Stack]:
    worker = WorkerProcess(
        "worker-adaptive", embedded_model, nats_url, e2e_log_dir,
        namespace=NAMESPACE, component=COMPONENT, engine_flags=cpu_engine_flags(),
        extra=["--speculative-config", json.dumps(NGRAM_SPEC), *ADAPT_FLAGS],
    )  # fmt: skip
    frontends = [
        FrontendProcess(
            "adaptive-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE,
            extra=["--router-mode", "kv"],
        ),
        FrontendProcess("adaptive-plain-frontend", nats_url, e2e_log_dir,
                        namespace=plain_worker.namespace),
    ]  # fmt: skip
    try:
        worker.wait_ready()
        for frontend in frontends:
            frontend.wait_for_model(MODEL)
        frontends[0].wait_kv_router_workers(MODEL, ENDPOINT, 1)
        yield Stack(worker, *frontends)
    finally:
        for proc in (*frontends, worker):
            proc.stop()


def chat_reply(frontend: FrontendProcess, prompt: str, **fields: object) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **fields}
    status, text = http_post_json(f"{frontend.base_url}/v1/chat/completions", body, 300)
    assert status == 200, text
    return json.loads(text)


def chat(frontend: FrontendProcess, prompt: str, **fields: object) -> dict:
    """The reply's first choice."""
    return chat_reply(frontend, prompt, **fields)["choices"][0]


def hard_round(frontend: FrontendProcess, round_index: int) -> None:
    """One batch of sampled requests whose drafts n-gram almost never gets accepted."""
    prompts = [HARD_PROMPTS[(round_index * CONCURRENCY + i) % len(HARD_PROMPTS)]
               for i in range(CONCURRENCY)]  # fmt: skip
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda p: chat(frontend, p, temperature=2.0, max_tokens=HARD_TOKENS,
                                     ignore_eos=True), prompts))  # fmt: skip


def repeat_round(frontend: FrontendProcess) -> list[str]:
    """The repeat prompts, greedy, all at once: their answers."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(lambda p: chat(frontend, p, temperature=0.0,
                                            max_tokens=REPEAT_TOKENS)["message"]["content"],
                             REPEAT_PROMPTS))  # fmt: skip


def worker_k(worker: WorkerProcess) -> int:
    (k,) = metric_values(http_get(worker.metrics_url)[1], "dynamo_worker_spec_decode_k")
    return int(k)


@dataclass
class RouterSamples:
    """`/debug/kv` of the adaptive worker, sampled in the background: the K it reported and
    the Ks its requests in flight were booked with, per sample."""

    frontend: FrontendProcess
    samples: list[tuple[int, list[int]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            (view,) = kv_router_view(self.frontend.base_url, MODEL, ENDPOINT)["workers"].values()
            self.samples.append((view["num_speculative_tokens"], view["booked_speculative_tokens"]))
            time.sleep(0.05)

    def reported_k(self) -> int:
        (view,) = kv_router_view(self.frontend.base_url, MODEL, ENDPOINT)["workers"].values()
        return int(view["num_speculative_tokens"])


def drive_until(traffic: Callable[[int], object], done: Callable[[], bool], what: str) -> int:
    """Rounds of `traffic` until `done()` holds after one; how many rounds it took."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    rounds = 0
    while True:
        traffic(rounds)
        rounds += 1
        if done():
            return rounds
        assert time.monotonic() < deadline, f"{what}: not after {rounds} rounds"


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[list[ReferenceToken]]:
    """The target's greedy answers to the repeat prompts, with their top 20 alternatives."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        choices = list(pool.map(lambda p: chat(stack.plain_frontend, p, temperature=0.0,
                                               max_tokens=REPEAT_TOKENS, logprobs=True,
                                               top_logprobs=20, ignore_eos=True),
                                REPEAT_PROMPTS))  # fmt: skip
    return [reference_from_chat_logprobs(c["logprobs"]["content"], END_OF_TURN) for c in choices]


def test_k_follows_acceptance_and_the_router_books_the_workers_k(
    stack: Stack, reference: list[list[ReferenceToken]]
) -> None:
    worker, frontend = stack.worker, stack.frontend
    router = RouterSamples(frontend)
    sampler = threading.Thread(target=router.run, daemon=True)
    sampler.start()
    try:
        # 1. Traffic n-gram cannot predict: K falls to 0 in the worker and in its reports.
        rounds = drive_until(
            lambda i: hard_round(frontend, i),
            lambda: worker_k(worker) == 0 and router.reported_k() == 0,
            "K did not fall to 0 under low-acceptance traffic",
        )
        print(f"K = 0 after {rounds} rounds of {CONCURRENCY} x {HARD_TOKENS} sampled tokens")
        # 2. At K = 0 only the probes draft.
        drafts, steps = worker.metric(DRAFT_TOKENS), worker.metric(STEPS_AT_K)
        at_zero = worker.metric(STEPS_AT_K, k="0")
        for i in range(2):
            hard_round(frontend, rounds + i)
        generated = 2 * CONCURRENCY * HARD_TOKENS
        drafted = worker.metric(DRAFT_TOKENS) - drafts
        steps_run = worker.metric(STEPS_AT_K) - steps
        zero_share = (worker.metric(STEPS_AT_K, k="0") - at_zero) / steps_run
        print(f"at K = 0: {drafted:.0f} draft tokens for {generated} generated tokens, "
              f"{zero_share:.0%} of {steps_run:.0f} steps at K = 0")  # fmt: skip
        assert drafted <= 0.1 * generated, "drafting went on at K = 0"
        assert zero_share >= 0.8
        # 3. Traffic n-gram predicts well: K comes back, and the answers stay the target's.
        answers: list[list[str]] = []
        rounds = drive_until(
            lambda _: answers.append(repeat_round(frontend)),
            lambda: worker.metric(DRAFT_TOKENS) - drafts > generated and router.reported_k() > 0,
            "K did not come back under high-acceptance traffic",
        )
        print(f"K = {router.reported_k()} reported after {rounds} rounds of repeat prompts")
    finally:
        router.stop.set()
        sampler.join(10)
    for texts in answers:
        assert_same_greedy(REPEAT_PROMPTS, texts, reference, END_OF_TURN)
    # 4. The router booked every request in flight with the K the worker last reported.
    reported = {k for k, _ in router.samples}
    assert {0} < reported, f"the reported K never moved: {reported}"
    busy = [(k, booked) for k, booked in router.samples if booked]
    assert busy, "no sample saw a request in flight"
    for k, booked in busy:
        assert booked == [k], f"requests booked with K {booked} while the worker reported {k}"
    print(f"{len(router.samples)} router samples, {len(busy)} with requests in flight, "
          f"reported K in {sorted(reported)}")  # fmt: skip


def test_a_request_can_turn_speculation_off_on_an_adaptive_worker(stack: Stack) -> None:
    """`"speculative_decoding": false` beside speculated requests of the same kind: the
    adaptive scheduler drops that request's drafts (its statistics say none) and drafts for
    the others while their acceptance pays (the previous test left K above 0)."""
    fields = {"temperature": 0.0, "max_tokens": REPEAT_TOKENS, "return_spec_stats": True}
    opt_out = [False] + [True] * (CONCURRENCY - 1)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(pool.map(
            lambda i: chat_reply(stack.frontend, REPEAT_PROMPTS[i],
                                 **fields, speculative_decoding=opt_out[i]),
            range(CONCURRENCY),
        ))  # fmt: skip
    stats = [reply["metrics"]["speculative_decoding"] for reply in replies]
    print("draft tokens per request:", [s["num_draft_tokens"] for s in stats])
    assert (stats[0]["num_spec_steps"], stats[0]["num_draft_tokens"]) == (0, 0)
    assert replies[0]["usage"]["completion_tokens"] > 0
    assert any(s["num_draft_tokens"] > 0 for s in stats[1:])
