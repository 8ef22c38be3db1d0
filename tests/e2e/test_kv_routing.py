"""KV-aware routing with two real vLLM workers on the embedded model.

Claims: a request sharing a long prefix with an earlier one goes to the worker that served
the earlier one, and that worker reports the prefix as cached prompt tokens; after the
worker's `clear_kv_blocks` endpoint runs, the router's index forgets its blocks (seen in
`GET /debug/kv`) and the prefix is no longer cached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from dynamo.testing.http import (
    kv_router_views,
    predicted_hit_rate,
    routed_one_more,
    routed_totals,
    wait_prefix_indexed,
)
from dynamo.testing.processes import FrontendProcess, WorkerProcess, stop_all
from dynamo.testing.waiting import wait_until

NAMESPACE = "e2e-kv"
COMPONENT = "kvroute"
MODEL = "smollm2-135m-instruct"
BLOCK = 32
WORKERS_ENDPOINT = f"{NAMESPACE}/{COMPONENT}/generate"
POLL_S = 0.2


@pytest.fixture(scope="module")
def kv_cluster(
    embedded_model: Path, nats_url: str, e2e_log_dir: Path
) -> Iterator[tuple[FrontendProcess, list[WorkerProcess]]]:
    """Two workers behind a frontend in `--router-mode kv`."""
    workers = [
        WorkerProcess(f"kv-worker-{i}", embedded_model, nats_url, e2e_log_dir,
                      namespace=NAMESPACE, component=COMPONENT)
        for i in range(2)
    ]  # fmt: skip
    frontend = FrontendProcess(
        "kv-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE, extra=["--router-mode", "kv"]
    )
    try:
        for worker in workers:
            worker.wait_ready()
        frontend.wait_for_model(MODEL)
        frontend.wait_kv_router_workers(MODEL, WORKERS_ENDPOINT, 2)
        yield frontend, workers
    finally:
        frontend.stop()
        stop_all(workers)


def router_states(frontend: FrontendProcess) -> list[dict[str, Any]]:
    """The router of every frontend process (N with `--http-workers N`)."""
    return kv_router_views(frontend.base_url, MODEL, WORKERS_ENDPOINT)


def routed_counts(frontend: FrontendProcess) -> dict[str, int]:
    return routed_totals(router_states(frontend))


def cached_blocks(frontend: FrontendProcess, worker_hex: str) -> int:
    """The blocks of `worker_hex` the least caught-up frontend process has indexed."""
    return min(
        state["workers"].get(worker_hex, {}).get("cached_blocks", 0)
        for state in router_states(frontend)
    )


def system_prompt(topic: str) -> str:
    facts = " ".join(f"Fact {i} about {topic}: it is item number {i}." for i in range(40))
    return f"You are an expert on {topic}. {facts}"


def chat(frontend: FrontendProcess, system: str, question: str) -> Any:
    client = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
    )


def send_and_locate(frontend: FrontendProcess, system: str, question: str) -> tuple[str, Any]:
    """Send one chat request; return the worker it was routed to and the response."""
    before = routed_counts(frontend)
    response = chat(frontend, system, question)
    return routed_one_more(before, routed_counts(frontend)), response


def cached_tokens(response: Any) -> int:
    details = response.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_a_shared_prefix_follows_the_worker_that_caches_it(
    kv_cluster: tuple[FrontendProcess, list[WorkerProcess]],
) -> None:
    frontend, _ = kv_cluster
    for topic in ("volcanoes", "sailing", "bread"):
        system = system_prompt(topic)
        owner, first = send_and_locate(frontend, system, "Name one.")
        prompt_blocks = wait_prefix_indexed(
            lambda o=owner: cached_blocks(frontend, o),
            first.usage.prompt_tokens,
            BLOCK,
            interval=POLL_S,
        )
        for question in ("Name another.", "Which is the most famous?"):
            worker, response = send_and_locate(frontend, system, question)
            assert worker == owner, f"{topic}: {question!r} went to {worker}, cache on {owner}"
            assert cached_tokens(response) >= (prompt_blocks - 1) * BLOCK
    assert predicted_hit_rate(router_states(frontend)) > 0.5


def test_clear_kv_blocks_makes_the_router_forget_the_workers_cache(
    kv_cluster: tuple[FrontendProcess, list[WorkerProcess]], nats_url: str
) -> None:
    frontend, _ = kv_cluster
    system = system_prompt("glaciers")
    owner, first = send_and_locate(frontend, system, "Name one.")
    blocks = first.usage.prompt_tokens // BLOCK
    wait_until(
        lambda: cached_blocks(frontend, owner) >= blocks,
        timeout=10,
        interval=POLL_S,
        what=f"{blocks} blocks indexed for worker {owner}",
    )

    results = asyncio.run(clear_kv_blocks(nats_url, int(owner, 16)))
    assert results and all(r["cleared"] for r in results), results

    # No further engine step is needed for the router to hear about it.
    wait_until(
        lambda: cached_blocks(frontend, owner) == 0,
        timeout=10,
        interval=POLL_S,
        what=f"the router to forget worker {owner}'s blocks",
    )
    _, again = send_and_locate(frontend, system, "Name one.")
    assert cached_tokens(again) == 0, "the worker's prefix cache was really dropped"


async def clear_kv_blocks(nats_url: str, instance_id: int) -> list[dict[str, Any]]:
    """Call one worker's `clear_kv_blocks` endpoint over NATS."""
    from dynamo.runtime import DistributedRuntime

    runtime = await DistributedRuntime.connect(nats_url)
    try:
        endpoint = runtime.namespace(NAMESPACE).component(COMPONENT).endpoint("clear_kv_blocks")
        client = await endpoint.client(wait_for_instances=10)
        return [result async for result in client.direct({}, instance_id)]
    finally:
        await runtime.shutdown(drain_timeout=1.0)
