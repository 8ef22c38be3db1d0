"""The frontend in `--router-mode kv` over a real nats-server, with two scripted workers that
publish what they cache through the real worker-side publisher.

Claims: requests sharing a long prefix follow the worker that cached it; `GET /debug/kv`
shows each worker's cached blocks and the predicted hit rate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from kv_support import new_namespace

from dynamo.frontend.frontend import FrontendConfig, run_frontend
from dynamo.frontend.routing import RouterMode
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.model_card import publish_model_card
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    KvAllCleared,
    KvBlockStored,
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
    RouterEvent,
)
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.nats_server import free_port

MODEL = "smollm2-kv"
BLOCK = 32


class CachingWorker:
    """Answers every request with one token and announces the prompt's full blocks as
    cached, the way a vLLM worker's relay would after its prefill."""

    def __init__(self, runtime: DistributedRuntime, namespace: str) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.served: list[str] = []
        self.events = KvEventPublisher(runtime, namespace, "backend", runtime.instance_id)
        self._event_id = 0

    async def start(self, model_dir: Path) -> None:
        await self.events.start()
        await self._announce(KvAllCleared())
        endpoint = self.runtime.namespace(self.namespace).component("backend").endpoint("generate")
        served = await endpoint.serve(self.generate, request_type=PreprocessedRequest)
        card = ModelCard(
            name=MODEL,
            namespace=self.namespace,
            component="backend",
            endpoint="generate",
            instance_id=served.instance_id,
            context_length=2048,
            kv_block_size=BLOCK,
            eos_token_ids=[2],
        )
        await publish_model_card(self.runtime, card, model_dir)

    async def generate(
        self, request: PreprocessedRequest, ctx: Any
    ) -> AsyncIterator[LLMEngineOutput]:
        self.served.append(request.request_id)
        hashes = compute_block_hashes(request.token_ids, BLOCK)
        await self._announce(KvBlockStored(block_hashes=hashes))
        yield LLMEngineOutput(
            token_ids=[2],
            finish_reason=FinishReason.EOS,
            completion_usage=CompletionUsage(
                prompt_tokens=len(request.token_ids), completion_tokens=1
            ),
        )

    async def _announce(self, data: Any) -> None:
        await self.events.publish(RouterEvent(self.runtime.instance_id, self._event_id, data))
        self._event_id += 1


async def _get_json(url: str) -> dict[str, Any]:
    """Async on purpose: the frontend runs on this test's event loop."""
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.json(content_type=None)


async def _eventually(check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from dynamo.llm.models import resolve_model

    return Path(resolve_model("smollm2-135m-instruct"))


async def test_shared_prefixes_follow_the_cache_and_debug_view_shows_it(
    nats_url: str, model_dir: Path, tmp_path: Path
) -> None:
    namespace = new_namespace()
    runtimes = [await DistributedRuntime.connect(nats_url, lease_ttl=2.0) for _ in range(2)]
    workers = [CachingWorker(rt, namespace) for rt in runtimes]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    config = FrontendConfig(
        http_host="127.0.0.1",
        http_port=port,
        namespace=namespace,
        nats_server=nats_url,
        router_mode=RouterMode.KV,
        tokenizer_cache=tmp_path / "tok",
    )
    frontend = asyncio.create_task(run_frontend(config, stop))
    try:
        for worker in workers:
            await worker.start(model_dir)

        async def both_ready() -> bool:
            try:
                health = await _get_json(f"{base}/health")
            except aiohttp.ClientError:
                return False
            return len(health["models"].get(MODEL, {}).get("instances", [])) == 2

        await _eventually(both_ready, timeout=30)
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            sent = 0
            for group in range(3):
                system = f"Group {group}. " + " ".join(f"fact{group}-{i}" for i in range(120))
                owners = []
                for suffix in ("Summarise.", "List three facts.", "Which fact is first?"):
                    before = [len(w.served) for w in workers]
                    await client.chat.completions.create(
                        model=MODEL,
                        messages=[
                            {"role": "system", "content": system},
                            {"role": "user", "content": suffix},
                        ],
                        max_tokens=1,
                    )
                    owner = next(i for i, w in enumerate(workers) if len(w.served) > before[i])
                    owners.append(owner)
                    sent += 1
                    # Route the next request only once this one's blocks are indexed:
                    # every worker announced a clear, then one store per request.
                    await _eventually(lambda n=sent: _feed_events_at_least(base, 2 + n), 5)
                assert owners == [owners[0]] * 3, f"group {group} was split: {owners}"

        state = (await _get_json(f"{base}/debug/kv"))["models"][MODEL][
            f"{namespace}/backend/generate"
        ]
        assert state["routing"]["requests"] == 9
        # 6 of the 9 requests found their ~8-block system prompt cached.
        assert state["routing"]["hit_rate"] > 0.5
        assert state["feed"]["live_workers"] == sorted(f"{rt.instance_id:016x}" for rt in runtimes)
        assert sum(w["cached_blocks"] for w in state["workers"].values()) > 0
    finally:
        stop.set()
        await asyncio.wait_for(frontend, 15)
        for runtime in runtimes:
            await runtime.shutdown(drain_timeout=1.0)


async def _feed_events_at_least(base: str, count: int) -> bool:
    models = (await _get_json(f"{base}/debug/kv"))["models"]
    return any(
        state["feed"]["events"] >= count
        for routers in models.values()
        for state in routers.values()
    )
