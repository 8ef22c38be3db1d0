"""Fixtures for frontend unit tests: the embedded model's real tokenizer and a running
frontend over the scripted in-memory engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from frontend_support import Frontend, make_card, start_frontend

from dynamo.frontend.preprocessor import Preprocessor, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The real SmolLM2 tokenizer (tokenizer.json + chat template), loaded once."""
    from dynamo.llm.models import resolve_model

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture
def preprocessor(tokenizer: Any) -> Preprocessor:
    return Preprocessor(make_card(), tokenizer)


@pytest.fixture
async def frontend(tokenizer: Any) -> AsyncIterator[Frontend]:
    running = await start_frontend(tokenizer)
    try:
        yield running
    finally:
        await running.service.stop()
        await running.manager.close()
