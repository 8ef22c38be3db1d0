"""Mocker workers behind a real frontend in `--router-mode kv`, over a real nats-server.

Claims: the KV router learns the mockers' caches from their events and sends requests
sharing a prefix to the worker holding it (which reports the hit as cached tokens); the
router sees the K speculative slots the mockers advertise; a client that drops a stream
frees the mocker's blocks at once; `python -m dynamo.mocker` with several workers serves,
clears its cache on request and leaves cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
from prometheus_client import CollectorRegistry

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.llm.protocols import (
    ClearKvBlocksResult,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from dynamo.llm.worker import workers_health
from dynamo.mocker.metrics import MockerCollector
from dynamo.mocker.timing import TimingModel
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.system_server import SystemServer
from dynamo.testing.http import fetch_json
from dynamo.testing.mocker_clusters import MockerCluster, mocker_cluster_fixture
from dynamo.testing.waiting import wait_until_async

MODEL = "mock-smollm2"
BLOCK = 16
K = 2


@dataclass
class Cluster(MockerCluster):
    async def router_view(self) -> dict[str, Any]:
        models = (await fetch_json(f"{self.base}/debug/kv"))["models"]
        return models[MODEL][self.endpoint_key]

    async def router_knows_every_cache(self) -> bool:
        """The router's indexer holds exactly the blocks each mocker caches."""
        try:
            workers = (await self.router_view())["workers"]
        except (KeyError, aiohttp.ClientError):
            return False
        return all(
            workers.get(w.instance_hex, {}).get("cached_blocks")
            == w.backend.engine.pool.cached_blocks
            for w in self.workers
        )


# A long lease (the helper's 10 s): a heavily loaded test host can miss heartbeats, and
# nothing here depends on how fast a dead worker expires.
cluster = mocker_cluster_fixture(
    Cluster,
    MODEL,
    {
        "block_size": BLOCK,
        "num_gpu_blocks": 2048,
        "max_model_len": 4096,
        "num_speculative_tokens": K,
        # ~2 ms per step: long streams stay in flight while the test cancels them.
        "timing": TimingModel(prefill_ms_per_token=0.001, decode_ms_per_step=2.0),
    },
    router=RouterSettings(mode=RouterMode.KV),
    worker_name="mocker-{}",
    interval=0.02,
)


async def test_shared_prefixes_land_on_the_mocker_holding_them(cluster: Cluster) -> None:
    served = cluster.engine_requests
    async with openai.AsyncOpenAI(
        base_url=f"{cluster.base}/v1", api_key="x", max_retries=0
    ) as client:
        for group in range(3):
            system = f"Tenant {group}. " + " ".join(f"rule{group}-{i}" for i in range(80))
            owners, cached = [], []
            for question in ("Summarise.", "List three rules.", "Which rule is first?"):
                before = served()
                response = await client.chat.completions.create(
                    model=MODEL,
                    messages=[
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    max_tokens=3,
                )
                assert response.choices[0].finish_reason == "length"
                assert response.choices[0].message.content
                owners.append(next(i for i, n in enumerate(served()) if n > before[i]))
                details = response.usage.prompt_tokens_details  # type: ignore[union-attr]
                cached.append(details.cached_tokens if details else 0)
                # Route the next request only once the router applied this one's events.
                await wait_until_async(
                    cluster.router_knows_every_cache,
                    timeout=5,
                    what="the router to index exactly what each mocker caches",
                )
            assert owners == [owners[0]] * 3, f"group {group} was split: {owners}"
            assert cached[0] == 0
            assert all(c >= 10 * BLOCK for c in cached[1:]), cached

    view = await cluster.router_view()
    assert view["routing"]["hit_rate"] > 0.5
    for worker in cluster.workers:
        entry = view["workers"][worker.instance_hex]
        assert entry["num_speculative_tokens"] == K


async def test_dropping_a_stream_frees_the_mockers_blocks(cluster: Cluster) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to a thousand, slowly."}],
        "max_tokens": 3000,
        "stream": True,
    }
    before = [w.backend.engine.counters.finished.get("cancelled", 0) for w in cluster.workers]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cluster.base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first SSE line: the stream is running
            busy = [w for w in cluster.workers if w.backend.engine.num_running]
            assert len(busy) == 1 and busy[0].backend.engine.pool.active_blocks > 0
        # Leaving the block closed the connection mid-stream.
    worker = busy[0]

    async def freed() -> bool:
        return (
            worker.backend.engine.num_running == 0 and worker.backend.engine.pool.active_blocks == 0
        )

    await wait_until_async(freed, timeout=10.0, what="the dropped stream's blocks to be freed")
    after = [w.backend.engine.counters.finished.get("cancelled", 0) for w in cluster.workers]
    assert sum(after) - sum(before) == 1
    assert worker.backend.engine.sequences.active_requests == 0


async def test_mocker_process_serves_clears_and_stops_on_sigterm(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = "mockp" + uuid.uuid4().hex[:8]
    log_path = tmp_path / "mocker.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dynamo.mocker",
            "--model",
            str(embedded_model),
            "--nats-server",
            nats_url,
            "--namespace",
            namespace,
            "--num-workers",
            "3",
            "--speed-up",
            "20",
            "--lease-ttl",
            "10",
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    runtime = await DistributedRuntime.connect(nats_url)
    try:
        component = runtime.namespace(namespace).component("backend")
        generate = await component.endpoint("generate").client()
        clear = await component.endpoint("clear_kv_blocks").client()

        async def three_workers() -> bool:
            assert proc.returncode is None, log_path.read_text()
            return len(generate.instance_ids()) == 3 and len(clear.instance_ids()) == 3

        await wait_until_async(
            three_workers, timeout=20, what="three mocker workers to serve both endpoints"
        )
        request = PreprocessedRequest(
            request_id="p1",
            model="smollm2-135m-instruct",
            token_ids=list(range(1000, 1040)),
            stop_conditions=StopConditions(max_tokens=5),
        )
        target = generate.instance_ids()[0]
        outputs = [
            o
            async for o in generate.direct(
                request, target, response_type=LLMEngineOutput, request_id="p1"
            )
        ]
        assert sum(len(o.token_ids) for o in outputs) == 5
        assert outputs[-1].finish_reason is not None
        results = [r async for r in clear.direct({}, target, response_type=ClearKvBlocksResult)]
        assert [(r.worker_id, r.cleared) for r in results] == [(target, True)]

        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            raise AssertionError(f"no exit 15 s after SIGTERM:\n{log_path.read_text()}") from None
        assert code == 0, log_path.read_text()

        async def gone() -> bool:
            return not generate.instance_ids()

        # Deregistered, not expired: well within the 10 s lease.
        await wait_until_async(gone, timeout=2.0, what="every mocker worker to deregister")
        await generate.close()
        await clear.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await runtime.shutdown(drain_timeout=0)


async def test_system_server_reports_health_and_metrics_per_worker(cluster: Cluster) -> None:
    # Its own request, so the counters exist whichever tests of this module ran before it
    # (pytest-xdist may run them in the other process).
    async with openai.AsyncOpenAI(
        base_url=f"{cluster.base}/v1", api_key="x", max_retries=0
    ) as client:
        await client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    registry = CollectorRegistry()
    registry.register(MockerCollector(cluster.workers, MODEL))
    server = SystemServer("127.0.0.1", 0, workers_health(cluster.workers), registry)
    port = await server.start()
    try:
        health = await fetch_json(f"http://127.0.0.1:{port}/health")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                metrics = await resp.text()
    finally:
        await server.stop()
    assert health["status"] == "healthy" and len(health["workers"]) == 2
    for worker in cluster.workers:
        label = f'worker="{worker.instance_hex}"'
        assert f'dynamo_mocker_cached_blocks{{model="{MODEL}",{label}}}' in metrics
    assert "dynamo_worker_spec_decode_mean_acceptance_length" in metrics
    assert 'dynamo_worker_requests_total{model="mock-smollm2"' in metrics
