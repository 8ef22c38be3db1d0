"""Shared fixtures: a real nats-server per test session and the embedded model.

Tests are marked by folder: tests/unit → `unit`, tests/integration → `integration`,
tests/e2e → `e2e`, so `pytest -m unit` is the fast subset.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.runtime.nats_server import NatsServer

_FOLDER_MARKS = {
    "unit": pytest.mark.unit,
    "integration": pytest.mark.integration,
    "e2e": pytest.mark.e2e,
}

# Small, CPU-friendly defaults for every vLLM engine a test starts (inherited by children).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for folder, mark in _FOLDER_MARKS.items():
            if folder in parts:
                item.add_marker(mark)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A real nats-server with JetStream on an ephemeral port, for the whole session."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """Path of the prepared embedded model (prepared by `make setup`; prepared here if missing)."""
    from dynamo.llm.models import DEFAULT_MODEL, prepare_model

    return prepare_model(DEFAULT_MODEL)
