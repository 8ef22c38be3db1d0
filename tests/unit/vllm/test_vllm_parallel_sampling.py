"""`n` > 1 on the vLLM worker: vLLM's parallel sampling (one request, n child sequences
sharing the prompt's KV) streamed as one stream of wire outputs tagged by `index`.

What vLLM 0.32 does (checked against the real engine, n-gram speculation on): in DELTA
mode a `RequestOutput` carries the new tokens of any of the n children, one
`CompletionOutput` each with its `index`; a child that finishes carries its own finish
reason; the request is `finished` with the last child's output. The handler turns every
`CompletionOutput` into its own wire output, gives each finished sequence its own usage,
and counts the request once. The fake `AsyncLLM` of test_vllm_handlers replays such
outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_vllm_handlers import PROMPT, FakeAsyncLLM, Worker, make_request
from vllm.outputs import CompletionOutput, RequestOutput

from dynamo.llm.protocols import FinishReason, SamplingOptions, WorkerType
from dynamo.runtime import InvalidRequestError


def child(index: int, token_ids: list[int], finish_reason: str | None = None) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text="",
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish_reason,
    )


def step(*children: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="engine-side-id",
        prompt=None,
        prompt_token_ids=list(PROMPT),
        prompt_logprobs=None,
        outputs=list(children),
        finished=finished,
        num_cached_tokens=0,
    )


THREE = SamplingOptions(n=3, temperature=0.8, seed=7)


async def test_n3_streams_each_sequence_with_its_index_finish_and_usage(tiny_model: Path) -> None:
    llm = FakeAsyncLLM(
        [
            step(child(0, [5]), child(1, [6]), child(2, [7])),
            step(child(0, [8, 9], "length"), child(1, [10])),
            step(child(1, [11], "stop"), child(2, [12, 13])),
            step(child(2, [14], "length"), finished=True),
        ]
    )
    worker = Worker(tiny_model, llm)
    outputs = await worker.run(make_request(sampling=THREE))

    assert worker.sent_params().n == 3, "one engine request asking for three sequences"
    assert [(o.index, o.token_ids) for o in outputs] == [
        (0, [5]), (1, [6]), (2, [7]), (0, [8, 9]), (1, [10]), (1, [11]), (2, [12, 13]), (2, [14]),
    ]  # fmt: skip
    finals = {o.index: o for o in outputs if o.finish_reason is not None}
    assert {i: o.finish_reason for i, o in finals.items()} == {
        0: FinishReason.LENGTH,
        1: FinishReason.EOS,
        2: FinishReason.LENGTH,
    }
    completion = {
        i: o.completion_usage.completion_tokens for i, o in finals.items() if o.completion_usage
    }
    assert completion == {0: 3, 1: 3, 2: 4}, "each sequence's own tokens"
    assert worker.counters.finished == {"length": 1}, "the request is counted once"
    assert worker.counters.in_flight == 0 and llm.aborted == []


async def test_a_cancel_ends_every_unfinished_sequence(tiny_model: Path) -> None:
    llm = FakeAsyncLLM([step(child(0, [5], "length"), child(1, [6]), child(2, [7]))], hang=False)
    worker = Worker(tiny_model, llm)
    outputs = await worker.run(make_request(sampling=THREE))  # the stream ends unfinished
    cancelled = [o for o in outputs if o.finish_reason is FinishReason.CANCELLED]
    assert sorted(o.index for o in cancelled) == [1, 2]
    assert [o.completion_usage.completion_tokens for o in cancelled if o.completion_usage] == [1, 1]
    assert llm.aborted == [worker.ctx.id]
    assert worker.counters.finished == {"cancelled": 1}


async def test_a_prefill_leg_runs_one_sequence(tiny_model: Path) -> None:
    llm = FakeAsyncLLM([step(child(0, [5], "length"), finished=True)])
    worker = Worker(tiny_model, llm, WorkerType.PREFILL, kv_connector="ExampleConnector")
    await worker.run(make_request(sampling=THREE))
    assert worker.sent_params().n == 1, "the decode leg samples the n sequences"


async def test_n_under_greedy_decoding_is_the_clients_error(tiny_model: Path) -> None:
    """vLLM refuses n > 1 at temperature 0 (every sequence would be the same): a 400 at
    the frontend, with vLLM's reason, before the engine is asked."""
    llm = FakeAsyncLLM([])
    worker = Worker(tiny_model, llm)
    with pytest.raises(InvalidRequestError, match="n must be 1 when using greedy sampling"):
        await worker.run(make_request(sampling=SamplingOptions(n=2, temperature=0.0)))
    assert llm.params == [] and worker.counters.finished == {"rejected": 1}
