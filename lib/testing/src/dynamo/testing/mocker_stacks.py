"""One simulated worker behind an in-loop frontend, for tests about the frontend's API.

Tests of an OpenAI field's plumbing (structured output, `n`, `/v1/responses`) need a real
frontend discovering a real worker over a real nats-server, but not vLLM: the mocker
(`dynamo.mocker`) stands in, with the embedded model's vocabulary and tokenizer so the
frontend's preprocessing and detokenizing are the real ones.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dynamo.frontend.engine.routing import RouterMode
from dynamo.llm.worker import ServedWorker
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.model_info import ModelInfo
from dynamo.mocker.timing import TimingModel
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import wait_for_instances_async


def mock_engine_config(model_path: Path, **overrides: Any) -> MockEngineConfig:
    """A mocker engine with `model_path`'s vocabulary and end-of-sequence ids: nearly
    free steps (speed-up 1000), 256 blocks of 16 tokens, a 2048-token context, unless
    `overrides` say otherwise."""
    info = ModelInfo.load(model_path)
    settings: dict[str, Any] = {
        "block_size": 16,
        "num_gpu_blocks": 256,
        "max_model_len": 2048,
        "timing": TimingModel(speed_up=1000.0),
        **overrides,
    }
    return MockEngineConfig(
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        special_token_ids=info.special_token_ids,
        **settings,
    )


@asynccontextmanager
async def mocker_behind_frontend(
    nats_url: str,
    model_path: Path,
    tokenizer_cache: Path,
    *,
    model: str,
    engine_config: MockEngineConfig | None = None,
    router_mode: RouterMode = RouterMode.ROUND_ROBIN,
) -> AsyncIterator[tuple[str, ServedWorker[MockerBackend]]]:
    """A mocker worker serving `model` and a frontend on a free port, in a namespace of
    their own, until the block exits; yields the frontend's base URL and the worker."""
    namespace = "mock" + uuid.uuid4().hex[:8]
    settings = WorkerSettings(namespace=namespace, nats_server=nats_url, lease_ttl=10.0)
    worker = mocker_worker(
        settings,
        engine_config or mock_engine_config(model_path),
        model_path=model_path,
        served_model_name=model,
        name="m0",
    )
    frontend = InLoopFrontend.start(nats_url, namespace, tokenizer_cache, router_mode=router_mode)
    try:
        await worker.start()
        await wait_for_instances_async(frontend.base_url, model, 1, timeout=60, interval=0.05)
        yield frontend.base_url, worker
    finally:
        await frontend.stop()
        await worker.stop(drain_timeout=1.0)
