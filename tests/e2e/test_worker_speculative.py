"""The vLLM worker over NATS with n-gram speculation, against one without speculation.

Claims: the worker serves `generate` over NATS; greedy output with speculation equals
greedy output without it; the worker's `/metrics` shows accepted draft tokens; the final
output carries per-request speculative statistics and usage.
"""

from __future__ import annotations

import uuid

import msgspec
import pytest
from e2e_prompts import chat_ids, greedy_request

from dynamo.llm.protocols import (
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.runtime import DistributedRuntime, ErrorKind, RemoteError
from dynamo.testing.processes import WorkerProcess
from dynamo.testing.waiting import wait_until_async

# Prompts that invite repetition, so the n-gram proposer finds matches in the context.
PROMPTS = [
    "Repeat this list exactly three times: apple, banana, cherry, apple, banana, cherry.",
    "What is the capital of Japan?",
    "Count from one to twenty in words, separated by commas.",
    "Write the sentence 'the cat sat on the mat' four times.",
]


async def generate(
    runtime: DistributedRuntime, worker: WorkerProcess, token_ids: list[int], max_tokens: int = 64
):
    endpoint = runtime.namespace(worker.namespace).component(worker.component)
    client = await endpoint.endpoint("generate").client()
    await client.wait_for_instances(timeout=30)
    req = greedy_request(token_ids, max_tokens, model="test")
    outputs: list[LLMEngineOutput] = []
    async for out in client.round_robin(req, response_type=LLMEngineOutput):
        outputs.append(out)
    return outputs


async def test_ngram_greedy_output_equals_no_speculation(
    runtime, ngram_worker, plain_worker, tokenizer
):
    multi_token_steps = 0
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        spec = await generate(runtime, ngram_worker, ids)
        plain = await generate(runtime, plain_worker, ids)
        spec_tokens = [t for o in spec for t in o.token_ids]
        plain_tokens = [t for o in plain for t in o.token_ids]
        assert spec_tokens == plain_tokens, (
            f"speculation changed greedy output for {prompt!r}:\n"
            f"spec : {tokenizer.decode(spec_tokens)!r}\nplain: {tokenizer.decode(plain_tokens)!r}"
        )
        assert spec[-1].finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
        multi_token_steps += sum(1 for o in spec if len(o.token_ids) > 1)
    # With speculation some steps deliver several accepted tokens at once.
    assert multi_token_steps > 0


async def test_tokyo_through_the_worker(runtime, ngram_worker, tokenizer):
    outputs = await generate(
        runtime, ngram_worker, chat_ids(tokenizer, "What is the capital of Japan?"), 32
    )
    text = tokenizer.decode([t for o in outputs for t in o.token_ids])
    assert "Tokyo" in text


# The lowest raw log-probability a token sampled at temperature 0.2 / top_p 0.9 can
# plausibly have. Measured on this model: at worst -3.3 with correct sampling; -18 to -29
# when vLLM-CPU's rejection sampler divided the logits by uninitialised memory (its
# expand_kernel fallback, repaired by dynamo.vllm.plugins.cpu_kernel_fixes).
LOWEST_PLAUSIBLE_LOGPROB = -10.0


async def test_sampled_tokens_under_speculation_are_plausible(runtime, ngram_worker, tokenizer):
    """Sampled (not greedy) requests with n-gram speculation draw their tokens from the
    model's distribution: no token the model itself finds all but impossible."""
    client = await runtime.namespace("e2e").component("spec").endpoint("generate").client()
    await client.wait_for_instances(timeout=30)
    ids = chat_ids(tokenizer, "What is the capital of France?")
    worst: list[float] = []
    drafted = 0
    for seed in range(4):
        req = PreprocessedRequest(
            request_id=str(uuid.uuid4()),
            model="test",
            token_ids=ids,
            sampling_options=SamplingOptions(temperature=0.2, top_p=0.9, seed=seed),
            stop_conditions=StopConditions(max_tokens=32),
            output_options=OutputOptions(logprobs=0),
        )
        outputs = [o async for o in client.round_robin(req, response_type=LLMEngineOutput)]
        logprobs = [lp.logprob for o in outputs for lp in (o.log_probs or [])]
        assert len(logprobs) == sum(len(o.token_ids) for o in outputs)
        worst.append(min(logprobs))
        stats = outputs[-1].spec_decode_stats
        drafted += stats.num_draft_tokens if stats is not None else 0
    assert drafted > 0, "the n-gram proposer drafted nothing: the sampler under test never ran"
    assert min(worst) >= LOWEST_PLAUSIBLE_LOGPROB, worst


async def test_final_output_has_usage_and_spec_stats(runtime, ngram_worker, tokenizer):
    ids = chat_ids(tokenizer, PROMPTS[0])
    outputs = await generate(runtime, ngram_worker, ids, 48)
    final = outputs[-1]
    produced = sum(len(o.token_ids) for o in outputs)
    assert final.completion_usage is not None
    assert final.completion_usage.prompt_tokens == len(ids)
    assert final.completion_usage.completion_tokens == produced
    stats = final.spec_decode_stats
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    # Each verification step with drafts yields its accepted drafts plus one target token;
    # steps where the proposer found nothing (and the prefill) yield one token each.
    assert produced >= stats.num_drafts + stats.num_accepted_tokens
    histogram = stats.acceptance_histogram
    assert histogram is not None and sum(histogram) == stats.num_drafts
    assert sum(j * n for j, n in enumerate(histogram)) == stats.num_accepted_tokens


async def test_metrics_show_accepted_draft_tokens(runtime, ngram_worker, tokenizer):
    await generate(runtime, ngram_worker, chat_ids(tokenizer, PROMPTS[3]), 48)
    assert ngram_worker.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
    assert ngram_worker.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    assert ngram_worker.metric("dynamo_worker_spec_decode_mean_acceptance_length") > 1.0


async def test_cancel_aborts_in_engine(runtime, ngram_worker, tokenizer):
    client = await runtime.namespace("e2e").component("spec").endpoint("generate").client()
    req = PreprocessedRequest(
        request_id=str(uuid.uuid4()),
        model="test",
        token_ids=chat_ids(tokenizer, "Tell me a very long story about dragons."),
        stop_conditions=StopConditions(max_tokens=1000, ignore_eos=True),
    )
    stream = client.round_robin(req, response_type=LLMEngineOutput)
    got = 0
    async for out in stream:
        got += len(out.token_ids)
        if got >= 5:
            break
    await stream.aclose()
    # The worker aborts it: the engine's running count returns to zero quickly.
    await wait_until_async(
        lambda: ngram_worker.metric("dynamo_worker_requests_in_flight") == 0,
        timeout=5,
        interval=0.1,
        what="the worker to abort the cancelled request",
    )


async def test_worker_exports_every_worker_metric_of_the_dashboard(
    runtime, ngram_worker, tokenizer
):
    """Each `dynamo_worker_*` and `vllm:*` name deploy/grafana/dashboards/dynamo.json
    queries is on a speculating worker's `/metrics` (the frontend's and mocker's names:
    tests/integration/deploy)."""
    from dynamo.testing.dashboard import VLLM_WORKER, exported_names, names_from
    from dynamo.testing.http import http_get

    await generate(runtime, ngram_worker, chat_ids(tokenizer, PROMPTS[0]), 16)
    status, text = http_get(ngram_worker.metrics_url)
    assert status == 200
    wanted = names_from(VLLM_WORKER)
    assert {
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "dynamo_worker_prompt_tokens_total",
    } <= wanted
    assert sorted(wanted - exported_names(text)) == []


async def test_min_p_is_refused_by_the_speculating_worker_not_ignored(
    runtime, ngram_worker, plain_worker, tokenizer
):
    """vLLM applies no min_p while it speculates (and refuses one); the speculating
    worker refuses it as the client's error before the engine, naming the field and the
    way out, and the worker without speculation serves it."""
    ids = chat_ids(tokenizer, "What is the capital of Japan?")
    request = msgspec.structs.replace(
        greedy_request(ids, 8, model="test"), sampling_options=SamplingOptions(min_p=0.2)
    )

    async def first_output(worker: WorkerProcess) -> LLMEngineOutput:
        endpoint = runtime.namespace(worker.namespace).component(worker.component)
        client = await endpoint.endpoint("generate").client()
        await client.wait_for_instances(timeout=30)
        async for out in client.round_robin(request, response_type=LLMEngineOutput):
            return out
        raise AssertionError("no output")

    with pytest.raises(RemoteError) as info:
        await first_output(ngram_worker)
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert "`min_p` is not applied by this worker: it speculates (ngram)" in info.value.message
    assert (await first_output(plain_worker)).token_ids


async def first_outputs(
    runtime, worker: WorkerProcess, request: PreprocessedRequest
) -> list[LLMEngineOutput]:
    endpoint = runtime.namespace(worker.namespace).component(worker.component)
    client = await endpoint.endpoint("generate").client()
    await client.wait_for_instances(timeout=30)
    return [out async for out in client.round_robin(request, response_type=LLMEngineOutput)]


def with_sampling(tokenizer, prompt: str, max_tokens: int, **fields) -> PreprocessedRequest:
    request = greedy_request(chat_ids(tokenizer, prompt), max_tokens, model="test")
    options = msgspec.structs.replace(request.sampling_options, **fields)
    return msgspec.structs.replace(request, sampling_options=options)


async def test_allowed_token_ids_restrict_the_output_with_and_without_speculation(
    runtime, ngram_worker, plain_worker, tokenizer
):
    """vLLM masks every other token, also in its rejection sampler when it verifies
    drafts: the n-gram worker's output stays inside the set too."""
    allowed = sorted(set(tokenizer.encode(" one two three four five", add_special_tokens=False)))
    request = with_sampling(tokenizer, "Count to ten.", 24, allowed_token_ids=allowed)
    for worker in (plain_worker, ngram_worker):
        tokens = [t for out in await first_outputs(runtime, worker, request) for t in out.token_ids]
        assert tokens and set(tokens) <= set(allowed), (worker.component, tokens)


async def test_logit_bias_steers_the_plain_worker_and_is_refused_by_the_speculating_one(
    runtime, ngram_worker, plain_worker, tokenizer
):
    (forced,) = tokenizer.encode(" banana", add_special_tokens=False)[:1]
    request = with_sampling(
        tokenizer, "What is the capital of Japan?", 6, logit_bias={forced: 100.0}
    )
    tokens = [
        t for out in await first_outputs(runtime, plain_worker, request) for t in out.token_ids
    ]
    assert tokens == [forced] * 6
    with pytest.raises(RemoteError) as info:
        await first_outputs(runtime, ngram_worker, request)
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert "`logit_bias` is not applied by this worker: it speculates (ngram)" in info.value.message


async def test_bad_words_are_never_generated_with_and_without_speculation(
    runtime, ngram_worker, plain_worker, tokenizer
):
    """vLLM bans a bad word's token sequence, and the same word after a space when that
    tokenizes to as many tokens (so " Tokyo", one token against two for "Tokyo", cannot be
    banned on this tokenizer: vLLM's rule, kept as it is). "capital" and " capital" are one
    token each: neither is generated, where the answer without the ban has one."""
    prompt = "What is the capital of Japan? Answer in one sentence."
    banned_ids = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("capital", " capital")}
    assert all(
        len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in ("capital", " capital")
    )
    plain = with_sampling(tokenizer, prompt, 16)
    free = [t for out in await first_outputs(runtime, plain_worker, plain) for t in out.token_ids]
    assert banned_ids & set(free), tokenizer.decode(free)
    banned = with_sampling(tokenizer, prompt, 16, bad_words=["capital"])
    for worker in (plain_worker, ngram_worker):
        tokens = [t for out in await first_outputs(runtime, worker, banned) for t in out.token_ids]
        assert tokens and not banned_ids & set(tokens), (worker.component, tokenizer.decode(tokens))


async def test_logprob_token_ids_are_reported_by_the_plain_worker_and_refused_by_the_other(
    runtime, ngram_worker, plain_worker, tokenizer
):
    """vLLM's `logprob_token_ids`: each generated position reports the sampled token and
    the chosen ones, and no others. While it speculates vLLM 0.32 reports them misaligned
    (its rejection sampler computes only top logprobs), so that worker refuses them."""
    chosen = tokenizer.encode(" yes no", add_special_tokens=False)
    request = msgspec.structs.replace(
        greedy_request(chat_ids(tokenizer, "Is Tokyo in Japan?"), 8, model="test"),
        output_options=OutputOptions(logprob_token_ids=chosen),
    )
    outputs = await first_outputs(runtime, plain_worker, request)
    entries = [lp for out in outputs for lp in out.log_probs or []]
    assert len(entries) == sum(len(out.token_ids) for out in outputs) > 0
    for entry in entries:
        assert {t.token_id for t in entry.top or []} == {entry.token_id, *chosen}, entry
        assert entry.logprob <= 0
    with pytest.raises(RemoteError) as info:
        await first_outputs(runtime, ngram_worker, request)
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert "`logprob_token_ids` is not applied by this worker: it speculates" in (
        info.value.message
    )
