"""The planner end to end on a short trace: a real frontend (kv routing), the planner with
its `local` connector starting mocker workers, and a client sending a burst and then a
trickle.

Claims: under the burst the planner grows the pool past its minimum; after it, with only
the trickle left, it shrinks the pool back to one worker, the stopped workers drain while
requests still arrive; and every request, before, during and after each change, completes
with all its tokens.

Why the counts hold on any machine: the profile is made for this test (a linear step time
`20 + 8 * batch` ms, which the mocker's own timing model reproduces exactly), so one worker
carries about 2.5 requests/s of 40 tokens within the 100 ms ITL target; the burst offers
6/s, which no single worker can carry even if the machine is slow, and the trickle 0.25/s,
which one worker carries even at the model's largest slow-down (4x). Timeouts are hang
guards only.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import aiohttp
import pytest

from dynamo.planner.args import parse_args
from dynamo.planner.pools import PoolRole
from dynamo.planner.service import local_connector, run_planner
from dynamo.testing.processes import FrontendProcess, running
from dynamo.testing.waiting import wait_until_async

pytestmark = pytest.mark.integration

SERVED = "planner-e2e"
OUTPUT_TOKENS = 40
PROMPT_TOKENS = 32
BURST_RPS, BURST_S = 6.0, 12.0
TRICKLE_RPS = 0.25
GUARD_S = 120.0
BATCHES = [1, 2, 4, 8, 16, 32]
STEP_MS = [20.0 + 8.0 * b for b in BATCHES]


def write_profile(path: Path) -> Path:
    """A profile of an engine without speculation whose step is `20 + 8 * batch` ms."""
    profile = {
        "model": SERVED, "method": "none", "speculative_config": {}, "batch_sizes": BATCHES,
        "acceptance_per_position": [], "step_times": [{"k": 0, "step_ms": STEP_MS}],
        "no_speculation_step_ms": STEP_MS, "schedule": [[1, 32, 0]], "max_batch_size": 32,
    }  # fmt: skip
    path.write_text(json.dumps(profile))
    return path


async def send(session: aiohttp.ClientSession, url: str, seed: int) -> str | None:
    """One completion; None when it came back whole, else what went wrong."""
    rng = random.Random(seed)
    body = {
        "model": SERVED, "prompt": [rng.randrange(1000, 9000) for _ in range(PROMPT_TOKENS)],
        "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
    }  # fmt: skip
    try:
        async with session.post(url, json=body) as resp:
            payload = await resp.json(content_type=None)
    except (aiohttp.ClientError, ValueError) as exc:
        return repr(exc)
    if resp.status != 200:
        return f"{resp.status}: {payload}"
    tokens = (payload.get("usage") or {}).get("completion_tokens")
    return None if tokens == OUTPUT_TOKENS else f"{tokens} tokens: {payload}"


async def test_the_planner_grows_the_pool_under_a_burst_and_shrinks_it_after(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = "planner" + str(random.randrange(10**8))
    with running([]) as procs:
        frontend = FrontendProcess(
            "frontend", nats_url, tmp_path, namespace=namespace, extra=["--router-mode", "kv"]
        )
        procs.append(frontend)
        config = parse_args([
            "--ttft-ms", "2000", "--itl-ms", "100", "--profile", str(write_profile(tmp_path / "p.json")),
            "--model", str(embedded_model), "--served-model-name", SERVED,
            "--namespace", namespace, "--nats-server", nats_url,
            "--frontend-url", frontend.base_url, "--worker-kind", "mocker",
            "--min-decode-workers", "1", "--max-decode-workers", "3",
            "--interval", "2", "--cooldown", "4", "--scale-down-intervals", "2",
            "--prefill-ms-per-token", "0.5", "--default-isl", str(PROMPT_TOKENS),
            "--default-osl", str(OUTPUT_TOKENS), "--drain-timeout", "5",
            "--log-dir", str(tmp_path / "workers"),
            "--decode-worker-args", "--decode-ms-per-step 20 --decode-ms-per-token 8 "
            "--prefill-ms-per-token 0.5",
        ])  # fmt: skip
        connector = local_connector(config)
        stop = asyncio.Event()
        planner = asyncio.create_task(run_planner(config, stop, connector))
        seen: list[int] = []
        outcomes: list[asyncio.Task[str | None]] = []
        url = f"{frontend.base_url}/v1/completions"
        try:
            async with aiohttp.ClientSession() as session:

                async def served_or_failed() -> bool:
                    return planner.done() or await send(session, url, -1) is None

                await wait_until_async(
                    served_or_failed, timeout=GUARD_S, interval=1.0, what="the first worker"
                )
                assert not planner.done(), planner.exception()

                async def offer(rate: float, seconds: float | None) -> None:
                    """Send at `rate` for `seconds` (None: until the pool is back to 1)."""
                    loop = asyncio.get_running_loop()
                    end = None if seconds is None else loop.time() + seconds
                    while end is None or loop.time() < end:
                        replicas = await connector.replicas(PoolRole.AGGREGATED)
                        seen.append(replicas)
                        if end is None and replicas == 1:
                            return
                        seed = len(outcomes)
                        outcomes.append(asyncio.create_task(send(session, url, seed)))
                        await asyncio.sleep(1.0 / rate)

                await offer(BURST_RPS, BURST_S)
                grown = max(seen)
                await asyncio.wait_for(offer(TRICKLE_RPS, None), GUARD_S)
                failures = [f for f in await asyncio.gather(*outcomes) if f is not None]
        finally:
            stop.set()
            await asyncio.wait_for(planner, GUARD_S)
    assert grown >= 2, f"the pool never grew under the burst: {seen}"
    assert seen[-1] == 1
    assert not failures, failures[:5]
    assert len(outcomes) > BURST_RPS * BURST_S / 2
