"""A card event that stalls is given up after `apply_timeout_s`, so card discovery goes on.

Card events are applied in order; one whose set-up never finishes (a router that waits
on a broker that does not answer, a tokenizer load that hangs) used to hold back every
later card of every model. The runtime and the router factory here are stand-ins whose
one behaviour under test is to hang; the bookkeeping is the real ModelCardSync.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from frontend_support import make_card

from dynamo.frontend.models.card_sync import ModelCardSync
from dynamo.llm.model_card import CardAdded
from dynamo.llm.protocols import ModelCard

TIMEOUT_S = 0.2


class RecordingClient:
    """An endpoint client that remembers whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class OneEndpointRuntime:
    """`runtime.namespace(..).component(..).endpoint(..).client()` hands out clients."""

    def __init__(self) -> None:
        self.clients: list[RecordingClient] = []

    def namespace(self, _name: str) -> OneEndpointRuntime:
        return self

    def component(self, _name: str) -> OneEndpointRuntime:
        return self

    def endpoint(self, _name: str) -> OneEndpointRuntime:
        return self

    async def client(self) -> RecordingClient:
        self.clients.append(RecordingClient())
        return self.clients[-1]


class FactoryCallingManager:
    """Calls the engine-client factory as ModelManager.add_instance does for a new
    endpoint; what it returns is never reached in these tests."""

    async def add_instance(self, card: ModelCard, _tokenizer: Any, factory: Any) -> Any:
        return await factory(card)


async def hanging_router_factory(_card: ModelCard, _client: Any) -> Any:
    await asyncio.Event().wait()


def card_sync(runtime: OneEndpointRuntime, tmp_path: Path) -> ModelCardSync:
    return ModelCardSync(
        runtime,  # type: ignore[arg-type]
        FactoryCallingManager(),  # type: ignore[arg-type]
        hanging_router_factory,  # type: ignore[arg-type]
        tmp_path,
        apply_timeout_s=TIMEOUT_S,
    )


async def test_a_stalled_card_is_given_up_and_retried_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = OneEndpointRuntime()
    sync = card_sync(runtime, tmp_path)
    card = make_card(7)

    with caplog.at_level(logging.WARNING, logger="dynamo.frontend.models.card_sync"):
        await asyncio.wait_for(sync.apply_or_retry(CardAdded(card)), timeout=10 * TIMEOUT_S)

    assert card in sync.retries
    assert f"not applied within {TIMEOUT_S:g}s" in caplog.text
    # The endpoint client made for the card is closed, not leaked.
    assert [c.closed for c in runtime.clients] == [True]


async def test_the_next_card_is_applied_after_a_stalled_one(tmp_path: Path) -> None:
    runtime = OneEndpointRuntime()
    sync = card_sync(runtime, tmp_path)
    for instance_id in (1, 2):
        await asyncio.wait_for(
            sync.apply_or_retry(CardAdded(make_card(instance_id))), timeout=10 * TIMEOUT_S
        )
    assert len(runtime.clients) == 2, "the second card's set-up ran although the first stalled"
