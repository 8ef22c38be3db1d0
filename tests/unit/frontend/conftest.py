"""Fixtures for frontend unit tests: a real (tiny, trained here) tokenizer and a running
frontend over the scripted in-memory engine.

The tokenizer is built in the session (`dynamo.testing.tokenizers`) and loaded with the
frontend's own `load_tokenizer`, so these tests exercise the loading path without
preparing the embedded model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from frontend_support import EOS, Frontend, make_card, openai_client
from http_support import running_frontend

from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.frontend.preprocess.tokenizer_setup import load_tokenizer
from dynamo.testing.tokenizers import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny byte-level BPE tokenizer (tokenizer.json + ChatML template), built and
    loaded once per session."""
    loaded = load_tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))
    assert loaded.eos_token_id == EOS, "frontend_support.EOS must be the tokenizer's EOS"
    return loaded


@pytest.fixture
def preprocessor(tokenizer: Any) -> Preprocessor:
    return Preprocessor(make_card(), tokenizer)


@pytest.fixture
async def frontend(tokenizer: Any) -> AsyncIterator[Frontend]:
    async with running_frontend(tokenizer) as running:
        yield running


@pytest.fixture
async def client(frontend: Frontend) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official `openai` client of `frontend`."""
    async with openai_client(frontend) as c:
        yield c
