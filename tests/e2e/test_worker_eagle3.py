"""The worker with an Eagle3 draft in speculators format, passed as `--model`.

The target and draft are built in the test (tiny, random but agreeing weights, see
`tiny_eagle3`). Claims: the worker swaps in the verifier as target and serves it over
NATS with Eagle3 speculation running (drafts proposed and accepted, visible in the final
output's statistics, in several tokens per step, and in vLLM's `/metrics` series); the
model card advertises eagle3 with the checkpoint's K and the draft; the command line's
`--max-model-len` (512, the target's own limit is 2048) is the served context length and
vLLM applies it to the draft as well.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from e2e_prompts import chat_ids, greedy_request
from tiny_eagle3 import SPECULATIVE_TOKENS, build_pair

from dynamo.llm.model_card import CardAdded, ModelCardWatcher
from dynamo.llm.protocols import (
    FinishReason,
    LLMEngineOutput,
    ModelCard,
)
from dynamo.runtime import DistributedRuntime, RemoteError
from dynamo.testing.command_lines import cpu_engine_flags
from dynamo.testing.processes import WorkerProcess

NAMESPACE = "e2e-eagle3"  # apart from the shared workers, so no frontend test sees it
COMPONENT = "eagle3"
MAX_MODEL_LEN = 512
PROMPT = "Say something, anything at all."


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path):
    """(target, speculators checkpoint) built for this module."""
    return build_pair(tmp_path_factory.mktemp("eagle3"), embedded_model)


@pytest.fixture(scope="module")
def eagle3_worker(eagle3_pair, nats_url: str, e2e_log_dir: Path):
    _, checkpoint = eagle3_pair
    worker = WorkerProcess(
        "worker-eagle3",
        checkpoint,
        nats_url,
        e2e_log_dir,
        namespace=NAMESPACE,
        component=COMPONENT,
        engine_flags=cpu_engine_flags(MAX_MODEL_LEN),
    )
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


async def generate(runtime: DistributedRuntime, token_ids: list[int], max_tokens: int):
    client = await runtime.namespace(NAMESPACE).component(COMPONENT).endpoint("generate").client()
    await client.wait_for_instances(timeout=30)
    request = greedy_request(token_ids, max_tokens, model="target", ignore_eos=True)
    return [out async for out in client.round_robin(request, response_type=LLMEngineOutput)]


async def registered_card(runtime: DistributedRuntime, timeout: float = 10.0) -> ModelCard:
    """The model card the Eagle3 worker registered."""
    watcher = await ModelCardWatcher(runtime, NAMESPACE).start()

    async def first_card() -> ModelCard:
        async for event in watcher:
            if isinstance(event, CardAdded) and event.card.component == COMPONENT:
                return event.card
        raise AssertionError("the card watcher ended")

    try:
        return await asyncio.wait_for(first_card(), timeout)
    finally:
        await watcher.close()


async def test_eagle3_speculates_over_nats(runtime, eagle3_worker, tokenizer) -> None:
    ids = chat_ids(tokenizer, PROMPT)
    outputs = await generate(runtime, ids, max_tokens=48)
    final = outputs[-1]
    produced = [t for out in outputs for t in out.token_ids]
    assert final.finish_reason is FinishReason.LENGTH
    assert len(produced) == 48
    # The tiny target repeats the last prompt token; the draft was built to agree.
    assert set(produced) == {ids[-1]}
    stats = final.spec_decode_stats
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_draft_tokens == stats.num_drafts * SPECULATIVE_TOKENS
    assert stats.num_accepted_tokens > 0
    # Accepted drafts arrive together with the target's own token: K+1 tokens in a step.
    assert max(len(out.token_ids) for out in outputs) == SPECULATIVE_TOKENS + 1
    assert eagle3_worker.metric("vllm:spec_decode_num_drafts_total") >= stats.num_drafts
    assert eagle3_worker.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
    assert eagle3_worker.metric("dynamo_worker_spec_decode_mean_acceptance_length") > 1.0


async def test_model_card_advertises_eagle3_and_the_cli_context_length(
    runtime, eagle3_worker, eagle3_pair
) -> None:
    target, checkpoint = eagle3_pair
    card = await registered_card(runtime)
    assert card.name == target.name  # the verifier is the served model
    assert card.source_path == str(target)
    assert card.context_length == MAX_MODEL_LEN
    assert card.speculative is not None
    assert card.speculative.method == "eagle3"
    assert card.speculative.num_speculative_tokens == SPECULATIVE_TOKENS
    assert card.speculative.draft_model == str(checkpoint)
    # The worker turns vLLM's drop of a hit's last block off for Eagle3 (see below).
    assert not card.speculative.drops_last_prefix_block


async def test_a_prefix_hit_is_reused_whole_as_the_card_says(
    runtime, eagle3_worker, tokenizer
) -> None:
    """vLLM would recompute the last block of a prefix hit for an Eagle3 drafter; the
    worker turns that off (`disable_eagle_block_drop`, docs/speculative_decoding.md) and
    its card says so: a 165-token prompt sent twice spans 5 full blocks of 32, and the
    second request reuses all 5, what the KV router predicts for this card."""
    text = " ".join(f"Item {i} of the inventory is a box of apples." for i in range(40))
    ids = tokenizer(text)["input_ids"][:165]
    assert len(ids) == 165
    first = await generate(runtime, ids, max_tokens=2)
    second = await generate(runtime, ids, max_tokens=2)
    cached = [
        outputs[-1].completion_usage.prompt_tokens_details.cached_tokens
        for outputs in (first, second)
    ]
    assert cached == [0, 5 * 32]


async def test_prompt_beyond_the_cli_context_length_is_refused(
    runtime, eagle3_worker, tokenizer
) -> None:
    ids = chat_ids(tokenizer, PROMPT)
    too_long = (ids * (MAX_MODEL_LEN // len(ids) + 1))[: MAX_MODEL_LEN + 1]
    with pytest.raises(RemoteError, match=r"maximum context length is 512 tokens"):
        await generate(runtime, too_long, max_tokens=1)


def test_cli_max_model_len_reaches_target_and_draft(eagle3_pair) -> None:
    """What the worker hands vLLM (the configuration `--dry-run` prints), built into vLLM's
    own engine configuration: the draft's limit follows the command line, not its config."""
    from vllm.usage.usage_lib import UsageContext

    from dynamo.vllm.config.args import parse_worker_args
    from dynamo.vllm.config.report import resolved_config_yaml

    target, checkpoint = eagle3_pair
    cfg = parse_worker_args(
        ["--model", str(checkpoint), "--max-model-len", str(MAX_MODEL_LEN), "--dry-run"]
    )
    dry_run = resolved_config_yaml(cfg)
    assert f"max_model_len: {MAX_MODEL_LEN}" in dry_run
    assert "max_model_len: cli" in dry_run
    vllm_config = cfg.engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert vllm_config.model_config.model == str(target)
    assert vllm_config.model_config.max_model_len == MAX_MODEL_LEN
    spec = vllm_config.speculative_config
    assert spec.method == "eagle3"
    assert spec.draft_model_config.model == str(checkpoint)
    assert spec.draft_model_config.max_model_len == MAX_MODEL_LEN
