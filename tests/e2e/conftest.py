"""Session-wide real vLLM workers on the embedded model.

Engines take 20-30 s to start on 2 cores (and about 6 s to stop), so the workers most
tests need are started once per session, in parallel, and shared: one with n-gram
speculation (`e2e/spec`, the speculative config `make run` uses) and one without
(`e2e-plain/plain`), each in a namespace of its own so that a frontend over one of them
routes to that worker only. `frontend` serves the n-gram worker's namespace over HTTP; a
module that needs a frontend with other flags over a shared worker starts its own over
that worker's namespace. A module starts engines of its own only for a configuration no
shared worker has (docs/testing.md lists which and why).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_engines import NGRAM_SPEC

from dynamo.testing.processes import FrontendProcess, WorkerProcess, stop_all


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
            namespace="e2e-plain",
            component="plain",
        ),
    }
    try:
        for w in workers.values():
            w.wait_ready()
        yield workers
    finally:
        stop_all(workers.values())


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
    """`python -m dynamo.frontend` over the n-gram worker's namespace, ready once it lists
    the model."""
    from dynamo.llm.models import DEFAULT_MODEL

    namespace = _shared_workers["ngram"].namespace
    proc = FrontendProcess("frontend", nats_url, e2e_log_dir, namespace=namespace)
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
