"""Session-wide real vLLM workers on the embedded model.

Engines take ~30 s to start on 2 cores, so the workers most tests need are started once
per session, in parallel, and shared: one with n-gram speculation and one without, in
separate components of the `e2e` namespace. `frontend` serves that namespace over HTTP;
both workers register the same model name, and the frontend serves a model through the
endpoint whose card it saw first, so a test that needs to know which worker ran a
request looks at both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.testing.processes import FrontendProcess, WorkerProcess

NGRAM_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def _shared_workers(
    embedded_model: Path, nats_url: str, e2e_log_dir: Path
) -> Iterator[dict[str, WorkerProcess]]:
    workers = {
        "ngram": WorkerProcess(
            "worker-ngram",
            embedded_model,
            nats_url,
            e2e_log_dir,
            namespace="e2e",
            component="spec",
            extra=["--speculative-config", json.dumps(NGRAM_SPEC)],
        ),
        "plain": WorkerProcess(
            "worker-plain",
            embedded_model,
            nats_url,
            e2e_log_dir,
            namespace="e2e",
            component="plain",
        ),
    }
    try:
        for w in workers.values():
            w.wait_ready()
        yield workers
    finally:
        for w in workers.values():
            w.stop()


@pytest.fixture(scope="session")
def ngram_worker(_shared_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    return _shared_workers["ngram"]


@pytest.fixture(scope="session")
def plain_worker(_shared_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    return _shared_workers["plain"]


@pytest.fixture(scope="session")
def frontend(
    _shared_workers: dict[str, WorkerProcess], nats_url: str, e2e_log_dir: Path
) -> Iterator[FrontendProcess]:
    """`python -m dynamo.frontend` over the `e2e` namespace, ready once it lists the model."""
    from dynamo.llm.models import DEFAULT_MODEL

    proc = FrontendProcess("frontend", nats_url, e2e_log_dir, namespace="e2e")
    try:
        proc.wait_for_model(DEFAULT_MODEL)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def tokenizer(embedded_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model))


@pytest.fixture(scope="module")
async def runtime(nats_url: str):
    """A `DistributedRuntime` client of the session's NATS, for tests that talk to workers
    directly (without the frontend)."""
    from dynamo.runtime import DistributedRuntime

    rt = await DistributedRuntime.connect(nats_url)
    yield rt
    await rt.shutdown()
