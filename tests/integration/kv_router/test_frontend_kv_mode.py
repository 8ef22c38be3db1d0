"""The frontend in `--router-mode kv` over a real nats-server, with two scripted workers that
publish what they cache through the real worker-side publisher.

Claims: requests sharing a long prefix follow the worker that cached it; `GET /debug/kv`
shows each worker's cached blocks and the predicted hit rate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
from kv_support import new_namespace

from dynamo.frontend.engine.routing import RouterMode
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
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import fetch_json, wait_for_instances_async
from dynamo.testing.waiting import wait_until_async

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


async def test_shared_prefixes_follow_the_cache_and_debug_view_shows_it(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = new_namespace()
    runtimes = [await DistributedRuntime.connect(nats_url, lease_ttl=2.0) for _ in range(2)]
    workers = [CachingWorker(rt, namespace) for rt in runtimes]
    frontend = InLoopFrontend.start(
        nats_url, namespace, tmp_path / "tok", router_mode=RouterMode.KV
    )
    base = frontend.base_url
    try:
        for worker in workers:
            await worker.start(embedded_model)
        await wait_for_instances_async(base, MODEL, 2, timeout=30)
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
                    await wait_until_async(
                        lambda n=sent: feed_events_at_least(base, 2 + n),
                        timeout=5,
                        interval=0.05,
                        what=f"the router to apply {2 + sent} events",
                    )
                assert owners == [owners[0]] * 3, f"group {group} was split: {owners}"

        state = (await fetch_json(f"{base}/debug/kv"))["models"][MODEL][
            f"{namespace}/backend/generate"
        ]
        assert state["routing"]["requests"] == 9
        # 6 of the 9 requests found their ~8-block system prompt cached.
        assert state["routing"]["hit_rate"] > 0.5
        assert state["feed"]["live_workers"] == sorted(f"{rt.instance_id:016x}" for rt in runtimes)
        assert sum(w["cached_blocks"] for w in state["workers"].values()) > 0
    finally:
        await frontend.stop()
        for runtime in runtimes:
            await runtime.shutdown(drain_timeout=1.0)


async def feed_events_at_least(base: str, count: int) -> bool:
    """Whether a KV router of the frontend at `base` has applied `count` events."""
    models = (await fetch_json(f"{base}/debug/kv"))["models"]
    return any(
        state["feed"]["events"] >= count
        for routers in models.values()
        for state in routers.values()
    )
