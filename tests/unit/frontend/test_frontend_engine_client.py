"""`RuntimeEngineClient` over a stand-in for `dynamo.runtime.Client`: every placement
through the router, re-placement that avoids the instance that failed (also with the KV
router, which would otherwise pick the same cached worker again), stream deadlines treated
as a lost worker, error mapping, cancellation, router bookkeeping (released whatever
fails after a booking), migration counting, and a close that lets requests in flight
finish. (The real `Client` is tested against a real nats-server in tests/integration.)"""

from __future__ import annotations

import random
from typing import Any

import pytest
from frontend_support import FakeClient

from dynamo.frontend.__main__ import build_parser, config_from_args
from dynamo.frontend.engine.client import (
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_INTER_TOKEN_TIMEOUT_S,
    RuntimeEngineClient,
    StreamDeadlines,
)
from dynamo.frontend.engine.errors import EngineFailedError, EngineUnavailableError
from dynamo.frontend.engine.request_legs import MAX_PLACEMENT_ATTEMPTS, continuation
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.router import KvRouter, build_kv_router
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    KvBlockStored,
    LLMEngineOutput,
    ModelCard,
    OutputOptions,
    PreprocessedRequest,
    PromptTokensDetails,
    RouterEvent,
    SamplingOptions,
    StopConditions,
)
from dynamo.llm.router import RandomRouter, RoundRobinRouter
from dynamo.runtime import (
    ClientClosedError,
    ConnectionLostError,
    InstanceGoneError,
    NoInstancesError,
    NoResponderError,
    RemoteError,
    StreamTimeoutError,
)
from dynamo.testing.waiting import wait_until_async


class BookkeepingRouter(RandomRouter):
    def __init__(self) -> None:
        super().__init__()
        self.first: list[str] = []
        self.finished: list[str] = []

    def on_first_output(self, request_id: str, output: LLMEngineOutput) -> None:
        self.first.append(request_id)

    def on_finished(self, request_id: str) -> None:
        self.finished.append(request_id)


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(request_id="req", model="m", token_ids=[1, 2])


DONE = LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.EOS)


async def _collect(client: RuntimeEngineClient) -> list[LLMEngineOutput]:
    return [out async for out in client.generate(_request())]


def _client(fake: FakeClient, **kwargs: Any) -> RuntimeEngineClient:
    return RuntimeEngineClient(fake, RoundRobinRouter(), **kwargs)


async def test_outputs_stream_through_and_the_router_is_told() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[5]), DONE]])
    router = BookkeepingRouter()
    outputs = await _collect(RuntimeEngineClient(fake, router))
    assert [o.token_ids for o in outputs] == [[5], [7]]
    assert fake.sent[0][0] == "req" and fake.sent[0][1] in (1, 2)  # random router picks
    assert router.first == ["req"] and router.finished == ["req"]
    assert fake.streams[0].closed


async def test_worker_gone_before_first_output_is_placed_again_elsewhere() -> None:
    fake = FakeClient([[InstanceGoneError(1)], [DONE]])
    outputs = await _collect(_client(fake))
    assert outputs == [DONE]
    assert len(fake.sent) == 2
    first, second = fake.sent[0][1], fake.sent[1][1]
    assert first != second, "the instance the request was lost on is not offered again"


async def test_every_instance_lost_before_output_is_unavailable() -> None:
    """One instance, gone before its first output: no other candidate, so 503 rather
    than sending to the same dead worker again."""
    fake = FakeClient([[InstanceGoneError(1)], [DONE]], ids=[1])
    with pytest.raises(EngineUnavailableError):
        await _collect(_client(fake))
    assert fake.sent == [("req", 1)]


async def test_no_responders_everywhere_waits_and_sends_again_instead_of_a_503() -> None:
    """Both workers answer "no responders" (reconnecting to NATS after their node was
    lost): the request waits for the first to be probed again, is charged no placement
    (more tries than `MAX_PLACEMENT_ATTEMPTS`), and is served."""
    fake = FakeClient([[NoResponderError(1)], [NoResponderError(2)], [NoResponderError(1)], [DONE]])
    outputs = await _collect(_client(fake))
    assert outputs == [DONE]
    assert len(fake.sent) == 4 > MAX_PLACEMENT_ATTEMPTS
    assert fake.waits >= 1, "it waited for a paused instance instead of failing"
    assert {request.request_id for request in fake.requests} == {"req"}


async def test_no_responders_past_the_lease_ttl_is_a_lost_worker() -> None:
    """After one lease TTL of "no responders" a live worker's key would have been put
    again and a dead one's has expired: the instance counts as lost, as before."""
    fake = FakeClient([[NoResponderError(1)], [NoResponderError(1)]], ids=[1])
    fake.lease_ttl = 0.0
    with pytest.raises(EngineUnavailableError):
        await _collect(_client(fake))
    assert fake.sent == [("req", 1)]


async def test_a_client_that_does_not_wait_fails_at_once_as_before() -> None:
    """The prefill leg of a disaggregated request does not wait for unreachable prefill
    workers: the decode worker prefilling itself is the better way out."""
    fake = FakeClient([[NoResponderError(1)], [NoResponderError(2)], [DONE]])
    with pytest.raises(EngineUnavailableError):
        await _collect(_client(fake, wait_for_unreachable=False))
    assert len(fake.sent) == 2
    assert fake.waits == 0


async def test_a_paused_instance_is_skipped_while_another_serves() -> None:
    fake = FakeClient.per_instance({1: [NoResponderError(1)], 2: [DONE]})
    for _ in range(3):
        assert await _collect(RuntimeEngineClient(fake, RoundRobinRouter())) == [DONE]
    assert fake.sent_to.count(1) == 1, "left out after its one no-responders answer"
    assert fake.waits == 0


async def test_worker_gone_after_output_is_a_failure() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[5]), InstanceGoneError(1)]])
    with pytest.raises(EngineFailedError, match="worker lost"):
        await _collect(_client(fake))
    assert len(fake.sent) == 1


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RemoteError("CUDA OOM", "RuntimeError"), EngineFailedError),
        (StreamTimeoutError("no frame"), EngineFailedError),
        (NoInstancesError("none"), EngineUnavailableError),
    ],
)
async def test_runtime_errors_are_mapped(error: Exception, expected: type) -> None:
    fake = FakeClient([[error]] * 3)
    with pytest.raises(expected):
        await _collect(_client(fake))


async def test_no_instances_is_unavailable_without_sending() -> None:
    fake = FakeClient([], ids=[])
    with pytest.raises(EngineUnavailableError):
        await _collect(_client(fake))
    assert fake.sent == []


async def test_closing_early_closes_the_runtime_stream() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[i]) for i in range(10)]])
    router = BookkeepingRouter()
    gen = RuntimeEngineClient(fake, router).generate(_request())
    assert (await gen.__anext__()).token_ids == [0]
    await gen.aclose()
    assert fake.streams[0].closed
    assert router.finished == ["req"]


async def test_migration_continues_on_another_worker_with_the_generated_tokens() -> None:
    final = LLMEngineOutput(
        token_ids=[13],
        finish_reason=FinishReason.LENGTH,
        completion_usage=CompletionUsage(
            prompt_tokens=5, completion_tokens=1, total_tokens=6,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=5),
        ),
    )  # fmt: skip
    fake = FakeClient(
        [
            [
                LLMEngineOutput(token_ids=[10, 11]),
                LLMEngineOutput(token_ids=[12]),
                InstanceGoneError(1),
            ],
            [final],
        ]
    )
    router = BookkeepingRouter()
    client = RuntimeEngineClient(fake, router, migration_limit=1)
    request = PreprocessedRequest(
        request_id="req",
        model="m",
        token_ids=[1, 2],
        stop_conditions=StopConditions(max_tokens=4, min_tokens=2),
    )
    outputs = [out async for out in client.generate(request)]
    assert [t for o in outputs for t in o.token_ids] == [10, 11, 12, 13]
    resumed = fake.requests[1]
    assert resumed.token_ids == [1, 2, 10, 11, 12]
    assert resumed.stop_conditions.max_tokens == 1 and resumed.stop_conditions.min_tokens == 0
    usage = outputs[-1].completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 4, 6)
    assert usage.prompt_tokens_details.cached_tokens == 2
    assert client.migrations == 1
    assert router.finished == ["req", "req"]
    assert fake.sent[0][1] != fake.sent[1][1], "migration goes to another instance"


async def test_migration_limit_is_respected() -> None:
    fake = FakeClient(
        [
            [LLMEngineOutput(token_ids=[10]), InstanceGoneError(1)],
            [LLMEngineOutput(token_ids=[11]), InstanceGoneError(2)],
        ]
    )
    client = _client(fake, migration_limit=1)
    with pytest.raises(EngineFailedError, match="worker lost"):
        await _collect(client)
    assert len(fake.sent) == 2 and client.migrations == 1


# --------------------------------------------------------------------------- exclusion


class SpyRouter(BookkeepingRouter):
    """Records the candidates of every placement; prefers the highest instance id, as a
    KV router prefers the worker holding the prompt's prefix (the same one every time)."""

    def __init__(self) -> None:
        super().__init__()
        self.candidates: list[list[int]] = []

    async def select(self, request: PreprocessedRequest, instance_ids: Any) -> int:
        self.candidates.append(list(instance_ids))
        return max(instance_ids)


@pytest.mark.parametrize(
    "refusal",
    [InstanceGoneError(2), StreamTimeoutError("no first output", 2)],
    ids=["gone", "first-token-timeout"],
)
async def test_re_placement_never_offers_the_instance_it_was_lost_on(refusal: Exception) -> None:
    fake = FakeClient([[refusal], [DONE]])
    router = SpyRouter()
    outputs = await _collect(RuntimeEngineClient(fake, router))
    assert outputs == [DONE]
    assert router.candidates == [[1, 2], [1]]
    assert fake.sent_to == [2, 1]
    assert router.finished == ["req", "req"]


async def test_a_stream_cut_by_our_own_nats_connection_is_retried_on_any_worker() -> None:
    """Our connection dropped (a NATS node lost): the worker is not to blame, so it stays
    a candidate, and the new leg has its own id (the old one may still run there until
    our STOP arrives, and a worker refuses a request id it already runs)."""
    fake = FakeClient([[ConnectionLostError(2)], [DONE]])
    router = SpyRouter()
    outputs = await _collect(RuntimeEngineClient(fake, router))
    assert outputs == [DONE]
    assert router.candidates == [[1, 2], [1, 2]]
    assert fake.sent == [("req", 2), ("req-r1", 2)]
    assert router.finished == ["req", "req-r1"], "each leg's booking released under its id"


async def test_a_cut_stream_with_tokens_out_migrates_under_a_new_id() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[7]), ConnectionLostError(2)], [DONE]])
    router = SpyRouter()
    outputs = await _collect(RuntimeEngineClient(fake, router, migration_limit=1))
    assert [t for o in outputs for t in o.token_ids][:1] == [7]
    assert fake.sent == [("req", 2), ("req-r1", 2)]
    assert fake.requests[1].token_ids[-1] == 7, "the continuation carries the streamed token"


def test_a_continuation_keeps_the_sampling_fields_but_not_the_prompt_logprobs() -> None:
    """A migrated request samples as the client asked (`logit_bias`, `allowed_token_ids`,
    `bad_words`, penalties go along), but does not ask for the prompt's logprobs again:
    they came with the first leg's first output, and the continuation's prompt (prompt +
    generated) is not the client's."""
    sampling = SamplingOptions(
        logit_bias={5: 10.0}, allowed_token_ids=[5, 6, 7], bad_words=["x"], repetition_penalty=1.2
    )
    original = PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=[1, 2, 3],
        sampling_options=sampling,
        output_options=OutputOptions(logprobs=2, prompt_logprobs=1, logprob_token_ids=[9]),
    )
    leg = continuation(original, [7, 8])
    assert leg.token_ids == [1, 2, 3, 7, 8]
    assert leg.sampling_options == sampling
    assert leg.output_options == OutputOptions(logprobs=2, logprob_token_ids=[9])
    assert original.output_options.prompt_logprobs == 1


def _kv_card(instance_id: int) -> ModelCard:
    return ModelCard(
        name="m", namespace="ns", component="backend", endpoint="generate",
        instance_id=instance_id, kv_block_size=4,
    )  # fmt: skip


def _kv_router_preferring(worker: int, prompt: list[int]) -> KvRouter:
    """A real KV router whose index says `worker` caches all of `prompt`."""
    router = build_kv_router(_kv_card(1), rng=random.Random(0))
    router.update_card(_kv_card(2))
    hashes = compute_block_hashes(prompt, 4)
    router.scheduler.apply_event(RouterEvent(worker, 0, KvBlockStored(block_hashes=hashes)))
    return router


async def test_kv_router_retry_goes_to_another_worker_not_the_cached_dead_one() -> None:
    """The KV router scores the worker holding the prefix best every time: a retry that
    offered it again would go to the dead worker three times and fail."""
    prompt = list(range(100, 116))
    router = _kv_router_preferring(2, prompt)
    fake = FakeClient([[InstanceGoneError(2)], [DONE], [DONE], [DONE]])
    request = PreprocessedRequest(request_id="req", model="m", token_ids=prompt)
    outputs = [out async for out in RuntimeEngineClient(fake, router).generate(request)]
    assert outputs == [DONE]
    assert fake.sent_to == [2, 1]
    assert router.scheduler.sequences.worker_of("req") is None, "every booking released"


async def test_kv_migration_goes_to_another_worker() -> None:
    prompt = list(range(100, 116))
    router = _kv_router_preferring(2, prompt)
    fake = FakeClient([[LLMEngineOutput(token_ids=[5]), InstanceGoneError(2)], [DONE], [DONE]])
    request = PreprocessedRequest(request_id="req", model="m", token_ids=prompt)
    client = RuntimeEngineClient(fake, router, migration_limit=3)
    outputs = [out async for out in client.generate(request)]
    assert [t for o in outputs for t in o.token_ids] == [5, 7]
    assert fake.sent_to == [2, 1]
    assert router.scheduler.sequences.worker_of("req") is None


# --------------------------------------------------------------------------- bookings


@pytest.mark.parametrize(
    "error",
    [OverflowError("can't serialize ints > 2**64 - 1"), ValueError("bad"), RuntimeError("bug")],
)
async def test_a_failure_after_booking_releases_the_booking(error: Exception) -> None:
    """Opening the stream (encoding the request) happens after the router booked it:
    whatever it raises, the booking is released."""
    prompt = list(range(100, 116))
    router = _kv_router_preferring(2, prompt)
    fake = FakeClient([], open_error=error)
    request = PreprocessedRequest(request_id="req", model="m", token_ids=prompt)
    with pytest.raises(type(error)):
        _ = [out async for out in RuntimeEngineClient(fake, router).generate(request)]
    assert router.scheduler.sequences.worker_of("req") is None
    assert router.scheduler.sequences.loads()[2].active_blocks == 0


async def test_a_failure_after_booking_tells_the_router_once() -> None:
    router = BookkeepingRouter()
    fake = FakeClient([], open_error=OverflowError("too big"))
    with pytest.raises(OverflowError):
        await _collect(RuntimeEngineClient(fake, router))
    assert router.finished == ["req"]


# --------------------------------------------------------------------------- deadlines


async def test_deadlines_reach_every_stream() -> None:
    fake = FakeClient([[InstanceGoneError(1)], [DONE]])
    deadlines = StreamDeadlines(first_token_s=7.0, inter_token_s=2.0)
    await _collect(_client(fake, deadlines=deadlines))
    assert [(o["first_item_timeout"], o["item_timeout"]) for o in fake.options] == [(7.0, 2.0)] * 2
    fake = FakeClient([[DONE]])
    await _collect(_client(fake))
    assert fake.options[0]["first_item_timeout"] == DEFAULT_FIRST_TOKEN_TIMEOUT_S == 300.0
    assert fake.options[0]["item_timeout"] == DEFAULT_INTER_TOKEN_TIMEOUT_S == 60.0


def test_deadlines_from_the_command_line() -> None:
    assert StreamDeadlines.from_seconds(0, 0) == StreamDeadlines(None, None)
    assert StreamDeadlines.from_seconds(5, 1.5) == StreamDeadlines(5.0, 1.5)
    with pytest.raises(ValueError, match="inter_token_s must be > 0"):
        StreamDeadlines(inter_token_s=-1)
    config = config_from_args(build_parser().parse_args([]))
    assert config.stream_deadlines == StreamDeadlines(300.0, 60.0)
    args = ["--first-token-timeout", "0", "--inter-token-timeout", "2.5"]
    config = config_from_args(build_parser().parse_args(args))
    assert config.stream_deadlines == StreamDeadlines(None, 2.5)


def test_deadline_flags_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_FIRST_TOKEN_TIMEOUT", "12")
    monkeypatch.setenv("DYN_INTER_TOKEN_TIMEOUT", "0")
    config = config_from_args(build_parser().parse_args([]))
    assert config.stream_deadlines == StreamDeadlines(12.0, None)


async def test_silent_worker_after_tokens_is_migrated_and_counted() -> None:
    fake = FakeClient(
        [[LLMEngineOutput(token_ids=[10]), StreamTimeoutError("no next output", 1)], [DONE]]
    )
    migrated: list[str] = []
    client = _client(fake, migration_limit=1, on_migration=migrated.append)
    outputs = await _collect(client)
    assert [t for o in outputs for t in o.token_ids] == [10, 7]
    assert fake.sent[0][1] != fake.sent[1][1]
    assert fake.requests[1].token_ids == [1, 2, 10]
    assert migrated == ["m"] and client.migrations == 1
    assert all(stream.closed for stream in fake.streams), "the silent stream is cancelled"


async def test_silent_worker_without_migrations_is_a_clear_failure() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[10]), StreamTimeoutError("sent nothing", 1)]])
    with pytest.raises(EngineFailedError, match="worker stopped responding: sent nothing"):
        await _collect(_client(fake, migration_limit=0))


async def test_no_instance_answering_in_time_is_a_failure_not_a_503() -> None:
    fake = FakeClient([[StreamTimeoutError("t1", 1)], [StreamTimeoutError("t2", 2)]])
    with pytest.raises(EngineFailedError, match="stopped responding: t2"):
        await _collect(_client(fake))
    assert fake.sent_to in ([1, 2], [2, 1])


# --------------------------------------------------------------------------- closing


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ([ClientClosedError("closed")], EngineUnavailableError),
        ([LLMEngineOutput(token_ids=[5]), ClientClosedError("closed")], EngineFailedError),
    ],
)
async def test_closed_runtime_client_ends_the_request(script: list[Any], expected: type) -> None:
    fake = FakeClient([script, [DONE]])
    with pytest.raises(expected, match="closed"):
        await _collect(_client(fake, migration_limit=3))
    assert len(fake.sent) == 1, "a closed client is not retried"


async def test_close_lets_requests_in_flight_finish_then_releases() -> None:
    """The registry closes an endpoint's client when its last card goes, which is also
    how a worker's graceful drain begins: its requests in flight must not be cut."""
    fake = FakeClient([[LLMEngineOutput(token_ids=[i]) for i in range(3)] + [DONE]])
    router = BookkeepingRouter()
    client = RuntimeEngineClient(fake, router)
    gen = client.generate(_request())
    assert (await gen.__anext__()).token_ids == [0]
    await client.close()
    assert not fake.closed
    with pytest.raises(EngineUnavailableError, match="gone"):
        await _collect(client)
    rest = [out.token_ids async for out in gen]
    assert rest == [[1], [2], [7]]
    # The release runs as a task once the last request ended.
    await wait_until_async(lambda: fake.closed, timeout=5, what="the runtime client closed")


async def test_close_when_idle_releases_at_once() -> None:
    fake = FakeClient([])
    client = _client(fake)
    await client.close()
    assert fake.closed
    await client.close()  # idempotent
