"""Migration under load: a worker SIGKILLed with 200 streams in flight loses none of them.

Three simulated workers (`python -m dynamo.mocker`, the default `--migration-limit`, which
is now on) serve a frontend process; 200 streaming completions with distinct prompts,
`max_tokens` fixed and `ignore_eos`, are all in flight when the process holding one of the
workers is SIGKILLed. Every request must complete with exactly `max_tokens` tokens, and
its text must be exactly what the workers' deterministic generator produces: the
original request's first N tokens followed by what the continuation (prompt + those N
tokens) produces, so a token repeated, dropped or generated twice would show. The number
of requests that needed such a continuation must equal the frontend's
`dynamo_frontend_migrations_total`.

The mocker's tokens depend only on the engine seed, the request's seed and its prompt
(`dynamo.mocker.tokens`), so the test computes the expected tokens with the mocker's own
`admit_request` and engine configuration (`dynamo.testing.mocker_tokens`; the same
defaults the worker processes run with).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from dynamo.testing.http import metric_values
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.mocker_tokens import ExpectedTokens
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_for_instances
from dynamo.testing.sse import StreamOutcome, stream_completion
from dynamo.testing.waiting import wait_until_async

log = logging.getLogger(__name__)

MODEL = "mock-migrate"
REQUESTS = 200
MAX_TOKENS = 40
PROMPT_LEN = 24
LEASE_TTL = 2.0
STEP_MS = 100.0  # every request gets one token per 100 ms, whatever the batch size


def mocker_command(nats_url: str, namespace: str, model_dir: Path, workers: int) -> list[str]:
    return mocker_argv(
        model_dir, nats_url, namespace,
        "--num-workers", str(workers),
        "--lease-ttl", str(LEASE_TTL),
        "--decode-ms-per-step", str(STEP_MS),
        "--decode-ms-per-token", "0",
        "--prefill-ms-per-token", "0",
        "--no-kv-events",
        served_model_name=MODEL,
    )  # fmt: skip


def prompts() -> list[list[int]]:
    """Distinct prompts of ordinary word tokens (the mocker draws output from them)."""
    return [random.Random(i).sample(range(1000, 9000), PROMPT_LEN) for i in range(REQUESTS)]


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    failed: int = 0  # ended with an error
    lost: int = 0  # no [DONE], or the client raised
    migrated: int = 0
    wrong: int = 0  # completed with the wrong token count or text


async def test_sigkill_under_load_loses_no_stream(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = "load" + uuid.uuid4().hex[:8]
    procs: list[ManagedProcess] = []
    with running(procs):
        survivors = ManagedProcess(
            "mocker-survivors", mocker_command(nats_url, namespace, embedded_model, 2), tmp_path
        )
        procs.append(survivors)
        victim = ManagedProcess(
            "mocker-victim", mocker_command(nats_url, namespace, embedded_model, 1), tmp_path
        )
        procs.append(victim)
        frontend = FrontendProcess("frontend", nats_url, tmp_path, namespace=namespace)
        procs.append(frontend)
        expected = ExpectedTokens(embedded_model, MODEL)
        await asyncio.to_thread(
            wait_for_instances, frontend.base_url, MODEL, 3, procs, timeout=90, interval=0.3
        )

        chunks = [0] * REQUESTS
        all_prompts = prompts()

        async def one(session: aiohttp.ClientSession, i: int) -> StreamOutcome:
            def progress(outcome: StreamOutcome) -> None:
                chunks[i] = len(outcome.texts)

            body = {
                "model": MODEL, "prompt": all_prompts[i], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            return await stream_completion(session, frontend.base_url, body, on_chunk=progress)

        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=90)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            streams = [asyncio.ensure_future(one(session, i)) for i in range(REQUESTS)]
            await wait_until_async(
                lambda: min(chunks) >= 3,
                timeout=60,
                interval=0.05,
                what=lambda: f"every stream in flight ({sum(c > 0 for c in chunks)} started)",
            )
            assert not any(s.done() for s in streams), "a stream ended before the kill"
            victim.kill()
            outcomes = await asyncio.gather(*streams, return_exceptions=True)
            async with session.get(f"{frontend.base_url}/metrics") as resp:
                metrics = await resp.text()

    tally = Tally(sent=REQUESTS)
    for i, outcome in enumerate(outcomes):
        if not isinstance(outcome, StreamOutcome) or not outcome.done:
            tally.lost += 1
            log.error("request %d lost: %r", i, outcome)
            continue
        if outcome.error is not None:
            tally.failed += 1
            log.error("request %d failed: %s", i, outcome.error)
            continue
        usage = outcome.usage or {}
        resumed = await asyncio.to_thread(
            expected.migrations, all_prompts[i], outcome.text, MAX_TOKENS, 1
        )
        if resumed is None or usage.get("completion_tokens") != MAX_TOKENS:
            tally.wrong += 1
            log.error("request %d: unexpected output (usage %s): %r", i, usage, outcome.text)
            continue
        tally.completed += 1
        tally.migrated += resumed > 0
    migrations = sum(metric_values(metrics, "dynamo_frontend_migrations_total", {"model": MODEL}))
    print(f"\nmigration under load: {tally}, migrations counter {migrations:g}")
    assert tally == Tally(sent=REQUESTS, completed=REQUESTS, migrated=tally.migrated), (
        f"{tally}; logs in {tmp_path}"
    )
    assert tally.migrated > 0, "the killed worker had no request in flight"
    assert migrations == tally.migrated
