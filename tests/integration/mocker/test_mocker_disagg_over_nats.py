"""Disaggregated serving with mockers: a real frontend, a prefill mocker and a decode
mocker over a real nats-server.

Claims: a request is prefilled on the prefill mocker (its prompt computed there) and
decoded on the decode mocker, which computes none of the prompt and receives all of it by
(simulated) KV transfer, as the workers' `/metrics` series say; with no prefill worker the
decode mocker prefills the prompt itself.

Deterministic: every prompt starts with a word of its own, so no prompt shares a block
with another (the counters' deltas are exact), and the measured request is sent only once
a warm-up request went through the prefill worker, i.e. once the frontend pairs the two.
The frontend of those two tests sends every prompt to a prefill worker
(`--disagg-prefill remote`); the last test runs the conditional policy over the same
fleet shape and checks each of its decisions: a short prompt and a prompt the decode
worker caches are prefilled there, a long one remotely, and one that arrives while the
prefill worker's queue is over its threshold is prefilled by the idle decode worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from prometheus_client import CollectorRegistry

from dynamo.frontend.engine.prefill_policy import DisaggSettings, PrefillMode
from dynamo.frontend.engine.routing import RouterMode
from dynamo.llm.protocols import WorkerType
from dynamo.llm.worker import ServedWorker
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.metrics import MockerCollector
from dynamo.mocker.timing import TimingModel
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import (
    fetch_json,
    fetch_text,
    metric_values,
    wait_for_instances_async,
)
from dynamo.testing.mocker_stacks import mock_engine_config
from dynamo.testing.waiting import wait_until_async

MODEL = "mock-disagg"
PROMPT_WORDS = 400


def long_prompt() -> str:
    """A prompt of ~400 tokens sharing no block with any other."""
    return f"{uuid.uuid4().hex} " + " ".join(f"w{i % 97}" for i in range(PROMPT_WORDS))


@dataclass
class Fleet:
    client: openai.AsyncOpenAI
    decode: ServedWorker[MockerBackend]
    prefill: ServedWorker[MockerBackend] | None
    registry: CollectorRegistry
    base_url: str
    namespace: str

    def metric(self, name: str, worker: ServedWorker[MockerBackend], **labels: str) -> float:
        """A worker's series as its `/metrics` shows it (0 when absent)."""
        labels = {"model": MODEL, "worker": worker.instance_hex or "", **labels}
        return self.registry.get_sample_value(name, labels) or 0.0

    async def complete(self, prompt: str | None = None) -> int:
        """One request (default: a long prompt of its own); its prompt tokens."""
        if prompt is None:
            prompt = long_prompt()
        response = await self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert response.choices[0].finish_reason == "length"
        assert response.usage is not None and response.usage.completion_tokens == 4
        return response.usage.prompt_tokens


ALWAYS_REMOTE = DisaggSettings(mode=PrefillMode.REMOTE)


@asynccontextmanager
async def fleet(
    nats_url: str,
    model_path: Path,
    tokenizer_cache: Path,
    *,
    with_prefill: bool,
    disagg: DisaggSettings = ALWAYS_REMOTE,
    router_mode: RouterMode = RouterMode.ROUND_ROBIN,
    prefill_timing: TimingModel | None = None,
) -> AsyncIterator[Fleet]:
    """A decode mocker, a prefill mocker when `with_prefill` (with `prefill_timing`, if
    given), and a frontend, in a namespace of their own, registered as `python -m
    dynamo.mocker --is-decode-worker` / `--is-prefill-worker` register them."""
    namespace = "mockdisagg" + uuid.uuid4().hex[:8]
    base = WorkerSettings(namespace=namespace, nats_server=nats_url, lease_ttl=10.0)
    config = mock_engine_config(model_path)

    def worker(
        settings: WorkerSettings, name: str, **timing: TimingModel
    ) -> ServedWorker[MockerBackend]:
        own = dataclasses.replace(config, **timing)
        return mocker_worker(
            settings, own, model_path=model_path, served_model_name=MODEL, name=name
        )

    decode = worker(dataclasses.replace(base, disaggregation_mode="decode"), "decode")
    prefill = (
        worker(
            dataclasses.replace(
                base, disaggregation_mode="prefill", component="prefill", migration_limit=0
            ),
            "prefill",
            **({"timing": prefill_timing} if prefill_timing is not None else {}),
        )
        if with_prefill
        else None
    )
    workers = [w for w in (prefill, decode) if w is not None]
    registry = CollectorRegistry()
    registry.register(MockerCollector(workers, MODEL))
    frontend = InLoopFrontend.start(
        nats_url, namespace, tokenizer_cache, router_mode=router_mode, disagg=disagg
    )
    try:
        for w in workers:
            await w.start()
        await wait_for_instances_async(frontend.base_url, MODEL, 1, timeout=60)
        async with openai.AsyncOpenAI(
            base_url=f"{frontend.base_url}/v1", api_key="x", max_retries=0
        ) as client:
            yield Fleet(client, decode, prefill, registry, frontend.base_url, namespace)
    finally:
        await frontend.stop()
        for w in workers:
            await w.stop(drain_timeout=1.0)


async def test_prefill_worker_computes_the_prompt_decode_worker_receives_it(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    async with fleet(nats_url, embedded_model, tmp_path, with_prefill=True) as f:
        prefill, decode = f.prefill, f.decode
        assert prefill is not None
        assert prefill.card is not None and prefill.card.worker_type is WorkerType.PREFILL
        assert decode.card is not None and decode.card.worker_type is WorkerType.DECODE

        async def through_the_prefill_worker() -> bool:
            before = prefill.backend.engine.counters.requests
            await f.complete()
            return prefill.backend.engine.counters.requests > before

        await wait_until_async(
            through_the_prefill_worker,
            timeout=30,
            interval=0.1,
            what="the frontend to send a prefill leg to the prefill mocker",
        )

        computed = "dynamo_mocker_computed_prompt_tokens_total"
        transferred = "dynamo_mocker_transferred_prompt_tokens_total"
        loaded = "dynamo_worker_remote_prefills_total"
        names = (computed, transferred)
        before = {(n, w.name): f.metric(n, w) for n in names for w in (prefill, decode)}
        loads = f.metric(loaded, decode, outcome="loaded")
        prompt_tokens = await f.complete()

        def delta(name: str, worker: ServedWorker[MockerBackend]) -> float:
            return f.metric(name, worker) - before[(name, worker.name)]

        assert prompt_tokens > 256
        assert delta(computed, prefill) == prompt_tokens
        assert delta(transferred, prefill) == 0
        assert delta(computed, decode) == 0
        assert delta(transferred, decode) == prompt_tokens
        assert f.metric(loaded, decode, outcome="loaded") == loads + 1
        assert f.metric(loaded, decode, outcome="refused") == 0
        # The decode worker's cache now holds the prompt it never computed.
        assert decode.backend.engine.pool.cached_blocks >= prompt_tokens // 16


async def test_without_a_prefill_worker_the_decode_mocker_prefills_itself(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    async with fleet(nats_url, embedded_model, tmp_path, with_prefill=False) as f:
        computed = "dynamo_mocker_computed_prompt_tokens_total"
        transferred = "dynamo_mocker_transferred_prompt_tokens_total"
        prompt_tokens = await f.complete()
        assert f.metric(computed, f.decode) == prompt_tokens
        assert f.metric(transferred, f.decode) == 0
        assert f.metric("dynamo_worker_remote_prefills_total", f.decode, outcome="loaded") == 0


async def test_conditional_disaggregation_decides_per_request(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    """Each decision of `--disagg-prefill conditional` (kv router mode), in the workers'
    counters: short prompt and cached prompt on the decode worker, long prompt on the
    prefill worker, and a long prompt arriving while the prefill worker has one queued
    (its prefill takes ~2 s here, so the queue is seen for certain) on the decode worker."""
    policy = DisaggSettings(local_prefill_tokens=256, prefill_queue_tokens=200)
    slow_prefill = TimingModel(prefill_ms_per_token=5.0, speed_up=1.0)
    async with fleet(
        nats_url, embedded_model, tmp_path, with_prefill=True, disagg=policy,
        router_mode=RouterMode.KV, prefill_timing=slow_prefill,
    ) as f:  # fmt: skip
        prefill, decode = f.prefill, f.decode
        assert prefill is not None
        computed = "dynamo_mocker_computed_prompt_tokens_total"

        async def decided(reason: str) -> float:
            text = await fetch_text(f"{f.base_url}/metrics")
            return sum(metric_values(text, DECISIONS, {"reason": reason}))

        def on(worker: ServedWorker[MockerBackend]) -> float:
            return f.metric(computed, worker)

        await wait_until_async(
            lambda: prefill_seen(f), timeout=30, interval=0.1,
            what="the frontend's kv router to see the prefill worker",
        )  # fmt: skip
        before = on(prefill), on(decode)
        short = await f.complete(f"{uuid.uuid4().hex} Name three colours.")
        assert await decided("short_prompt") == 1
        assert (on(prefill), on(decode)) == (before[0], before[1] + short)

        prompt = long_prompt()
        tokens = await f.complete(prompt)
        assert await decided("long_prompt") == 1
        assert on(prefill) == before[0] + tokens and on(decode) == before[1] + short

        await f.complete(prompt)  # the decode worker now caches it: only the tail is computed
        assert await decided("cached_on_decode") == 1
        assert on(prefill) == before[0] + tokens
        assert on(decode) - (before[1] + short) < 16

        queued = asyncio.create_task(f.complete())  # ~2 s on the prefill worker
        await wait_until_async(
            lambda: prefill_booked(f), timeout=10, interval=0.02,
            what="the prefill leg to be booked",
        )  # fmt: skip
        mid = on(decode)
        busy = await f.complete()
        assert await decided("prefill_pool_busy") == 1
        assert on(decode) == mid + busy, "the decode worker computed the prompt"
        assert not queued.done(), "the queued prefill ended before the decision was checked"
        await queued
        assert await decided("long_prompt") == 2


DECISIONS = "dynamo_frontend_prefill_decisions_total"


async def prefill_router(f: Fleet) -> dict[str, Any] | None:
    """The frontend's kv router view of the prefill endpoint (None before it has one)."""
    view = await fetch_json(f"{f.base_url}/debug/kv")
    return view["models"].get(MODEL, {}).get(f"{f.namespace}/prefill/generate")


async def prefill_seen(f: Fleet) -> bool:
    """Whether the frontend's router for the prefill endpoint knows a live worker."""
    router = await prefill_router(f)
    return router is not None and bool(router["feed"]["live_workers"])


async def prefill_booked(f: Fleet) -> int:
    """Requests the frontend's prefill router has booked and not yet freed."""
    router = await prefill_router(f)
    return sum(w["active_requests"] for w in router["workers"].values()) if router else 0
