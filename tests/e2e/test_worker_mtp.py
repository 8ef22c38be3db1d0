"""MTP (multi-token prediction) served end to end on the tiny MiMo-shaped target.

The target is built in the test (`tiny_mtp`): its transformer blocks add nothing to the
residual, so greedy decoding without speculation is a fixed walk through the vocabulary,
next(t) = argmax(lm_head @ embed[t]), computable from the weights alone. That walk is the
"no speculation" reference (one engine cannot serve the same request with speculation off;
the offline measurement in `tiny_mtp`'s docstring showed vLLM without speculation produces
the same walk).

Claims, through the frontend's /v1/completions:
1. native `--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'`: greedy
   text equals the walk, vLLM's accepted-draft counter grows, and the model card advertises
   method mtp with K=1 (the K the router counts speculative slots with);
2. a TensorRT-LLM-style `--extra-engine-args` file (`decoding_type: MTP`,
   `num_nextn_predict_layers: 1`) resolves to method mtp (`--dry-run`) and serves the same text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_mtp import build_tiny_mtp

from dynamo.llm.model_card import CardAdded, ModelCardWatcher
from dynamo.llm.protocols import ModelCard
from dynamo.runtime import DistributedRuntime
from dynamo.testing.http import http_post_json
from dynamo.testing.processes import FrontendProcess, WorkerProcess, cpu_engine_flags

MAX_MODEL_LEN = 512
MAX_TOKENS = 12
PROMPT = "Tell me a story about a cat."
MTP_TOKENS = 1
SERVED = "tiny-mtp"
NATIVE_SPEC = {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}
ENGINE_FILE = f"""\
# TensorRT-LLM form, translated by the worker to vLLM's native method mtp.
speculative_config:
  decoding_type: MTP
  num_nextn_predict_layers: {MTP_TOKENS}
"""


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Path:
    return build_tiny_mtp(tmp_path_factory.mktemp("mtp") / "tiny-mtp", embedded_model)


@pytest.fixture(scope="module")
def mtp_tokenizer(mtp_target: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(mtp_target))


def reference_walk(target: Path, last_prompt_token: int, count: int) -> list[int]:
    """Greedy tokens without speculation: every block of the tiny target is a no-op on the
    residual and RMS norm only rescales, so next(t) = argmax(lm_head @ embed[t])."""
    weights = load_file(str(target / "model.safetensors"))
    successor = torch.argmax(weights["model.embed_tokens.weight"] @ weights["lm_head.weight"].T, 1)
    tokens, token = [], last_prompt_token
    for _ in range(count):
        token = int(successor[token])
        tokens.append(token)
    return tokens


class Stack:
    """One MTP worker and a frontend over its own namespace."""

    def __init__(self, worker: WorkerProcess, frontend: FrontendProcess, model: str) -> None:
        self.worker = worker
        self.frontend = frontend
        self.model = model

    def complete(self, prompt: str) -> str:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        status, text = http_post_json(f"{self.frontend.base_url}/v1/completions", body)
        assert status == 200, text
        return json.loads(text)["choices"][0]["text"]


def start_stack(
    name: str, target: Path, nats_url: str, log_dir: Path, extra: list[str]
) -> Iterator[Stack]:
    namespace = f"e2e-{name}"
    worker = WorkerProcess(
        f"worker-{name}",
        target,
        nats_url,
        log_dir,
        namespace=namespace,
        engine_flags=cpu_engine_flags(MAX_MODEL_LEN),
        extra=["--served-model-name", SERVED, *extra],
    )
    frontend = FrontendProcess(f"frontend-{name}", nats_url, log_dir, namespace=namespace)
    try:
        worker.wait_ready()
        frontend.wait_for_model(SERVED)
        yield Stack(worker, frontend, SERVED)
    finally:
        frontend.stop()
        worker.stop()


@pytest.fixture(scope="module")
def native_stack(mtp_target: Path, nats_url: str, e2e_log_dir: Path) -> Iterator[Stack]:
    yield from start_stack(
        "mtp-native",
        mtp_target,
        nats_url,
        e2e_log_dir,
        ["--speculative-config", json.dumps(NATIVE_SPEC)],
    )


@pytest.fixture(scope="module")
def engine_file_stack(
    mtp_target: Path, nats_url: str, e2e_log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    path = tmp_path_factory.mktemp("mtp-engine") / "mtp.yaml"
    path.write_text(ENGINE_FILE)
    yield from start_stack(
        "mtp-file", mtp_target, nats_url, e2e_log_dir, ["--extra-engine-args", str(path)]
    )


def expected_text(target: Path, tokenizer) -> str:
    last = tokenizer(PROMPT)["input_ids"][-1]
    return tokenizer.decode(reference_walk(target, last, MAX_TOKENS), skip_special_tokens=True)


def spec_counters(worker: WorkerProcess) -> tuple[float, float, float]:
    """vLLM's (drafts, accepted draft tokens, accepted at position 0) counters."""
    return (
        worker.metric("vllm:spec_decode_num_drafts_total"),
        worker.metric("vllm:spec_decode_num_accepted_tokens_total"),
        worker.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total"),
    )


async def registered_card(runtime: DistributedRuntime, namespace: str) -> ModelCard:
    watcher = await ModelCardWatcher(runtime, namespace).start()

    async def first_card() -> ModelCard:
        async for event in watcher:
            if isinstance(event, CardAdded):
                return event.card
        raise AssertionError("the card watcher ended")

    try:
        return await asyncio.wait_for(first_card(), 10.0)
    finally:
        await watcher.close()


def test_native_mtp_greedy_equals_no_speculation_and_accepts(
    native_stack: Stack, mtp_target: Path, mtp_tokenizer
) -> None:
    worker = native_stack.worker
    before = spec_counters(worker)
    text = native_stack.complete(PROMPT)
    assert text == expected_text(mtp_target, mtp_tokenizer)
    drafts, accepted, first_position = (
        a - b for a, b in zip(spec_counters(worker), before, strict=True)
    )
    print(f"MTP K=1: drafts {drafts}, accepted {accepted}, accepted at position 0 {first_position}")
    assert drafts > 0
    # The tiny target's MTP layer agrees with the target: every draft is accepted.
    assert accepted == drafts == first_position


async def test_native_mtp_card_advertises_k(runtime, native_stack: Stack) -> None:
    card = await registered_card(runtime, native_stack.worker.namespace)
    assert card.speculative is not None
    assert card.speculative.method == "mtp"
    assert card.speculative.num_speculative_tokens == MTP_TOKENS


def test_engine_file_dry_run_resolves_to_mtp(mtp_target: Path, tmp_path: Path) -> None:
    from dynamo.vllm.args import parse_worker_args

    path = tmp_path / "mtp.yaml"
    path.write_text(ENGINE_FILE)
    cfg = parse_worker_args(
        ["--model", str(mtp_target), "--extra-engine-args", str(path), "--dry-run"]
    )
    assert cfg.speculative_config == {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}


def test_engine_file_mtp_serves_the_same_text(
    engine_file_stack: Stack, mtp_target: Path, mtp_tokenizer
) -> None:
    assert engine_file_stack.complete(PROMPT) == expected_text(mtp_target, mtp_tokenizer)
    assert engine_file_stack.worker.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
