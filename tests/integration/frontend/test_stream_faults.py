"""Streams never hang: workers that die or go silent mid-request, through a real frontend
over a real nats-server.

Scripted worker processes (`migration_worker.py`) stream a known token script; one can be
told to go silent after N tokens while it keeps heartbeating (a hung engine). Claims:

* the only worker SIGKILLed mid-stream: the client gets an error event within the lease
  window (2 x TTL + margin), with the stream deadlines switched off, so the lease alone
  ends it; also when the model's last card went first (the frontend drops the model and
  closes the endpoint's client, which must still notice the instance's lease expire);
* a worker silent past `--inter-token-timeout`: the request is cancelled there and
  migrated to a healthy worker, and the client receives the complete, correct text (the
  migration is counted in `dynamo_frontend_migrations_total`); with no other worker it
  ends with an error event instead, within the deadline plus a margin; a request with
  structured output is not migrated (its grammar cannot resume) but ends with an error;
* a worker that never sends a first token within `--first-token-timeout`: HTTP 500 with
  a clear message, not a hang, and the request is cancelled on the worker;
* the model's last worker drained gracefully (card removed first, then in-flight
  requests get their drain time) finishes the streams it has in flight.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.service import FrontendConfig
from dynamo.mocker.args import EngineFlags, WorkerSettings
from dynamo.mocker.backend import mocker_worker
from dynamo.mocker.model_info import ModelInfo
from dynamo.mocker.timing import TimingModel
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.ports import free_port
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import fetch_json, metric_values, wait_for_instances_async
from dynamo.testing.sse import StreamOutcome, stream_completion
from dynamo.testing.waiting import wait_until_async

WORKER = Path(__file__).with_name("migration_worker.py")
MODEL = "migrate-test"  # migration_worker.py's default
PROMPT = list(range(200, 216))
SCRIPT = list(range(1000, 1100))  # what migration_worker.py streams, in order
LEASE_TTL = 2.0  # migration_worker.py's
DEADLINE = 1.5  # the deadlines the silent-worker tests run with
MARGIN = 2.0  # scheduling slack on a loaded test host


@dataclass
class ScriptedWorker:
    proc: asyncio.subprocess.Process
    instance_id: int

    def kill(self) -> None:
        """SIGKILL, as a crash; the exit is collected by `reap`."""
        if self.proc.returncode is None:
            self.proc.kill()

    async def reap(self) -> None:
        self.kill()
        await asyncio.wait_for(self.proc.wait(), 10)


@dataclass
class Cluster:
    base_url: str
    session: aiohttp.ClientSession
    workers: list[ScriptedWorker]
    serving: list[int] = field(default_factory=list)  # instance per request started
    cancelled: list[int] = field(default_factory=list)  # instance per request cancelled

    async def stream(self, max_tokens: int, on_chunk=None, **fields: object) -> StreamOutcome:
        body = {
            "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}, **fields,
        }  # fmt: skip
        return await asyncio.wait_for(
            stream_completion(self.session, self.base_url, body, on_chunk=on_chunk), 60
        )

    async def migrations(self) -> float:
        async with self.session.get(f"{self.base_url}/metrics") as resp:
            text = await resp.text()
        return sum(metric_values(text, "dynamo_frontend_migrations_total", {"model": MODEL}))


async def _start_worker(nats_url: str, namespace: str, model_dir: Path, extra: Sequence[str]):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(WORKER), nats_url, namespace, str(model_dir), str(len(PROMPT)),
        *extra,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    if not line.startswith("READY"):
        proc.kill()
        await proc.wait()
        raise AssertionError(f"worker did not start: {line!r}")
    return ScriptedWorker(proc, int(line.split()[1]))


@asynccontextmanager
async def cluster(
    nats_url: str,
    model_dir: Path,
    tmp_path: Path,
    worker_args: Sequence[Sequence[str]],
    *,
    first_token_s: float = 0.0,
    inter_token_s: float = 0.0,
) -> AsyncIterator[Cluster]:
    """Scripted workers (one per `worker_args`) behind an in-loop frontend with the given
    deadlines (0: off)."""
    namespace = "faults" + uuid.uuid4().hex[:8]
    observer = await DistributedRuntime.connect(nats_url, name="stream-faults-test")
    workers: list[ScriptedWorker] = []
    frontend: InLoopFrontend | None = None
    session = aiohttp.ClientSession()
    try:
        started = await asyncio.gather(
            *(_start_worker(nats_url, namespace, model_dir, a) for a in worker_args),
            return_exceptions=True,
        )
        workers = [w for w in started if isinstance(w, ScriptedWorker)]
        for failure in started:
            if isinstance(failure, BaseException):
                raise failure
        result = Cluster("", session, workers)

        async def on_serving(msg) -> None:
            result.serving.append(int(msg.data))

        async def on_cancelled(msg) -> None:
            result.cancelled.append(int(msg.data))

        await observer.subscribe(f"test.{namespace}.serving", on_serving)
        await observer.subscribe(f"test.{namespace}.cancelled", on_cancelled)
        config = FrontendConfig(
            http=HttpSettings(host="127.0.0.1", port=free_port()),
            namespace=namespace,
            nats_server=nats_url,
            tokenizer_cache=tmp_path / "tok",
            first_token_timeout_s=first_token_s,
            inter_token_timeout_s=inter_token_s,
        )
        frontend = InLoopFrontend(config)
        result.base_url = frontend.base_url
        await wait_for_instances_async(frontend.base_url, MODEL, len(workers), timeout=60)
        yield result
    finally:
        await session.close()
        if frontend is not None:
            await frontend.stop()
        for worker in workers:
            await worker.reap()
        await observer.shutdown(drain_timeout=0)


ScriptedCluster = Callable[..., AbstractAsyncContextManager[Cluster]]


@pytest.fixture
def scripted(nats_url: str, embedded_model: Path, tmp_path: Path) -> ScriptedCluster:
    """`cluster` over the session's nats-server and embedded model, in the test's own
    directory: call it with the workers' arguments and the deadlines."""
    return functools.partial(cluster, nats_url, embedded_model, tmp_path)


def _expected_text(model_dir: Path, count: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(SCRIPT[:count])


async def _wait_cancelled(c: Cluster, instance_id: int) -> None:
    await wait_until_async(
        lambda: instance_id in c.cancelled,
        timeout=5,
        what=f"the request to be cancelled on worker {instance_id}",
    )


async def test_sigkill_of_the_only_worker_ends_the_stream_within_the_lease_window(
    scripted: ScriptedCluster,
) -> None:
    async with scripted([[]]) as c:
        killed_at: list[float] = []

        def kill_after_five(outcome: StreamOutcome) -> None:
            if len(outcome.texts) == 5:
                c.workers[0].kill()
                killed_at.append(time.monotonic())

        outcome = await c.stream(max_tokens=90, on_chunk=kill_after_five)
        assert killed_at, "the stream never reached its fifth chunk"
        assert outcome.status == 200 and outcome.done
        assert outcome.error is not None and "worker lost" in outcome.error["message"]
        assert 5 <= len(outcome.texts) < 90
        waited = outcome.ended_at - killed_at[0]
        assert waited < 2 * LEASE_TTL + MARGIN, f"error after {waited:.2f}s"


async def test_last_worker_killed_after_its_card_went_is_still_noticed(
    scripted: ScriptedCluster,
) -> None:
    async with scripted([["--drop-card-after", "3"]]) as c:
        streaming = asyncio.ensure_future(c.stream(max_tokens=90))

        async def model_dropped_mid_stream() -> bool:
            if streaming.done():
                raise AssertionError(f"the stream ended first: {streaming.result().error}")
            models = (await fetch_json(f"{c.base_url}/v1/models"))["data"]
            return all(m["id"] != MODEL for m in models)

        await wait_until_async(
            model_dropped_mid_stream, timeout=30, interval=0.05, what="the model to be dropped"
        )
        c.workers[0].kill()
        killed_at = time.monotonic()
        outcome = await asyncio.wait_for(streaming, 2 * LEASE_TTL + MARGIN + 5)
        assert outcome.status == 200 and outcome.done
        assert outcome.error is not None and "worker lost" in outcome.error["message"]
        assert 3 <= len(outcome.texts) < 90
        waited = outcome.ended_at - killed_at
        assert waited < 2 * LEASE_TTL + MARGIN, f"error after {waited:.2f}s"


async def test_a_silent_worker_is_cut_and_the_stream_migrates(
    scripted: ScriptedCluster, embedded_model: Path
) -> None:
    """Both workers go silent after 5 tokens of a fresh request, but serve continuations:
    whichever gets the request stalls, the other finishes it."""
    stall = ["--stall-after", "5"]
    async with scripted([stall, stall], inter_token_s=DEADLINE) as c:
        outcome = await c.stream(max_tokens=30)
        assert outcome.completed, outcome.error
        assert outcome.text == _expected_text(embedded_model, 30)
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == 30
        assert outcome.usage["prompt_tokens"] == len(PROMPT)
        silent, rescuer = c.serving[0], c.serving[1]
        assert silent != rescuer
        await _wait_cancelled(c, silent)
        gaps = [b - a for a, b in zip(outcome.chunk_times, outcome.chunk_times[1:], strict=False)]
        assert DEADLINE - 0.1 < max(gaps) < DEADLINE + MARGIN
        assert await c.migrations() == 1


async def test_a_constrained_stream_fails_cleanly_instead_of_migrating(
    scripted: ScriptedCluster,
) -> None:
    """As above, but the request carries structured output: a continuation would start a
    second document after the first one's prefix (the engine applies the grammar to new
    output only), so the stream ends with an error naming why, and nothing migrates."""
    stall = ["--stall-after", "5"]
    async with scripted([stall, stall], inter_token_s=DEADLINE) as c:
        outcome = await c.stream(max_tokens=30, response_format={"type": "json_object"})
        assert outcome.status == 200 and outcome.done
        assert outcome.error is not None, f"completed: {outcome.text!r}"
        assert "constrained" in outcome.error["message"], outcome.error
        assert len(outcome.texts) == 5
        assert len(c.serving) == 1, "no continuation was sent to the other worker"
        await _wait_cancelled(c, c.serving[0])
        assert await c.migrations() == 0


async def test_a_silent_only_worker_ends_the_stream_with_an_error(
    scripted: ScriptedCluster,
) -> None:
    async with scripted([["--stall-after", "5"]], inter_token_s=DEADLINE) as c:
        outcome = await c.stream(max_tokens=30)
        assert outcome.status == 200 and outcome.done
        assert outcome.error is not None
        assert "stopped responding" in outcome.error["message"] or (
            "no other instance" in outcome.error["message"]
        )
        assert len(outcome.texts) == 5
        waited = outcome.ended_at - outcome.chunk_times[-1]
        assert DEADLINE - 0.1 < waited < DEADLINE + MARGIN, f"error after {waited:.2f}s"
        await _wait_cancelled(c, c.workers[0].instance_id)


async def test_no_first_token_in_time_is_an_error_not_a_hang(scripted: ScriptedCluster) -> None:
    async with scripted([["--stall-after", "0"]], first_token_s=DEADLINE) as c:
        started = time.monotonic()
        outcome = await c.stream(max_tokens=30)
        assert outcome.status == 500
        assert outcome.error is not None and "stopped responding" in outcome.error["message"]
        assert "first output" in outcome.error["message"]
        assert DEADLINE - 0.1 < outcome.ended_at - started < DEADLINE + MARGIN
        await _wait_cancelled(c, c.workers[0].instance_id)


async def test_the_last_worker_draining_finishes_its_streams(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    """A draining worker removes its card first: the frontend drops the model and closes
    the endpoint's client while the stream is still running, yet it must run to its end."""
    namespace = "drain" + uuid.uuid4().hex[:8]
    engine = EngineFlags(
        timing=TimingModel(prefill_ms_per_token=0.001, decode_ms_per_step=30.0)
    ).engine_config(ModelInfo.load(embedded_model))
    settings = WorkerSettings(
        namespace=namespace, nats_server=nats_url, lease_ttl=5.0, drain_timeout=30.0
    )
    worker = mocker_worker(settings, engine, model_path=embedded_model, served_model_name=MODEL)
    await worker.start()
    config = FrontendConfig(
        http=HttpSettings(host="127.0.0.1", port=free_port()),
        namespace=namespace,
        nats_server=nats_url,
        tokenizer_cache=tmp_path / "tok",
        first_token_timeout_s=0,
        inter_token_timeout_s=0,
    )
    frontend = InLoopFrontend(config)
    stopping: list[asyncio.Future[None]] = []
    try:
        await wait_for_instances_async(frontend.base_url, MODEL, 1, timeout=60)

        def drain_after_five(outcome: StreamOutcome) -> None:
            if len(outcome.texts) == 5:
                stopping.append(asyncio.ensure_future(worker.stop()))

        async def dropped_mid_stream() -> bool:
            if streaming.done():
                raise AssertionError(f"the stream ended first: {streaming.result().error}")
            models = (await fetch_json(f"{frontend.base_url}/v1/models"))["data"]
            return all(m["id"] != MODEL for m in models)

        body = {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        async with aiohttp.ClientSession() as session:
            streaming = asyncio.ensure_future(
                stream_completion(session, frontend.base_url, body, on_chunk=drain_after_five)
            )
            await wait_until_async(lambda: stopping, timeout=30, what="the fifth chunk")
            await wait_until_async(
                dropped_mid_stream,
                timeout=30,
                interval=0.05,
                what="the model to be dropped while its stream still runs",
            )
            outcome = await asyncio.wait_for(streaming, 60)
        assert outcome.completed, outcome.error
        # Count tokens from the usage chunk, not text chunks: the mocker's random tokens
        # can end inside a UTF-8 character, and the detokenizer then holds that token's
        # text back and sends it with the next one.
        assert outcome.finish_reason == "length", outcome.finish_reason
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == 150
        await asyncio.wait_for(stopping[0], 30)
    finally:
        await frontend.stop()
        await worker.stop(drain_timeout=0)
