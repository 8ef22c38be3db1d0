"""`ModelManager` fed by plain calls, and disaggregated prefill/decode composition."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from frontend_support import MODEL, make_card

from dynamo.frontend.engine.disagg import DisaggregatedEngineClient, prefill_leg
from dynamo.frontend.engine.errors import EngineFailedError
from dynamo.frontend.engine.prefill_policy import DisaggSettings, PrefillMode
from dynamo.frontend.models.manager import ModelManager
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.llm.protocols import (
    FinishReason,
    KvStorageProbe,
    LLMEngineOutput,
    ModelCard,
    OutputOptions,
    PreprocessedRequest,
    RankedLogprob,
    WorkerType,
)
from dynamo.testing.engines import InMemoryEngineClient

ALWAYS_REMOTE = DisaggSettings(mode=PrefillMode.REMOTE)  # the prefill leg under test


class Clients:
    """Engine-client factory that records what it built."""

    def __init__(self) -> None:
        self.built: dict[tuple[str, str, str], InMemoryEngineClient] = {}
        self.closed: list[tuple[str, str, str]] = []

    async def __call__(self, card: ModelCard) -> InMemoryEngineClient:
        key = (card.namespace, card.component, card.endpoint)
        client = _ClosingClient(self, key)
        self.built[key] = client
        return client


class _ClosingClient(InMemoryEngineClient):
    def __init__(self, owner: Clients, key: tuple[str, str, str]) -> None:
        super().__init__(_one_token, instance_ids=[1])
        self._owner, self._key = owner, key

    async def close(self) -> None:
        self._owner.closed.append(self._key)
        await super().close()


async def _one_token(request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
    yield LLMEngineOutput(token_ids=[5], finish_reason=FinishReason.LENGTH)


@pytest.fixture
def manager(tokenizer: Any) -> tuple[ModelManager, list[Path]]:
    loaded: list[Path] = []

    def load(card: ModelCard, directory: Path) -> Preprocessor:
        loaded.append(directory)
        return Preprocessor(card, tokenizer)

    return ModelManager(load_preprocessor=load), loaded


async def test_model_appears_with_first_worker_and_goes_with_the_last(manager: Any) -> None:
    mgr, loaded = manager
    clients = Clients()
    fetches: list[int] = []

    async def fetch() -> Path:
        fetches.append(1)
        return Path("/tok")

    assert mgr.get(MODEL) is None
    model = await mgr.add_instance(make_card(1), fetch, clients)
    assert mgr.get(MODEL) is model and MODEL in mgr
    await mgr.add_instance(make_card(2), fetch, clients)
    await mgr.add_instance(make_card(2), fetch, clients)  # re-put card: idempotent
    assert sorted(model.cards) == [1, 2]
    assert len(clients.built) == 1  # one client per endpoint, shared by its instances
    assert fetches == [1] and loaded == [Path("/tok")]  # tokenizer fetched/loaded once
    assert model.has_workers()

    assert await mgr.remove_instance(1) == []
    assert mgr.get(MODEL) is model and clients.closed == []
    assert await mgr.remove_instance(2) == [MODEL]
    assert mgr.get(MODEL) is None
    assert clients.closed == [("dynamo", "backend", "generate")]
    assert await mgr.remove_instance(2) == []  # unknown instance: no-op


async def test_models_are_independent(manager: Any) -> None:
    mgr, _ = manager
    clients = Clients()
    await mgr.add_instance(make_card(1, name="a", component="ca"), "/t", clients)
    await mgr.add_instance(make_card(2, name="b", component="cb"), "/t", clients)
    assert sorted(m.name for m in mgr.models()) == ["a", "b"]
    assert await mgr.remove_instance(1) == ["a"]
    assert [m.name for m in mgr.models()] == ["b"]
    await mgr.close()
    assert mgr.models() == []
    assert ("dynamo", "cb", "generate") in clients.closed


async def test_failed_client_creation_leaves_no_model(manager: Any) -> None:
    mgr, _ = manager

    async def broken(card: ModelCard) -> InMemoryEngineClient:
        raise RuntimeError("cannot reach endpoint")

    with pytest.raises(RuntimeError):
        await mgr.add_instance(make_card(1), "/t", broken)
    assert mgr.get(MODEL) is None


async def test_prefill_workers_put_a_disaggregated_client_in_front(manager: Any) -> None:
    mgr, _ = manager
    clients = Clients()
    prefill = make_card(7, component="prefill", worker_type=WorkerType.PREFILL)
    model = await mgr.add_instance(prefill, "/t", clients)
    assert model.engine is None and not model.has_workers()  # prefill alone cannot serve
    decode = make_card(8, component="backend", worker_type=WorkerType.DECODE)
    await mgr.add_instance(decode, "/t", clients)
    assert isinstance(model.engine, DisaggregatedEngineClient)
    assert model.engine.prefill is clients.built[("dynamo", "prefill", "generate")]
    assert model.engine.decode is clients.built[("dynamo", "backend", "generate")]
    await mgr.remove_instance(7)
    assert model.engine is clients.built[("dynamo", "backend", "generate")]


async def test_a_waiting_request_is_woken_when_an_instance_becomes_ready(manager: Any) -> None:
    """`wait_for_workers` waits on the endpoint's instance changes, not a poll: it
    returns as soon as the worker is back, long before its timeout."""
    mgr, _ = manager
    clients = Clients()
    model = await mgr.add_instance(make_card(1), "/t", clients)
    client = clients.built[("dynamo", "backend", "generate")]
    client.set_instance_ids([])
    assert not model.has_workers()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, client.set_instance_ids, [1])
    started = loop.time()
    assert await mgr.wait_for_workers(MODEL, timeout=30.0) is model
    assert loop.time() - started < 5.0


async def test_waiting_for_a_model_that_appears(manager: Any) -> None:
    mgr, _ = manager
    waiter = asyncio.create_task(mgr.wait_for_workers(MODEL, timeout=30.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    model = await mgr.add_instance(make_card(1), "/t", Clients())
    assert await asyncio.wait_for(waiter, 5.0) is model


async def test_waiting_gives_up_after_the_timeout(manager: Any) -> None:
    mgr, _ = manager
    clients = Clients()
    await mgr.add_instance(make_card(1), "/t", clients)
    clients.built[("dynamo", "backend", "generate")].set_instance_ids([])
    assert await mgr.wait_for_workers(MODEL, timeout=0.05) is None
    assert await mgr.wait_for_workers("no-such-model", timeout=0.05) is None


# ---------------------------------------------------------------------- disaggregation


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(request_id="r1", model=MODEL, token_ids=[1, 2, 3])


async def test_disaggregated_client_hands_prefill_result_to_decode() -> None:
    probe = KvStorageProbe(token="ab" * 16, path="/kv", host="10.0.0.1")

    async def prefill_handler(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(
            finish_reason=FinishReason.LENGTH,
            disaggregated_params={"remote_block_ids": [4, 5]},
            kv_storage=probe,
        )

    async def decode_handler(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(token_ids=[9], finish_reason=FinishReason.EOS)

    prefill = InMemoryEngineClient(prefill_handler)
    decode = InMemoryEngineClient(decode_handler)
    client = DisaggregatedEngineClient(prefill, decode, settings=ALWAYS_REMOTE)
    outputs = [o async for o in client.generate(_request())]
    assert [o.token_ids for o in outputs] == [[9]]
    (leg,) = prefill.requests
    assert leg.stop_conditions.max_tokens == 1
    assert leg.kv_transfer_params == {"do_remote_decode": True}
    (decoded,) = decode.requests
    assert decoded.prefill_result is not None
    assert decoded.prefill_result.disaggregated_params == {"remote_block_ids": [4, 5]}
    assert decoded.prefill_result.kv_storage == probe, "the decode worker checks it"
    assert decoded.kv_transfer_params is None
    assert client.remote_prefills == 1


@pytest.mark.parametrize("failure", ["no-workers", "error-output", "raises", "no-params"])
async def test_decode_prefills_itself_when_prefill_is_unavailable(failure: str) -> None:
    async def prefill_handler(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        if failure == "raises":
            raise EngineFailedError("prefill worker died")
        if failure == "error-output":
            yield LLMEngineOutput(finish_reason=FinishReason.ERROR, error="oom")
            return
        yield LLMEngineOutput(finish_reason=FinishReason.LENGTH)

    async def decode_handler(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(token_ids=[9], finish_reason=FinishReason.EOS)

    fallbacks: list[tuple[str, str]] = []
    prefill = InMemoryEngineClient(
        prefill_handler, instance_ids=[] if failure == "no-workers" else [1]
    )
    decode = InMemoryEngineClient(decode_handler)
    client = DisaggregatedEngineClient(
        prefill, decode, lambda m, r: fallbacks.append((m, r)), settings=ALWAYS_REMOTE
    )
    outputs = [o async for o in client.generate(_request())]
    assert [o.token_ids for o in outputs] == [[9]]
    assert decode.requests[0].prefill_result is None
    assert client.local_prefills == 1 and len(fallbacks) == 1 and fallbacks[0][0] == MODEL


def test_prefill_leg_does_not_touch_the_original_request() -> None:
    original = _request()
    leg = prefill_leg(original)
    assert leg.stop_conditions.max_tokens == 1
    assert original.stop_conditions.max_tokens is None
    assert original.kv_transfer_params is None


@pytest.mark.parametrize("prefill_works", [True, False])
async def test_prompt_logprobs_come_from_where_the_prompt_was_computed(prefill_works: bool) -> None:
    """Remote prefill: the prefill worker's prompt logprobs reach the client on the first
    output, and the decode leg is not asked for them (it loads the KV, it does not run the
    prompt). Local prefill: the decode leg is asked, and its own come through."""
    from_prefill = [None, [RankedLogprob(2, -0.5, 1)], [RankedLogprob(3, -0.25, 1)]]
    from_decode = [None, [RankedLogprob(2, -0.75, 2)], [RankedLogprob(3, -0.5, 1)]]

    async def prefill_handler(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(
            finish_reason=FinishReason.LENGTH,
            prompt_logprobs=from_prefill,
            disaggregated_params={"remote_block_ids": [4]} if prefill_works else None,
        )

    async def decode_handler(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        asked = req.output_options.prompt_logprobs is not None
        yield LLMEngineOutput(token_ids=[9], prompt_logprobs=from_decode if asked else None)
        yield LLMEngineOutput(token_ids=[10], finish_reason=FinishReason.EOS)

    request = msgspec.structs.replace(_request(), output_options=OutputOptions(prompt_logprobs=1))
    decode = InMemoryEngineClient(decode_handler)
    client = DisaggregatedEngineClient(
        InMemoryEngineClient(prefill_handler), decode, settings=ALWAYS_REMOTE
    )
    outputs = [o async for o in client.generate(request)]
    assert outputs[0].prompt_logprobs == (from_prefill if prefill_works else from_decode)
    assert outputs[1].prompt_logprobs is None
    asked_decode = decode.requests[0].output_options.prompt_logprobs
    assert asked_decode == (None if prefill_works else 1)
