"""Speculation adapted online, end to end: an n-gram worker with `--speculation-adapt`.

Claims, on the embedded model with the n-gram profile committed in benchmarks/results:
traffic whose answers repeat nothing of their prompts (n-gram finds no match, so nothing
is accepted) drives K to 0, after which vLLM's draft counter grows only by the chooser's
occasional one-token probes; traffic that asks to repeat a passage (n-gram drafts accept
well) brings K back and drafts grow with every step again; and greedy output is the same
as without speculation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dynamo.testing.http import http_post_json
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
REPETITIVE = [f"Repeat this sentence exactly, three times: {PASSAGE}"] * 4


@pytest.fixture(scope="module")
def stack(embedded_model: Path, nats_url: str, e2e_log_dir: Path) -> Iterator[tuple]:
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
    frontend = FrontendProcess("adaptive-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE)
    try:
        worker.wait_ready()
        frontend.wait_for_model(MODEL)
        yield worker, frontend
    finally:
        stop_all([frontend, worker])


def answers(frontend: FrontendProcess, prompts: list[str], temperature: float = 0.0) -> list[str]:
    def one(prompt: str) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": TOKENS,
            "temperature": temperature,
            "ignore_eos": True,
        }
        status, text = http_post_json(f"{frontend.base_url}/v1/chat/completions", body, 300)
        assert status == 200, text
        return json.loads(text)["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_k_falls_to_zero_on_unpredictable_text_and_comes_back_on_repetition(stack) -> None:
    worker, frontend = stack
    for _ in range(3):  # long enough for the window to forget the profile's acceptance
        answers(frontend, UNPREDICTABLE, temperature=2.0)
    before = SpecCounters.read(worker, K)
    answers(frontend, UNPREDICTABLE, temperature=2.0)
    quiet = SpecCounters.read(worker, K) - before
    print(f"unpredictable: {quiet.drafts:.0f} drafts over {len(UNPREDICTABLE) * TOKENS} tokens")
    for _ in range(2):
        answers(frontend, REPETITIVE)
    before = SpecCounters.read(worker, K)
    answers(frontend, REPETITIVE)
    busy = SpecCounters.read(worker, K) - before
    print(
        f"repetitive: {busy.drafts:.0f} drafts, acceptance length {busy.mean_acceptance_length:.2f}"
    )
    assert quiet.drafts < busy.drafts / 4
