"""A second KV tier end to end: mocker workers with a host tier (`--kv-host-blocks`) behind
an in-loop frontend in `--router-mode kv`, over a real nats-server.

Claims: a prefix pushed out of a worker's device tier reaches the router as host-tier
blocks (its KV events: removed on GPU, stored on CPU); a request of that prefix is then
routed to that worker, not to the idle one without it, which loads the prefix back
(onboarding) and reports it as cached tokens; the router counts the request's host
blocks apart from device hits in `GET /debug/kv`.

Deterministic: prompts are token ids (their block hashes are known here), and the prefix
is evicted by requests handed to the worker's own engine, not routed, before the one
routed request is sent; every wait is for a state, never for a time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.protocols import PreprocessedRequest, StopConditions
from dynamo.mocker import MockEngine
from dynamo.testing.http import fetch_json
from dynamo.testing.mocker_clusters import mockers_behind_frontend
from dynamo.testing.mocker_stacks import mock_engine_config

MODEL = "smollm2-tiers"
BLOCK = 16
PREFIX = list(range(1000, 1000 + 20 * BLOCK))  # 20 full blocks
PREFIX_HASHES = compute_block_hashes(PREFIX, BLOCK)
WAIT_S = 20.0


async def debug_state(base: str, key: str) -> dict[str, Any]:
    return (await fetch_json(f"{base}/debug/kv"))["models"][MODEL][key]


async def wait_for(check: Any, what: str) -> None:
    """Poll the async `check` until it is true (bounded: fail with `what`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def run_on_engine(engine: MockEngine, request_id: str, tokens: list[int]) -> None:
    """A request handed to the worker's engine directly (the router never sees it)."""
    request = PreprocessedRequest(
        request_id=request_id,
        model=MODEL,
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=2),
    )
    async for _ in engine.generate(request):
        pass


def on_host_only(engine: MockEngine) -> bool:
    pool = engine.pool
    host = pool.host
    assert host is not None
    return all(h in host and not pool.is_cached(h) for h in PREFIX_HASHES)


async def test_a_host_tier_hit_routes_the_request_to_the_worker_holding_it(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    config = mock_engine_config(
        embedded_model, num_gpu_blocks=48, max_model_len=512, kv_host_blocks=256
    )
    async with mockers_behind_frontend(
        nats_url,
        embedded_model,
        tmp_path / "tok",
        model=MODEL,
        engine_config=config,
        router=RouterSettings(mode=RouterMode.KV),
        namespace_prefix="tiers",
    ) as stack:
        key = stack.endpoint_key
        async with openai.AsyncOpenAI(
            base_url=f"{stack.base}/v1", api_key="x", max_retries=0
        ) as client:
            await client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=2)
            served = [w for w in stack.workers if w.backend.engine.counters.requests]
            assert len(served) == 1
            holder = served[0]
            other = next(w for w in stack.workers if w is not holder)
            engine = holder.backend.engine
            assert engine.pool.match_prefix(PREFIX_HASHES) == 20

            # Push the prefix out of the holder's device tier into its host tier.
            for i in range(6):
                if on_host_only(engine):
                    break
                filler = list(range(5000 + 400 * i, 5000 + 400 * i + 20 * BLOCK))
                await run_on_engine(engine, f"filler-{i}", filler)
            assert on_host_only(engine), "the prefix went to the host tier"

            async def router_sees_host_blocks() -> bool:
                state = await debug_state(stack.base, key)
                view = state["workers"].get(holder.instance_hex, {})
                return view.get("cached_blocks_by_tier", {}).get("CPU", 0) >= 20

            await wait_for(router_sees_host_blocks, "the host-tier events at the router")
            before = await debug_state(stack.base, key)

            # The prefix plus a question: 20 of its 21 blocks are on the holder's host tier.
            question = list(range(3000, 3010))
            response = await client.completions.create(
                model=MODEL, prompt=PREFIX + question, max_tokens=2
            )

        after = await debug_state(stack.base, key)
        assert other.backend.engine.counters.requests == 0, "not the idle worker without it"
        assert engine.counters.onboarded_tokens == 20 * BLOCK
        usage = response.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 20 * BLOCK
        routed = after["workers"][holder.instance_hex]["routed"]
        routed_before = before["workers"][holder.instance_hex]["routed"]
        assert routed["requests"] == routed_before["requests"] + 1
        assert routed["host_blocks"] - routed_before["host_blocks"] == 20
        assert after["tier_weights"]["CPU"] == 0.75
