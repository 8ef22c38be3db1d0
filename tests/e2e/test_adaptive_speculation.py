"""Speculation adapted online, end to end: an n-gram worker with `--speculation-adapt`
behind a frontend in `--router-mode kv`.

Claims, on the embedded model with the n-gram profile committed in benchmarks/results:
- traffic whose answers repeat nothing of their prompts (n-gram finds no match, so nothing
  is accepted) drives K to 0, after which vLLM's draft counter grows only by the chooser's
  occasional one-token probes;
- traffic that asks to repeat a passage (n-gram drafts accept well) brings K back, and
  drafts grow with every step again;
- the K in force reaches the KV router: at every moment sampled, each request in flight is
  booked with the K the worker last reported, and that K moved between 0 and more;
- greedy output is the target's own (`dynamo.testing.greedy`, against the session's
  worker without speculation).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.greedy import mismatch, reference_from_chat_logprobs
from dynamo.testing.http import http_get, http_post_json
from dynamo.testing.processes import FrontendProcess, WorkerProcess, cpu_engine_flags, stop_all
from dynamo.testing.spec_counters import SpecCounters

PROFILE = Path(__file__).parents[2] / "benchmarks" / "results" / "ngram.profile.json"
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
K = 3
NAMESPACE = "e2e-adaptive"
MODEL = "adaptive"
WINDOW_STEPS = 30
WARMUP_DRAFTS = 8
TOKENS = 64
REPEAT_TOKENS = 160  # the passage three times: room for the chooser's probes to find it
SAMPLE_EVERY_S = 0.1
END_OF_TURN = frozenset({b"<|im_end|>"})
UNPREDICTABLE = [
    "Invent a name for a new color and describe it in one sentence.",
    "Write a two-line poem about a lighthouse.",
    "Give three unusual uses for a paperclip.",
    "Describe the taste of rain to someone who never felt it.",
]
PASSAGE = (
    "The river bends twice before it reaches the old mill, where the water slows, "
    "turns green and deep, and the children of the village come to swim in summer."
)
REPEAT = f"Repeat this sentence exactly, three times: {PASSAGE}"
REPETITIVE = [REPEAT] * 4


@dataclass
class Stack:
    worker: WorkerProcess
    frontend: FrontendProcess
    plain: FrontendProcess  # the session's worker without speculation


@pytest.fixture(scope="module")
def stack(
    embedded_model: Path, plain_worker: WorkerProcess, nats_url: str, e2e_log_dir: Path
) -> Iterator[Stack]:
    worker = WorkerProcess(
        "adaptive-worker", embedded_model, nats_url, e2e_log_dir, namespace=NAMESPACE,
        engine_flags=cpu_engine_flags(),
        extra=[
            "--served-model-name", MODEL,
            "--speculative-config", json.dumps({**NGRAM, "num_speculative_tokens": K}),
            "--speculation-profile", str(PROFILE), "--speculation-adapt", "full",
            "--speculation-window", str(WINDOW_STEPS),
            "--speculation-warmup", str(WARMUP_DRAFTS),
        ],
    )  # fmt: skip
    started: list[WorkerProcess | FrontendProcess] = [worker]
    try:
        frontend = FrontendProcess(
            "adaptive-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE,
            extra=["--router-mode", "kv"],
        )  # fmt: skip
        started.append(frontend)
        plain = FrontendProcess(
            "adaptive-plain-frontend", nats_url, e2e_log_dir, namespace=plain_worker.namespace
        )
        started.append(plain)
        worker.wait_ready()
        frontend.wait_for_model(MODEL)
        plain.wait_for_model(DEFAULT_MODEL)
        yield Stack(worker, frontend, plain)
    finally:
        stop_all(reversed(started))


def chat(frontend: FrontendProcess, model: str, prompt: str, **extra: object) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": TOKENS,
        "temperature": 0.0,
        **extra,
    }
    status, text = http_post_json(f"{frontend.base_url}/v1/chat/completions", body, 300)
    assert status == 200, text
    return json.loads(text)["choices"][0]


def answers(frontend: FrontendProcess, prompts: list[str], **extra: object) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(lambda p: chat(frontend, MODEL, p, **extra)["message"]["content"], prompts)
        )


@dataclass
class RouterSamples:
    """What the KV router believed about the worker, sampled while traffic ran: the K the
    worker last reported, and the Ks the requests in flight were booked with."""

    reported: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def sample_router(frontend: FrontendProcess, stop: threading.Event, into: RouterSamples) -> None:
    while not stop.wait(SAMPLE_EVERY_S):
        status, text = http_get(f"{frontend.base_url}/debug/kv")
        if status != 200:
            continue
        for router in json.loads(text)["models"].get(MODEL, {}).values():
            for worker in router["workers"].values():
                load = worker["load"]
                reported = load.get("num_speculative_tokens") if load else None
                if reported is None:
                    continue
                into.reported.append(reported)
                booked = worker["booked_speculative_tokens"]
                if booked not in ([], [reported]):
                    into.mismatches.append(f"reported K={reported}, booked {booked}")


def sampled_while(frontend: FrontendProcess, traffic) -> RouterSamples:  # type: ignore[no-untyped-def]
    samples, stop = RouterSamples(), threading.Event()
    sampler = threading.Thread(target=sample_router, args=(frontend, stop, samples))
    sampler.start()
    try:
        traffic()
    finally:
        stop.set()
        sampler.join()
    return samples


def test_k_falls_to_zero_on_unpredictable_text_comes_back_on_repetition_and_the_router_follows(
    stack: Stack,
) -> None:
    def unpredictable() -> None:
        answers(stack.frontend, UNPREDICTABLE, temperature=2.0, ignore_eos=True)

    def repetitive() -> None:
        answers(stack.frontend, REPETITIVE, ignore_eos=True, max_tokens=REPEAT_TOKENS)

    for _ in range(3):  # long enough for the window to forget the profile's acceptance
        unpredictable()
    before = SpecCounters.read(stack.worker, K)
    low = sampled_while(stack.frontend, unpredictable)
    quiet = SpecCounters.read(stack.worker, K) - before
    print(f"unpredictable: {quiet.drafts:.0f} drafts over {len(UNPREDICTABLE) * TOKENS} tokens")
    repetitive()
    before = SpecCounters.read(stack.worker, K)
    high = sampled_while(stack.frontend, repetitive)
    busy = SpecCounters.read(stack.worker, K) - before
    print(
        f"repetitive: {busy.drafts:.0f} drafts, acceptance length {busy.mean_acceptance_length:.2f}"
    )
    print(f"K the router saw reported: low {sorted(Counter(low.reported).items())}, "
          f"high {sorted(Counter(high.reported).items())}")  # fmt: skip
    assert quiet.drafts < busy.drafts / 4
    # K = 0 while the batch is full; as it drains to one sequence, verifying drafts costs
    # almost nothing, and K may rise again: the samples hold both.
    assert 0 in low.reported
    assert max(high.reported) > 0
    assert not low.mismatches and not high.mismatches, low.mismatches + high.mismatches


def test_greedy_output_is_the_targets_own_whatever_k_runs(stack: Stack) -> None:
    prompts = [REPEAT, *UNPREDICTABLE]
    texts = answers(stack.frontend, prompts)
    for prompt, text in zip(prompts, texts, strict=True):
        choice = chat(
            stack.plain, DEFAULT_MODEL, prompt, logprobs=True, top_logprobs=20, ignore_eos=True
        )
        reference = reference_from_chat_logprobs(choice["logprobs"]["content"], END_OF_TURN)
        problem = mismatch(reference, text, stops=END_OF_TURN)
        assert problem is None, f"{prompt!r}: {problem}"
