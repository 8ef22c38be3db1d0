"""The Eagle3 head shipped for the embedded model, and the tool that trains heads, end to end.

Three engines on the real embedded model, each behind its own frontend:
- the target alone (no speculation; the session's shared worker): the greedy reference;
- the target with the shipped head (`smollm2-135m-instruct-eagle3`, prepared by `make
  setup`), K=3, named by the head's name in `--speculative-config`;
- the target with a head the training tool has just made in a short smoke run, started as
  `--model <checkpoint>` (the worker reads the speculators config: the checkpoint's
  verifier, an embedded model's name, becomes the target).

Claims: on the tool's held-out prompts (topics the training prompts never use) the shipped
head's greedy output is the target's own, and its mean acceptance length at K=3, from the
worker's `vllm:spec_decode_*` counters, is at least 1.8 (per-position acceptance printed);
the smoke run finishes, its loss falls, and vLLM serves its checkpoint, with the same greedy
text as the target alone.

"The target's own" is checked as bf16 allows (`dynamo.testing.greedy`): every answer equals
the target's, or parts from it only at a token where the speculating engine took one of the
target's listed alternatives that the target itself put within rounding (0.5 nats) of its own
choice. Verification runs
the target over K + 1 positions at once, and on CPUs whose vLLM kernels use AMX that rounds
differently from one-token steps; the number of answers that part so is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynamo.llm.models import DEFAULT_MODEL, model_dir
from dynamo.testing.command_lines import cpu_engine_flags
from dynamo.testing.greedy import (
    ReferenceToken,
    assert_same_greedy,
    reference_from_chat_logprobs,
    reference_text,
)
from dynamo.testing.http import http_post_json
from dynamo.testing.processes import FrontendProcess, WorkerProcess, stop_all
from dynamo.testing.spec_counters import SpecCounters
from dynamo.vllm.training.eagle3.prompts import held_out

HEAD = "smollm2-135m-instruct-eagle3"
K = 3
MIN_ACCEPTANCE_LENGTH = 1.8
# The training tool's own held-out evaluation set: its 64 default held-out prompts, answers
# up to its default 192 tokens. The head's recipe.json estimates acceptance on the same set.
PROMPTS = held_out(64)
MAX_TOKENS = 192
CONCURRENCY = 16  # the engine's --max-num-seqs
# The embedded model's end-of-turn token, as the chat API lists it among the top tokens:
# an answer may stop where the target went on, at a tie like any other token.
END_OF_TURN = frozenset({b"<|im_end|>"})
MAX_MODEL_LEN = 1024
SMOKE_TIMEOUT_S = 300
SMOKE_ARGS = [
    "--num-prompts", "16", "--held-out", "4", "--max-answer-tokens", "32",
    "--draft-vocab", "1024", "--epochs", "30", "--time-budget", "0.5", "--batch-tokens", "2048",
]  # fmt: skip


@dataclass
class Served:
    worker: WorkerProcess
    frontend: FrontendProcess
    model: str


@dataclass
class Stacks:
    plain: Served
    shipped: Served
    smoke: Served


@pytest.fixture(scope="module")
def shipped_worker(nats_url: str, e2e_log_dir: Path) -> Iterator[WorkerProcess]:
    """The target with the shipped head. Started, not waited for: `stacks` asks for it
    before `smoke_run`, so the engine loads while the smoke run trains."""
    spec = json.dumps({"method": "eagle3", "model": HEAD, "num_speculative_tokens": K})
    worker = WorkerProcess(
        "worker-eagle3-shipped", "smollm2-135m-instruct", nats_url, e2e_log_dir,
        namespace="e2e-eagle3-shipped", engine_flags=cpu_engine_flags(MAX_MODEL_LEN),
        extra=["--served-model-name", "shipped", "--speculative-config", spec],
    )  # fmt: skip
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Path:
    """A short training run of the tool on a handful of bundled prompts."""
    out = tmp_path_factory.mktemp("eagle3-smoke") / "head"
    argv = [sys.executable, "-m", "dynamo.vllm.train_eagle3",
            "--target", "smollm2-135m-instruct", "--out", str(out), *SMOKE_ARGS]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def stacks(
    shipped_worker: WorkerProcess,
    smoke_run: Path,
    plain_worker: WorkerProcess,
    nats_url: str,
    e2e_log_dir: Path,
) -> Iterator[Stacks]:
    """Each worker behind a frontend of its own; the reference is the session's worker
    without speculation (its longer context does not change a greedy answer)."""
    started: list[WorkerProcess | FrontendProcess] = []
    try:
        smoke = WorkerProcess(
            "worker-eagle3-smoke", str(smoke_run), nats_url, e2e_log_dir,
            namespace="e2e-eagle3-smoke", engine_flags=cpu_engine_flags(MAX_MODEL_LEN),
            extra=["--served-model-name", "smoke"],
        )  # fmt: skip
        started.append(smoke)
        for worker in (shipped_worker, smoke):
            worker.wait_ready()
        models = {"plain": DEFAULT_MODEL, "shipped": "shipped", "smoke": "smoke"}
        workers = {"plain": plain_worker, "shipped": shipped_worker, "smoke": smoke}
        served = {}
        for name, worker in workers.items():
            frontend = FrontendProcess(
                f"frontend-eagle3-{name}", nats_url, e2e_log_dir, namespace=worker.namespace
            )
            started.append(frontend)
            frontend.wait_for_model(models[name])
            served[name] = Served(worker, frontend, models[name])
        yield Stacks(**served)
    finally:
        stop_all(reversed(started))


def chat(served: Served, prompt: str, top_logprobs: int | None = None) -> dict:
    """The response's first choice; with `top_logprobs`, its token log-probabilities too,
    generated past the end-of-turn token (`ignore_eos`) so that its position's alternatives
    are listed (the reference is cut there)."""
    body = {
        "model": served.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    if top_logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": top_logprobs, "ignore_eos": True}
    status, text = http_post_json(f"{served.frontend.base_url}/v1/chat/completions", body, 300)
    assert status == 200, text
    return json.loads(text)["choices"][0]


def answers(served: Served, prompts: list[str]) -> list[str]:
    """Up to a full engine batch at a time, answers in prompt order."""
    with ThreadPoolExecutor(min(CONCURRENCY, len(prompts))) as pool:
        return list(pool.map(lambda p: chat(served, p)["message"]["content"], prompts))


@pytest.fixture(scope="module")
def reference(stacks: Stacks) -> list[list[ReferenceToken]]:
    """The target's greedy answers, each token with its best 20 alternatives, up to and
    including its end-of-turn token (with the alternatives it beat)."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        choices = list(pool.map(lambda p: chat(stacks.plain, p, top_logprobs=20), PROMPTS))
    tokens = [reference_from_chat_logprobs(c["logprobs"]["content"], END_OF_TURN) for c in choices]
    for choice, answer in zip(choices, tokens, strict=True):
        assert choice["message"]["content"].startswith(reference_text(answer))
    return tokens


def test_the_shipped_head_keeps_greedy_output_and_accepts_enough(
    stacks: Stacks, reference: list[str]
) -> None:
    before = SpecCounters.read(stacks.shipped.worker, K)
    texts = answers(stacks.shipped, PROMPTS)
    grown = SpecCounters.read(stacks.shipped.worker, K) - before
    per_position = ", ".join(f"{p:.3f}" for p in grown.acceptance_per_position)
    print(
        f"shipped Eagle3 head, K={K}, {len(PROMPTS)} held-out prompts x {MAX_TOKENS} tokens: "
        f"{grown.drafts:.0f} drafts, {grown.accepted:.0f} accepted, mean acceptance length "
        f"{grown.mean_acceptance_length:.3f}, accepted per position [{per_position}]"
    )
    assert_same_greedy(PROMPTS, texts, reference, END_OF_TURN)
    assert grown.mean_acceptance_length >= MIN_ACCEPTANCE_LENGTH


def test_the_shipped_head_is_prepared_next_to_the_model() -> None:
    config = json.loads((model_dir(HEAD) / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(model_dir("smollm2-135m-instruct"))
    assert (model_dir(HEAD) / "recipe.json").is_file()


def test_a_smoke_training_run_learns_and_vllm_serves_its_head(
    smoke_run: Path, stacks: Stacks, reference: list[str]
) -> None:
    recipe = json.loads((smoke_run / "recipe.json").read_text())
    print(f"smoke run: loss {recipe['loss']}, held-out {recipe['held_out']}")
    assert recipe["loss"]["last"] < recipe["loss"]["first"]
    assert recipe["target"] == "smollm2-135m-instruct"
    before = SpecCounters.read(stacks.smoke.worker, K)
    texts = answers(stacks.smoke, PROMPTS[:4])
    assert_same_greedy(
        PROMPTS[:4], texts, reference[:4], END_OF_TURN
    )  # lossless, however weak the head
    assert (SpecCounters.read(stacks.smoke.worker, K) - before).drafts > 0
