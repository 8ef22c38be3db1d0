"""The vLLM worker's `generate` handler (`dynamo.vllm.serving.handlers`) over a fake `AsyncLLM`.

Claims:
* aggregated: every step's tokens are streamed, the last output carries the finish reason
  and the usage (cached prompt tokens from vLLM's `num_cached_tokens`), the counters are
  updated, and the engine gets the request's sampling fields with the model's defaults
  filling only what the request leaves out;
* prefill: the engine runs one token with `do_remote_decode`, the tokens are withheld, and
  the transfer parameters are the connector's own or a by-prompt marker naming it;
* decode: the prefill worker's parameters reach the connector and are counted;
* a client cancel (the context stopped) or the runtime closing or cancelling the stream
  aborts the request in vLLM and counts it cancelled;
* a dead engine ends the stream with an error output and reports the death once;
* parameters vLLM refuses (its `SamplingParams` or the engine itself) end the request as
  the client's error with vLLM's one-line reason and nothing of vLLM's repr, counted as
  `rejected`; a full engine queue refuses it as overloaded (another worker may take it);
* on a decode worker the KV transfer entry of the prompt is held while the request runs
  and deleted as consumed when it ends.

The handler runs over a real `VllmEngine` that is never started (its model directory holds
only a `config.json`); its `llm` is a fake that replays real vLLM `RequestOutput`s and
records what it was asked. Real engines are covered by tests/e2e.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import QueueOverflowError, VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm_outputs import completion, request_output

from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    KvStorageProbe,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    PromptTokensDetails,
    SamplingOptions,
    SpeculativeInfo,
    StopConditions,
    WorkerType,
)
from dynamo.runtime import Context, InvalidRequestError, WorkerOverloadedError
from dynamo.vllm.kv_transfer.janitor import KvTransferJanitor, entry_name
from dynamo.vllm.kv_transfer.layout import KV_LAYOUT_PARAM
from dynamo.vllm.kv_transfer.storage_check import (
    KvStorageNotSharedError,
    SharedStorageCheck,
    StorageProbeFile,
)
from dynamo.vllm.serving.engine import EngineFacts, VllmEngine, applied_defaults
from dynamo.vllm.serving.handlers import GenerateHandler, RequestCounters

PROMPT = list(range(100, 109))
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
INSTANCE_ID = 7
CONNECTOR = "ExampleConnector"
MODEL_DEFAULTS: dict[str, Any] = {"temperature": 0.6, "top_p": 0.95}


# ------------------------------------------------------------------------------ doubles


def step(
    token_ids: list[int],
    *,
    finish_reason: str | None = None,
    num_cached_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> RequestOutput:
    """One DELTA output of vLLM for the prompt: the tokens of one engine step."""
    return request_output(
        completion(token_ids, finish_reason=finish_reason),
        prompt_token_ids=PROMPT,
        request_id="engine-side-id",
        num_cached_tokens=num_cached_tokens,
        kv_transfer_params=kv_transfer_params,
    )


class FakeAsyncLLM:
    """Stands in for vLLM's `AsyncLLM`: replays scripted outputs and records the prompts,
    sampling parameters, request ids and aborts it was given.

    `dead_after=N` raises `EngineDeadError` after N outputs (as vLLM does when the engine
    core dies); `hang=True` waits forever once the script is spent (a request still
    running in the engine), so a cancellation can arrive while the handler awaits it."""

    def __init__(
        self, outputs: list[RequestOutput], *, dead_after: int | None = None, hang: bool = False
    ) -> None:
        self.outputs = outputs
        self.dead_after = dead_after
        self.hang = hang
        self.dead_error = EngineDeadError()
        self.failure: Exception | None = None
        self.prompts: list[TokensPrompt] = []
        self.params: list[SamplingParams] = []
        self.request_ids: list[str] = []
        self.priorities: list[int] = []
        self.aborted: list[str] = []

    async def generate(
        self,
        prompt: TokensPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        self.priorities.append(priority)
        self.params.append(sampling_params)
        self.request_ids.append(request_id)
        if self.failure is not None:
            raise self.failure
        for output in self.outputs[: self.dead_after]:
            await asyncio.sleep(0)
            yield output
        if self.dead_after is not None:
            raise self.dead_error
        if self.hang:
            await asyncio.Event().wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class Worker:
    """A handler over an unstarted `VllmEngine` whose `llm` is the fake."""

    def __init__(
        self,
        model_dir: Path,
        llm: FakeAsyncLLM,
        worker_type: WorkerType = WorkerType.AGGREGATED,
        *,
        kv_connector: str | None = None,
        counters: RequestCounters | None = None,
        kv_janitor: KvTransferJanitor | None = None,
        kv_layout: str = "",
        kv_probe: KvStorageProbe | None = None,
        storage_check: SharedStorageCheck | None = None,
        speculative: SpeculativeInfo | None = None,
    ) -> None:
        self.llm = llm
        self.engine = VllmEngine(AsyncEngineArgs(model=str(model_dir)))
        self.engine.llm = cast(AsyncLLM, llm)
        self.engine.facts = EngineFacts(
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=100,
            max_num_seqs=8,
            speculative=speculative,
            sampling_defaults=dict(MODEL_DEFAULTS),
            kv_connector=kv_connector,
            kv_layout=kv_layout,
        )
        self.deaths: list[BaseException] = []
        self.handler = GenerateHandler(
            self.engine,
            worker_type,
            on_engine_dead=self.deaths.append,
            counters=counters,
            kv_janitor=kv_janitor,
            kv_probe=kv_probe,
            storage_check=storage_check,
        )
        self.ctx = Context("ctx-request-id", INSTANCE_ID)

    @property
    def counters(self) -> RequestCounters:
        return self.handler.counters

    def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        """The handler's stream, typed as what it is at run time: an async generator,
        which the runtime may close early."""
        return cast(AsyncGenerator[LLMEngineOutput, None], self.handler.generate(request, self.ctx))

    async def run(self, request: PreprocessedRequest) -> list[LLMEngineOutput]:
        return [out async for out in self.generate(request)]

    def sent_params(self) -> SamplingParams:
        assert len(self.llm.params) == 1
        return self.llm.params[0]


def make_request(
    *,
    sampling: SamplingOptions | None = None,
    stop: StopConditions | None = None,
    prefill_result: PrefillResult | None = None,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="wire-request-id",
        model="tiny",
        token_ids=list(PROMPT),
        sampling_options=sampling or SamplingOptions(),
        stop_conditions=stop or StopConditions(),
        prefill_result=prefill_result,
    )


def usage(completion_tokens: int, cached_tokens: int = 0) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=len(PROMPT),
        completion_tokens=completion_tokens,
        total_tokens=len(PROMPT) + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


# ---------------------------------------------------------------------------- aggregated


async def test_aggregated_streams_every_step_and_finishes_with_usage(tiny_model: Path) -> None:
    llm = FakeAsyncLLM(
        [step([5, 6]), step([7]), step([8], finish_reason="stop", num_cached_tokens=4)]
    )
    counters = RequestCounters()
    counters.prompt_tokens, counters.cached_prompt_tokens = 100, 10
    worker = Worker(tiny_model, llm, counters=counters)

    stream = worker.generate(make_request())
    first = await anext(stream)
    assert counters.in_flight == 1, "counted while it runs"
    outputs = [first, *[out async for out in stream]]

    assert [out.token_ids for out in outputs] == [[5, 6], [7], [8]]
    assert [out.finish_reason for out in outputs] == [None, None, FinishReason.EOS]
    assert [out.completion_usage for out in outputs[:-1]] == [None, None]
    assert outputs[-1].completion_usage == usage(completion_tokens=4, cached_tokens=4)
    assert counters.in_flight == 0
    assert counters.finished == {"eos": 1}
    assert (counters.prompt_tokens, counters.cached_prompt_tokens) == (100 + len(PROMPT), 14)
    assert llm.aborted == []


async def test_the_engine_gets_the_prompt_the_context_id_and_the_requests_sampling(
    tiny_model: Path,
) -> None:
    llm = FakeAsyncLLM([step([5], finish_reason="length")])
    worker = Worker(tiny_model, llm)
    await worker.run(make_request(sampling=SamplingOptions(temperature=0.2, top_k=5)))

    assert llm.prompts == [{"prompt_token_ids": PROMPT}]
    assert llm.request_ids == [worker.ctx.id], "the runtime's id, so an abort finds it"
    params = worker.sent_params()
    assert (params.temperature, params.top_k) == pytest.approx((0.2, 5)), "the request's"
    assert params.top_p == pytest.approx(MODEL_DEFAULTS["top_p"]), "silent: the model's"
    assert params.max_tokens == MAX_MODEL_LEN - len(PROMPT), "silent: the rest of the context"
    assert params.extra_args is None, "aggregated: no KV transfer"


async def test_the_requests_priority_reaches_the_engine(tiny_model: Path) -> None:
    """vLLM orders its waiting requests by it under `--scheduling-policy priority`."""
    llm = FakeAsyncLLM([step([5], finish_reason="length")])
    worker = Worker(tiny_model, llm)
    request = make_request()
    request.priority = -3
    await worker.run(request)
    await worker.run(make_request())
    assert llm.priorities == [-3, 0]


async def test_a_requested_max_tokens_reaches_the_engine(tiny_model: Path) -> None:
    llm = FakeAsyncLLM([step([5], finish_reason="length")])
    worker = Worker(tiny_model, llm)
    await worker.run(make_request(stop=StopConditions(max_tokens=3)))
    assert worker.sent_params().max_tokens == 3
    assert worker.sent_params().temperature == pytest.approx(MODEL_DEFAULTS["temperature"])


# ------------------------------------------------------------------------------- prefill


async def test_prefill_runs_one_token_with_remote_decode_and_withholds_it(
    tiny_model: Path,
) -> None:
    llm = FakeAsyncLLM([step([42], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.PREFILL, kv_connector=CONNECTOR)
    outputs = await worker.run(make_request(stop=StopConditions(max_tokens=50)))

    params = worker.sent_params()
    assert params.max_tokens == 1
    assert params.extra_args == {"kv_transfer_params": {"do_remote_decode": True}}
    assert len(outputs) == 1
    (out,) = outputs
    assert out.token_ids == [], "the decode worker produces the first token"
    assert out.finish_reason is FinishReason.LENGTH
    assert out.disaggregated_params == {"kv_connector": CONNECTOR, "by_prompt": True}
    assert worker.counters.finished == {"length": 1}
    assert worker.counters.in_flight == 0


async def test_prefill_passes_on_the_connectors_own_transfer_params(tiny_model: Path) -> None:
    transfer = {"remote_block_ids": [1, 2], "remote_engine_id": "prefill-engine"}
    llm = FakeAsyncLLM([step([42], finish_reason="length", kv_transfer_params=transfer)])
    worker = Worker(tiny_model, llm, WorkerType.PREFILL, kv_connector="NixlConnector")
    (out,) = await worker.run(make_request())
    assert out.disaggregated_params == transfer
    assert out.token_ids == []


# -------------------------------------------------------------------------------- decode


async def test_decode_hands_the_prefill_params_to_the_connector(tiny_model: Path) -> None:
    transfer = {"remote_block_ids": [3], "remote_engine_id": "prefill-engine"}
    llm = FakeAsyncLLM([step([5]), step([6], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.DECODE, kv_connector="NixlConnector")
    outputs = await worker.run(
        make_request(prefill_result=PrefillResult(disaggregated_params=transfer))
    )

    assert worker.sent_params().extra_args == {"kv_transfer_params": transfer}
    assert [out.token_ids for out in outputs] == [[5], [6]]
    assert worker.counters.remote_prefill_used == 1
    assert worker.counters.finished == {"length": 1}


LAYOUT = "30 layers + 1 draft layers (mtp), 3 KV heads x 64, block 32, bfloat16"
OTHER_LAYOUT = "30 layers + no draft layers, 3 KV heads x 64, block 32, bfloat16"


async def test_a_prefill_worker_names_its_kv_layout(tiny_model: Path) -> None:
    transfer = {"remote_block_ids": [1], "remote_engine_id": "prefill-engine"}
    for connector, from_engine in (("NixlConnector", transfer), (CONNECTOR, None)):
        llm = FakeAsyncLLM([step([42], finish_reason="length", kv_transfer_params=from_engine)])
        worker = Worker(
            tiny_model, llm, WorkerType.PREFILL, kv_connector=connector, kv_layout=LAYOUT
        )
        (out,) = await worker.run(make_request())
        assert out.disaggregated_params is not None
        assert out.disaggregated_params[KV_LAYOUT_PARAM] == LAYOUT


async def test_decode_loads_kv_laid_out_like_its_own_without_the_layout_key(
    tiny_model: Path,
) -> None:
    transfer = {"remote_block_ids": [3], KV_LAYOUT_PARAM: LAYOUT}
    llm = FakeAsyncLLM([step([5], finish_reason="length")])
    worker = Worker(
        tiny_model, llm, WorkerType.DECODE, kv_connector="NixlConnector", kv_layout=LAYOUT
    )
    await worker.run(make_request(prefill_result=PrefillResult(disaggregated_params=transfer)))
    assert worker.sent_params().extra_args == {"kv_transfer_params": {"remote_block_ids": [3]}}
    assert worker.counters.remote_prefill_used == 1
    assert worker.counters.remote_prefill_refused == 0


async def test_decode_refuses_kv_laid_out_otherwise_and_computes_the_prompt(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = tiny_model.parent / "kv"
    janitor = KvTransferJanitor(storage, BLOCK_SIZE)  # creates (owns) the directory
    params = {"kv_connector": CONNECTOR, "by_prompt": True, KV_LAYOUT_PARAM: OTHER_LAYOUT}
    for _ in range(2):
        entry = kv_entry(storage)
        llm = FakeAsyncLLM([step([5]), step([6], finish_reason="length")])
        worker = Worker(
            tiny_model, llm, WorkerType.DECODE, kv_connector=CONNECTOR, kv_janitor=janitor,
            kv_layout=LAYOUT,
        )  # fmt: skip
        stream = worker.generate(make_request(prefill_result=PrefillResult(params)))
        await anext(stream)
        # Gone before the engine ran: the prompt-keyed connector would have loaded it.
        assert not entry.exists()
        _ = [out async for out in stream]
        assert worker.sent_params().extra_args is None, "no transfer parameters reach vLLM"
        assert worker.counters.remote_prefill_refused == 1
        assert worker.counters.remote_prefill_used == 0
    assert janitor.removed_refused == 2
    reports = [r for r in caplog.records if "laid out" in r.getMessage()]
    assert len(reports) == 2, "once per decode worker (each test worker is a new handler)"
    assert OTHER_LAYOUT in reports[0].getMessage() and LAYOUT in reports[0].getMessage()


async def test_a_prefill_worker_names_its_transfer_directory_probe(tiny_model: Path) -> None:
    probe = KvStorageProbe(token="ab" * 16, path="/shared/kv", host="10.0.0.1")
    llm = FakeAsyncLLM([step([42], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.PREFILL, kv_connector=CONNECTOR, kv_probe=probe)
    (out,) = await worker.run(make_request())
    assert out.kv_storage == probe


async def test_decode_fails_a_request_whose_kv_is_in_a_directory_it_cannot_see(
    tiny_model: Path,
) -> None:
    """Prefill and decode on 'different hosts': each its own directory. The request fails
    before vLLM sees it, with the reason; one the decode worker shares goes through."""
    theirs, ours = tiny_model.parent / "prefill-kv", tiny_model.parent / "decode-kv"
    theirs.mkdir()
    ours.mkdir()
    foreign = StorageProbeFile.create(theirs, "10.0.0.1")
    assert foreign is not None
    check = SharedStorageCheck(ours, "10.0.0.2")
    params = {"kv_connector": CONNECTOR, "by_prompt": True}
    llm = FakeAsyncLLM([step([5], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.DECODE, kv_connector=CONNECTOR, storage_check=check)
    request = make_request(prefill_result=PrefillResult(params, kv_storage=foreign.probe))
    with pytest.raises(KvStorageNotSharedError, match=f"{theirs}.*{ours}"):
        await worker.run(request)
    assert llm.params == [], "vLLM never saw the request"
    assert worker.counters.remote_prefill_refused == 1
    assert worker.counters.finished == {"error": 1}

    shared = StorageProbeFile.create(ours, "10.0.0.3")  # a prefill worker that shares ours
    assert shared is not None
    await worker.run(make_request(prefill_result=PrefillResult(params, kv_storage=shared.probe)))
    assert worker.sent_params().extra_args == {"kv_transfer_params": params}
    assert worker.counters.remote_prefill_used == 1


async def test_decode_without_a_prefill_result_counts_no_remote_prefill(
    tiny_model: Path,
) -> None:
    llm = FakeAsyncLLM([step([5], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.DECODE, kv_connector="NixlConnector")
    await worker.run(make_request())
    assert worker.sent_params().extra_args is None
    assert worker.counters.remote_prefill_used == 0


# -------------------------------------------------------------------------- cancellation


def three_token_stream(
    model_dir: Path,
) -> tuple[FakeAsyncLLM, Worker, AsyncGenerator[LLMEngineOutput, None]]:
    """A worker over an engine that would step out tokens 5, 6 and 7 (then `length`), and
    the stream of one request to it, not started yet."""
    llm = FakeAsyncLLM([step([5]), step([6]), step([7], finish_reason="length")])
    worker = Worker(model_dir, llm)
    return llm, worker, worker.generate(make_request())


def assert_aborted_as_cancelled(llm: FakeAsyncLLM, worker: Worker) -> None:
    """The engine was told to abort the worker's one request, which the worker counted once,
    as cancelled, and no longer has in flight."""
    assert llm.aborted == [worker.ctx.id]
    assert worker.counters.finished == {"cancelled": 1}
    assert worker.counters.in_flight == 0


async def test_a_client_cancel_aborts_and_ends_with_a_cancelled_output(tiny_model: Path) -> None:
    llm, worker, stream = three_token_stream(tiny_model)
    first = await anext(stream)
    worker.ctx.stop_generating()
    rest = [out async for out in stream]

    assert first.token_ids == [5]
    assert rest == [
        LLMEngineOutput(finish_reason=FinishReason.CANCELLED, completion_usage=usage(1))
    ]
    assert_aborted_as_cancelled(llm, worker)


async def test_closing_the_stream_on_the_cancelled_output_counts_it_once(
    tiny_model: Path,
) -> None:
    llm, worker, stream = three_token_stream(tiny_model)
    await anext(stream)
    worker.ctx.stop_generating()
    last = await anext(stream)
    assert last.finish_reason is FinishReason.CANCELLED
    await stream.aclose()

    assert_aborted_as_cancelled(llm, worker)


async def test_the_runtime_closing_the_stream_aborts_the_request(tiny_model: Path) -> None:
    llm, worker, stream = three_token_stream(tiny_model)
    await anext(stream)
    await stream.aclose()

    assert_aborted_as_cancelled(llm, worker)


async def test_a_cancelled_task_waiting_on_the_engine_aborts_the_request(
    tiny_model: Path,
) -> None:
    """The runtime's own path on a client cancel: it cancels the task draining the stream
    while the handler awaits the engine's next step."""
    llm = FakeAsyncLLM([step([5])], hang=True)
    worker = Worker(tiny_model, llm)
    received: list[LLMEngineOutput] = []

    async def drain() -> None:
        async for out in worker.generate(make_request()):
            received.append(out)

    task = asyncio.create_task(drain())
    while not received:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert [out.token_ids for out in received] == [[5]]
    assert_aborted_as_cancelled(llm, worker)


# --------------------------------------------------------------------------- engine dead


@pytest.mark.parametrize("dead_after", [0, 1])
async def test_a_dead_engine_ends_the_stream_with_an_error(
    tiny_model: Path, dead_after: int
) -> None:
    llm = FakeAsyncLLM([step([5]), step([6])], dead_after=dead_after)
    worker = Worker(tiny_model, llm)
    outputs = await worker.run(make_request())

    assert [out.token_ids for out in outputs[:-1]] == [[5]][:dead_after]
    last = outputs[-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.error is not None and "engine dead" in last.error
    assert len(worker.deaths) == 1 and worker.deaths[0] is llm.dead_error
    assert worker.counters.finished == {"error": 1}
    assert worker.counters.in_flight == 0


async def test_an_engine_error_is_not_counted_as_a_cancel(tiny_model: Path) -> None:
    llm = FakeAsyncLLM([])
    llm.failure = ValueError("the prompt is longer than the model's context")
    worker = Worker(tiny_model, llm)
    with pytest.raises(ValueError, match="longer than"):
        await worker.run(make_request())
    assert worker.counters.in_flight == 0
    assert worker.counters.finished == {"error": 1}


# ------------------------------------------------------------------------------ refusals


async def test_a_value_vllms_sampling_params_refuse_is_the_clients_error(tiny_model: Path) -> None:
    worker = Worker(tiny_model, FakeAsyncLLM([step([5], finish_reason="length")]))
    with pytest.raises(InvalidRequestError) as info:
        await worker.run(make_request(sampling=SamplingOptions(top_p=0.0)))
    # vLLM's own words, without the "(parameter=top_p, value=0.0)" its str() appends.
    assert str(info.value) == "top_p must be in (0, 1], got 0.0."
    assert worker.llm.params == []  # never reached the engine
    assert worker.counters.finished == {"rejected": 1}
    assert worker.counters.in_flight == 0


async def test_a_speculating_worker_refuses_min_p_which_vllm_would_ignore(
    tiny_model: Path,
) -> None:
    """While it speculates vLLM applies no min_p (and its `SamplingParams.verify` refuses
    one): refused before the engine, naming the field and the way out, never sent."""
    ngram = SpeculativeInfo(method="ngram", num_speculative_tokens=3)
    worker = Worker(tiny_model, FakeAsyncLLM([]), speculative=ngram)
    with pytest.raises(InvalidRequestError) as info:
        await worker.run(make_request(sampling=SamplingOptions(min_p=0.1)))
    assert str(info.value).startswith("`min_p` is not applied by this worker: it speculates")
    assert worker.llm.params == []
    assert worker.counters.finished == {"rejected": 1}
    # A neutral min_p asks for nothing and is served; so is min_p without speculation.
    served = Worker(
        tiny_model, FakeAsyncLLM([step([5], finish_reason="length")]), speculative=ngram
    )
    await served.run(make_request(sampling=SamplingOptions(min_p=0.0)))
    plain = Worker(tiny_model, FakeAsyncLLM([step([5], finish_reason="length")]))
    await plain.run(make_request(sampling=SamplingOptions(min_p=0.1)))
    assert plain.sent_params().min_p == pytest.approx(0.1)


def test_a_speculating_engine_drops_a_model_default_it_would_not_apply() -> None:
    defaults = {"min_p": 0.05, "top_p": 0.9}
    assert applied_defaults(dict(defaults), spec_config=None) == defaults
    assert applied_defaults(dict(defaults), spec_config=object()) == {"top_p": 0.9}


async def test_a_request_the_engine_refuses_is_the_clients_error(tiny_model: Path) -> None:
    llm = FakeAsyncLLM([])
    llm.failure = VLLMValidationError(
        "Requested sample logprobs of 30, which is greater than max allowed: 20\nat line 2",
        parameter="logprobs",
        value=30,
    )
    worker = Worker(tiny_model, llm)
    with pytest.raises(InvalidRequestError) as info:
        await worker.run(make_request())
    assert str(info.value) == (
        "Requested sample logprobs of 30, which is greater than max allowed: 20"
    )
    assert worker.counters.finished == {"rejected": 1}
    assert worker.counters.in_flight == 0


async def test_a_full_engine_queue_refuses_the_request_as_overloaded(tiny_model: Path) -> None:
    llm = FakeAsyncLLM([])
    llm.failure = QueueOverflowError()
    worker = Worker(tiny_model, llm)
    with pytest.raises(WorkerOverloadedError, match="busy"):
        await worker.run(make_request())
    assert worker.counters.finished == {"rejected": 1}
    assert worker.counters.in_flight == 0


# ----------------------------------------------------------------------- KV transfer entry


def kv_entry(storage: Path) -> Path:
    """The ExampleConnector's entry for PROMPT, as a prefill worker would have written it."""
    entry = storage / entry_name(PROMPT, BLOCK_SIZE)
    entry.mkdir(parents=True)
    (entry / "model.layers.0.safetensors").write_bytes(b"kv")
    return entry


def far_future(janitor: KvTransferJanitor) -> float:
    return time.time() + 10 * janitor.ttl_s


async def test_decode_deletes_the_prompts_entry_once_consumed(tiny_model: Path) -> None:
    storage = tiny_model.parent / "kv"
    janitor = KvTransferJanitor(storage, BLOCK_SIZE)  # creates (owns) the directory
    entry = kv_entry(storage)
    llm = FakeAsyncLLM([step([5]), step([6], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.DECODE, kv_connector=CONNECTOR, kv_janitor=janitor)

    stream = worker.generate(make_request(prefill_result=PrefillResult({"by_prompt": True})))
    await anext(stream)
    assert janitor.sweep(now=far_future(janitor)) == 0, "held while the request runs"
    assert entry.exists()
    _ = [out async for out in stream]

    assert not entry.exists()
    assert janitor.removed_consumed == 1


async def test_an_entry_shared_by_two_requests_outlives_the_first(tiny_model: Path) -> None:
    storage = tiny_model.parent / "kv"
    janitor = KvTransferJanitor(storage, BLOCK_SIZE)  # creates (owns) the directory
    entry = kv_entry(storage)
    script = [step([5]), step([6], finish_reason="length")]
    first = Worker(tiny_model, FakeAsyncLLM(script), WorkerType.DECODE, kv_janitor=janitor)
    second = Worker(tiny_model, FakeAsyncLLM(script), WorkerType.DECODE, kv_janitor=janitor)

    transferred = PrefillResult({"by_prompt": True})
    running = first.generate(make_request(prefill_result=transferred))
    await anext(running)
    await second.run(make_request(prefill_result=transferred))
    assert entry.exists(), "the first request still needs it"
    _ = [out async for out in running]
    assert not entry.exists()
    assert janitor.removed_consumed == 1


async def test_a_request_without_a_prefill_does_not_consume_an_entry_it_found(
    tiny_model: Path,
) -> None:
    """The engine may load an entry that matches a local request's prompt, but the entry
    was written for another request (maybe on another decode worker, about to load it)."""
    storage = tiny_model.parent / "kv"
    janitor = KvTransferJanitor(storage, BLOCK_SIZE)  # creates (owns) the directory
    entry = kv_entry(storage)
    llm = FakeAsyncLLM([step([5]), step([6], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.DECODE, kv_connector=CONNECTOR, kv_janitor=janitor)
    await worker.run(make_request())
    assert entry.exists()
    assert janitor.removed_consumed == 0


async def test_a_prefill_worker_leaves_the_entry_for_the_decode_worker(tiny_model: Path) -> None:
    storage = tiny_model.parent / "kv"
    janitor = KvTransferJanitor(storage, BLOCK_SIZE)  # creates (owns) the directory
    entry = kv_entry(storage)
    llm = FakeAsyncLLM([step([42], finish_reason="length")])
    worker = Worker(tiny_model, llm, WorkerType.PREFILL, kv_connector=CONNECTOR, kv_janitor=janitor)
    await worker.run(make_request())
    assert entry.exists()
    assert janitor.removed_consumed == 0
