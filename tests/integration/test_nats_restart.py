"""A NATS restart WITHOUT persistence: the broker is SIGKILLed and a fresh one starts on the
same port with an empty store (as the launch scripts' temporary store does), so every
bucket, stream, consumer and stored file is gone.

Claims, each on a real nats-server:

* an event subscription notices the stream was recreated (sequences restarted), tells
  its owner, and replays the new stream from its start;
* a watch does not report keys gone that their owners put back after the restart (no
  worker or model blinks out), but does report a key nobody puts back;
* a worker's KV-event publisher recreates the lost stream itself, and every worker, busy
  or idle, re-announces its whole cache in the new stream;
* the KV router drops what it learnt from the lost stream and learns every worker's
  re-announced cache from the new one;
* a worker uploads its tokenizer files again, so a frontend with an empty cache can
  load the model;
* a frontend retries, with backoff, a card whose tokenizer files were missing, instead
  of hiding the worker for its whole life;
* the whole system (a frontend in kv mode and two mocker workers, as processes) under
  load: within 10 s of the new broker, requests succeed and the router predicts prefix
  hits again; requests in flight at the crash complete or end with a clean error; no
  process crashes or logs a traceback;
* a worker that loses the broker while it deregisters stops at once instead of waiting
  out the NATS timeouts of the calls in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.js.errors import NotFoundError

from dynamo.frontend.engine.routing import RouterSettings, make_router_factory
from dynamo.frontend.models.card_sync import ModelCardSync
from dynamo.frontend.models.manager import ModelManager
from dynamo.llm.kv_router import create_kv_router
from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.kv_router.subjects import KV_EVENTS_STREAM, kv_events_subject
from dynamo.llm.model_card import (
    MODELS_BUCKET,
    card_key,
    fetch_tokenizer_files,
    files_digest,
    tokenizer_files_in,
    upload_tokenizer_files,
)
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockStored,
    ModelCard,
    RouterEvent,
    kv_events_of,
)
from dynamo.llm.worker import ServedWorker
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.model_info import ModelInfo
from dynamo.nats_server import NatsServer
from dynamo.runtime import DistributedRuntime, naming
from dynamo.runtime.backoff import Backoff, retry_until_done
from dynamo.runtime.events import EventStream, StreamSubscription
from dynamo.testing.http import kv_router_views
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess
from dynamo.testing.sse import sse_data
from dynamo.testing.waiting import wait_until_async

LEASE_TTL = 1.0
RECOVERY_S = 10.0  # the promise: within this long after the new broker is up
QUICK = Backoff(initial_s=0.1, maximum_s=0.5)  # test-side retries while the broker restarts


class Broker:
    """A private nats-server that can crash and come back empty on the same port."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self.incarnation = 0
        self.server = NatsServer(store_dir=root / "store-0").start()

    @property
    def url(self) -> str:
        return self.server.url

    def crash_and_restart_empty(self) -> float:
        """SIGKILL the server, start a new one on the same port with a new, empty store.
        Returns the monotonic time at which the new one accepted clients."""
        port = self.server.port
        self.server.kill()
        self.incarnation += 1
        store = self._root / f"store-{self.incarnation}"
        self.server = NatsServer(port, store_dir=store).start()
        return time.monotonic()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    server = Broker(tmp_path)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def runtimes(broker: Broker) -> AsyncIterator[list[DistributedRuntime]]:
    """Two runtimes on the broker (a publishing side and a consuming side)."""
    started = [
        await DistributedRuntime.connect(broker.url, lease_ttl=LEASE_TTL, name=f"rt{i}")
        for i in range(2)
    ]
    try:
        yield started
    finally:
        for runtime in started:
            await runtime.shutdown(drain_timeout=0)


async def reconnected(*runtimes: DistributedRuntime) -> None:
    await wait_until_async(
        lambda: all(rt.reconnects >= 1 and rt.is_connected for rt in runtimes),
        timeout=RECOVERY_S,
        what="every runtime to reconnect to the new broker",
    )


# --------------------------------------------------------------------------- runtime


async def test_a_subscription_replays_a_stream_recreated_empty(
    broker: Broker, runtimes: list[DistributedRuntime]
) -> None:
    publisher, consumer = runtimes
    stream = EventStream("dyn_test_restart", ("restart_test.>",))
    await stream.ensure(publisher)
    got: list[tuple[bytes, int]] = []
    seen_at_reset: list[int] = []

    async def handler(subject: str, payload: bytes, sequence: int) -> None:
        got.append((payload, sequence))

    subscription = await StreamSubscription(
        consumer,
        stream,
        "restart_test.>",
        handler,
        on_reset=lambda: seen_at_reset.append(len(got)),
    ).start()
    try:
        for i in range(5):
            await stream.publish(publisher, "restart_test.a", b"old%d" % i)
        await wait_until_async(lambda: len(got) == 5, timeout=5, what="the first 5 events")

        broker.crash_and_restart_empty()
        await reconnected(publisher, consumer)

        async def publish_new() -> None:
            await stream.ensure(publisher)
            for i in range(2):
                await stream.publish(publisher, "restart_test.a", b"new%d" % i)

        await retry_until_done(publish_new, what="publishing to the new stream", backoff=QUICK)
        await wait_until_async(
            lambda: len(got) == 7, timeout=RECOVERY_S, what="the new stream's events"
        )
        assert got[5:] == [(b"new0", 1), (b"new1", 2)]  # sequences restarted, none skipped
        assert subscription.resets == 1 and seen_at_reset == [5]
    finally:
        await subscription.close()


WORKER_SCRIPT = Path(__file__).with_name("runtime_worker.py")
GRACE_S = 4.0  # the watcher's lease TTL: how long a missing key has to come back


async def started_instance(proc: ManagedProcess) -> int:
    """The instance id a `runtime_worker.py` child prints once registered."""

    def ready() -> int | None:
        proc.check_alive()
        for line in proc.log_path.read_text().splitlines():
            if line.startswith("READY"):
                return int(line.split()[1])
        return None

    await wait_until_async(ready, timeout=30, interval=0.05, what=f"{proc.name} to register")
    instance_id = ready()
    assert instance_id is not None
    return instance_id


async def test_a_watch_does_not_report_keys_their_owners_put_back(
    broker: Broker, tmp_path: Path
) -> None:
    """The owner of a leased key is frozen (SIGSTOP) across the restart, so the watcher's
    new snapshot certainly lacks its key; thawed, it puts the key back within the grace
    period and the watcher never reports it gone. A key nobody puts back is reported."""
    namespace = "restart" + uuid.uuid4().hex[:6]
    argv = [sys.executable, str(WORKER_SCRIPT), broker.url, namespace, str(LEASE_TTL)]
    owner = ManagedProcess("owner", argv, tmp_path)
    watcher_rt = await DistributedRuntime.connect(broker.url, lease_ttl=GRACE_S, name="watcher")
    try:
        instance = await started_instance(owner)
        leased = naming.instance_key(namespace, "work", "generate", instance)
        orphan = f"{namespace}.orphan.key"  # put without a lease: nobody restores it
        await (await watcher_rt.key_value(naming.INSTANCES_BUCKET)).put(orphan, b"x")
        deleted: list[str] = []
        watcher = watcher_rt.watch_bucket(
            naming.INSTANCES_BUCKET, f"{namespace}.>", on_delete=deleted.append
        )
        await watcher.start()
        assert {leased, orphan} <= set(watcher.entries)

        os.kill(owner.pid, signal.SIGSTOP)
        try:
            broker.crash_and_restart_empty()
            await reconnected(watcher_rt)
            marker = f"{namespace}.marker.key"

            async def rewatched() -> bool:  # the new watch is live, its snapshot applied
                await (await watcher_rt.key_value(naming.INSTANCES_BUCKET)).put(marker, b"m")
                return marker in watcher.entries

            await wait_until_async(
                rewatched, timeout=10, interval=0.1, what="the re-watch", retry_on=(Exception,)
            )
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        await wait_until_async(
            lambda: deleted == [orphan],
            timeout=GRACE_S + 10,
            what="the orphan key to be reported gone",
        )
        assert leased in watcher.entries  # put back by its owner: never reported gone
    finally:
        await watcher_rt.shutdown(drain_timeout=0)
        owner.stop(5)


# --------------------------------------------------------------------------- KV events


def stored(worker_id: int, event_id: int, hashes: list[int]) -> RouterEvent:
    return RouterEvent(worker_id, event_id, KvBlockStored(block_hashes=hashes))


async def replayed_cache(runtime: DistributedRuntime, subject: str) -> set[int] | None:
    """What a router replaying `subject` from the start of the stream would believe the
    worker caches; None unless the history opens with a `KvAllCleared`."""
    info = await runtime.js.stream_info(KV_EVENTS_STREAM)
    if info.state.messages == 0:
        # Just recreated and still empty: its first_seq is 0, and asking JetStream for
        # message 0 is a 400 (seen once when the poll landed in that moment).
        return None
    events = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            msg = await runtime.js.get_msg(KV_EVENTS_STREAM, seq)
        except NotFoundError:  # purged
            continue
        if msg.subject == subject:
            events.extend(kv_events_of(msg.data or b""))
    if not events or not isinstance(events[0].data, KvAllCleared):
        return None
    cached: set[int] = set()
    for event in events:
        if isinstance(event.data, KvBlockStored):
            cached.update(event.data.block_hashes)
        elif isinstance(event.data, KvAllCleared):
            cached.clear()
        else:
            cached.difference_update(event.data.block_hashes)
    return cached


@asynccontextmanager
async def publisher_caching(
    runtime: DistributedRuntime, blocks: list[int]
) -> AsyncIterator[KvEventPublisher]:
    """The KV event publisher of `runtime`'s worker, having announced that the worker
    caches `blocks` (a clear, then one store), as a worker does before the broker dies;
    closed on exit."""
    worker = runtime.instance_id
    publisher = await KvEventPublisher(runtime, "restart", "backend", worker).start()
    try:
        await publisher.publish(RouterEvent(worker, 0, KvAllCleared()))
        await publisher.publish(stored(worker, 1, blocks))
        yield publisher
    finally:
        publisher.close()


async def test_a_kv_event_publisher_recreates_the_stream_and_re_announces_its_cache(
    broker: Broker, runtimes: list[DistributedRuntime]
) -> None:
    runtime = runtimes[0]
    worker = runtime.instance_id
    subject = kv_events_subject("restart", "backend", worker)
    async with publisher_caching(runtime, [11, 12]) as publisher:
        broker.crash_and_restart_empty()
        await reconnected(runtime)
        await publisher.publish(stored(worker, 2, [21]))  # raised before: no stream

        # The new stream tells a router everything the worker caches, not just what
        # happened after the restart.
        async def replays_whole_cache() -> bool:
            return await replayed_cache(runtime, subject) == {11, 12, 21}

        await wait_until_async(
            replays_whole_cache, timeout=RECOVERY_S, what="the whole cache in the new stream"
        )
        assert publisher.stats.streams_recreated == 1
        assert publisher.stats.failures == 0


async def test_an_idle_worker_re_announces_its_cache_to_the_new_broker(
    broker: Broker, runtimes: list[DistributedRuntime]
) -> None:
    runtime = runtimes[0]
    subject = kv_events_subject("restart", "backend", runtime.instance_id)
    async with publisher_caching(runtime, [31, 32, 33]):
        broker.crash_and_restart_empty()  # and the worker publishes nothing after it
        await reconnected(runtime)

        async def replays_whole_cache() -> bool:
            try:
                return await replayed_cache(runtime, subject) == {31, 32, 33}
            except NotFoundError:  # no stream yet
                return False

        await wait_until_async(
            replays_whole_cache, timeout=RECOVERY_S, what="the idle worker's cache re-announced"
        )


async def _idle(request: object, ctx: object) -> AsyncIterator[dict[str, bool]]:
    yield {"ok": True}


async def test_the_kv_router_replays_the_new_stream_from_its_start(
    broker: Broker, runtimes: list[DistributedRuntime]
) -> None:
    """Two live workers: `a` re-announces its cache after the restart (this code), `b`
    does not (an older worker, say). The router drops everything it learnt from the lost
    stream, so it ends up with `a`'s whole cache and none of `b`'s possibly stale one."""
    a_rt, b_rt = runtimes  # b_rt also runs the router
    namespace = "restart" + uuid.uuid4().hex[:6]
    a, b = a_rt.instance_id, b_rt.instance_id
    publishers = {}
    for runtime in runtimes:
        endpoint = runtime.namespace(namespace).component("backend").endpoint("generate")
        await endpoint.serve(_idle)
        worker = runtime.instance_id
        publisher = await KvEventPublisher(runtime, namespace, "backend", worker).start()
        await publisher.publish(RouterEvent(worker, 0, KvAllCleared()))
        publishers[worker] = publisher
    await publishers[a].publish(stored(a, 1, [101, 102, 103]))
    await publishers[b].publish(stored(b, 1, [301]))
    publishers[b].close()  # `b` will not re-announce
    card = ModelCard(
        name="sim",
        namespace=namespace,
        component="backend",
        endpoint="generate",
        instance_id=a,
        kv_block_size=4,
    )
    client = await b_rt.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(5, min_count=2)
    router = await create_kv_router(b_rt, card, client)
    indexer = router.scheduler.indexer
    try:
        await wait_until_async(
            lambda: indexer.block_count(a) == 3 and indexer.block_count(b) == 1,
            timeout=5,
            what="the first blocks",
        )
        broker.crash_and_restart_empty()
        await reconnected(a_rt, b_rt)
        await retry_until_done(
            lambda: publishers[a].publish(stored(a, 2, [201, 202])),
            what="publishing after the restart",
            backoff=QUICK,
        )
        await wait_until_async(
            lambda: indexer.holders(201) == {a} and indexer.block_count(a) == 5,
            timeout=RECOVERY_S,
            what="the router to index a's whole cache from the new stream",
        )
        assert indexer.holders(101) == {a}  # re-announced
        assert indexer.holders(301) == set()  # learnt from the lost stream only: dropped
        assert router.debug_state()["feed"]["stream_resets"] == 1
    finally:
        publishers[a].close()
        await router.close()
        await client.close()


# --------------------------------------------------------------------------- model cards

MODEL = "mock-restart"
BLOCK = 16


def mocker(nats_url: str, namespace: str, model_dir: Path) -> ServedWorker[MockerBackend]:
    info = ModelInfo.load(model_dir)
    config = MockEngineConfig(
        block_size=BLOCK,
        num_gpu_blocks=512,
        max_model_len=4096,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        special_token_ids=info.special_token_ids,
    )
    settings = WorkerSettings(namespace=namespace, nats_server=nats_url, lease_ttl=LEASE_TTL)
    return mocker_worker(settings, config, model_path=model_dir, served_model_name=MODEL)


async def test_a_worker_uploads_its_tokenizer_files_again(
    broker: Broker, runtimes: list[DistributedRuntime], embedded_model: Path, tmp_path: Path
) -> None:
    worker = await mocker(broker.url, "restart" + uuid.uuid4().hex[:6], embedded_model).start()
    reader = runtimes[0]
    try:
        assert worker.card is not None
        card = worker.card
        await fetch_tokenizer_files(reader, card, tmp_path / "before")

        broker.crash_and_restart_empty()
        await reconnected(reader)
        # A frontend that never cached the files must find them in the new broker.
        fresh = tmp_path / "fresh"
        await wait_until_async(
            lambda: _fetches(reader, card, fresh),
            timeout=RECOVERY_S,
            interval=0.2,
            what="the worker's tokenizer files in the new broker",
        )
        assert sorted(p.name for p in fresh.glob("*/*")) == sorted(card.tokenizer_files)
    finally:
        await worker.stop(drain_timeout=0)


async def _fetches(runtime: DistributedRuntime, card: ModelCard, dest: Path) -> bool:
    try:
        await asyncio.wait_for(fetch_tokenizer_files(runtime, card, dest), 5)
    except Exception:  # not there yet
        return False
    return True


async def test_a_card_whose_files_are_missing_is_retried_until_they_come(
    broker: Broker,
    runtimes: list[DistributedRuntime],
    embedded_model: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker_rt, frontend_rt = runtimes
    namespace = "restart" + uuid.uuid4().hex[:6]
    served = (
        await worker_rt.namespace(namespace).component("backend").endpoint("generate").serve(_idle)
    )
    files = tokenizer_files_in(embedded_model)
    card = ModelCard(
        name=MODEL,
        namespace=namespace,
        component="backend",
        endpoint="generate",
        instance_id=served.instance_id,
        context_length=2048,
        kv_block_size=BLOCK,
        tokenizer_bucket="dyn_files",
        tokenizer_files=[f.name for f in files],
        tokenizer_digest=files_digest(files),
    )
    # The card is registered, its files are not (yet): what a frontend meets when the
    # broker restarted empty and the worker's card was re-put before its files.
    await worker_rt.put_leased(MODELS_BUCKET, card_key(card), msgspec.msgpack.encode(card))
    manager = ModelManager()
    factory = make_router_factory(RouterSettings(), frontend_rt)
    sync = ModelCardSync(frontend_rt, manager, factory, tmp_path / "tokenizers")
    task = asyncio.create_task(sync.run(namespace))
    caplog.set_level(logging.WARNING)
    try:
        await wait_until_async(
            lambda: any(
                "could not" in r.getMessage() and MODEL in r.getMessage() for r in caplog.records
            ),
            timeout=10,
            what="the frontend to fail loading the card",
        )
        assert MODEL not in manager
        await upload_tokenizer_files(worker_rt, embedded_model)
        # Loading the real tokenizer takes seconds on a busy host. The model joins the
        # manager a moment before its retry is forgotten (the load finishes first), so
        # the two are waited for together rather than read one after the other.
        await wait_until_async(
            lambda: MODEL in manager and len(sync.retries) == 0,
            timeout=30,
            what="the model once its files are there, and its retry forgotten",
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await manager.close()


# --------------------------------------------------------------------------- whole system

PROBE_PROMPT_WORDS = 400  # ~100 blocks of 16 tokens: far more than any in-flight prompt
IN_FLIGHT = 8


@dataclass
class StreamOutcome:
    """How one streamed request ended."""

    status: int | str = 0
    chunks: int = 0
    finished: bool = False  # a finish_reason arrived
    error: str | None = None  # the error event or body
    done: bool = False  # [DONE] arrived
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kind(self) -> str:
        if self.status == 200 and self.finished and self.done and self.error is None:
            return "completed"
        if self.error is not None and (self.status != 200 or self.done):
            return "failed cleanly"
        return "lost"


async def stream_chat(
    session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int, out: StreamOutcome
) -> StreamOutcome:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body) as response:
            out.status = response.status
            if response.status != 200:
                out.error = await response.text()
                return out
            async for data in sse_data(response.content):
                if data == "[DONE]":
                    out.done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])
                    continue
                out.chunks += 1
                out.first_chunk.set()
                if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                    out.finished = True
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.status = f"{type(exc).__name__}"
    return out


async def chat_once(session: aiohttp.ClientSession, base: str, prompt: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    async with session.post(f"{base}/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


async def router_views(base: str, endpoint_path: str) -> list[dict[str, Any]]:
    """The frontend's KV router for the model's workers, as `GET /debug/kv` shows it: one
    per frontend process (N with `--http-workers N`, each its own router)."""
    return await asyncio.to_thread(kv_router_views, base, MODEL, endpoint_path)


def routed_total(views: list[dict[str, Any]], counter: str) -> int:
    """A routing counter summed over the frontend's processes (each counts its own)."""
    return sum(view["routing"][counter] for view in views)


def idle(view: dict[str, Any]) -> bool:
    """No request booked on, or reported running by, any worker: the next decision is
    made on cached prefixes alone, not on a load report still counting the last one."""
    return all(
        w["active_requests"] == 0 and (w["load"] is None or w["load"]["active_requests"] == 0)
        for w in view["workers"].values()
    )


async def prefix_hits_again(session: aiohttp.ClientSession, base: str, endpoint_path: str) -> bool:
    """Send one fresh long prompt, wait until the router indexed its blocks and the
    workers are idle, send it again: True when both succeed and the router predicted
    all but at most one of the second one's blocks cached."""
    prompt = f"probe {uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(PROBE_PROMPT_WORDS))
    start = await router_views(base, endpoint_path)
    if await chat_once(session, base, prompt) != 200:
        return False
    first = await router_views(base, endpoint_path)
    blocks = routed_total(first, "request_blocks") - routed_total(start, "request_blocks")

    async def indexed_and_idle() -> bool:
        views = await router_views(base, endpoint_path)
        # Most of the prompt's blocks are new (the chat template's opening ones are not);
        # every process indexes every worker's events.
        return all(
            view["unique_blocks"] - began["unique_blocks"] >= blocks // 2 and idle(view)
            for view, began in zip(views, start, strict=True)
        )

    try:
        await wait_until_async(indexed_and_idle, timeout=3, interval=0.05, what="indexing")
    except AssertionError:
        return False
    before = await router_views(base, endpoint_path)
    if await chat_once(session, base, prompt) != 200:
        return False
    after = await router_views(base, endpoint_path)
    overlap = routed_total(after, "overlap_blocks") - routed_total(before, "overlap_blocks")
    return overlap >= blocks - 1


def tracebacks(proc: ManagedProcess) -> list[str]:
    text = proc.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if line.startswith("Traceback")]


async def test_kv_mode_recovers_from_a_broker_restart_without_its_store(
    broker: Broker, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = "restart" + uuid.uuid4().hex[:6]
    env = {"DYN_LEASE_TTL": str(LEASE_TTL)}
    argv = mocker_argv(
        embedded_model, broker.url, namespace,
        "--num-workers", "2",
        "--block-size", str(BLOCK),
        "--decode-ms-per-step", "10",
        served_model_name=MODEL,
    )  # fmt: skip
    workers = ManagedProcess("mocker", argv, tmp_path, env=env)
    frontend = FrontendProcess(
        "frontend",
        broker.url,
        tmp_path,
        namespace=namespace,
        extra=["--router-mode", "kv", "--tokenizer-cache", str(tmp_path / "tokenizers")],
        env=env,
    )
    procs: list[ManagedProcess] = [workers, frontend]
    endpoint_path = f"{namespace}/backend/generate"
    try:
        frontend.wait_for_model(MODEL, timeout=60)
        await asyncio.to_thread(frontend.wait_kv_router_workers, MODEL, endpoint_path, 2)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            assert await prefix_hits_again(session, frontend.base_url, endpoint_path)
            outcomes = [StreamOutcome() for _ in range(IN_FLIGHT)]
            in_flight = [
                asyncio.create_task(
                    stream_chat(session, frontend.base_url, f"load {i} " * 20, 300, outcome)
                )
                for i, outcome in enumerate(outcomes)
            ]
            await asyncio.wait_for(asyncio.gather(*(o.first_chunk.wait() for o in outcomes)), 15)

            up = broker.crash_and_restart_empty()

            async def recovered() -> bool:
                try:
                    return await prefix_hits_again(session, frontend.base_url, endpoint_path)
                except (aiohttp.ClientError, OSError, KeyError, ValueError):
                    return False

            await wait_until_async(
                recovered,
                timeout=RECOVERY_S,
                interval=0.1,
                what="kv-mode requests to succeed with predicted prefix hits",
            )
            recovery_s = time.monotonic() - up
            ended = await asyncio.wait_for(asyncio.gather(*in_flight), 30)
        kinds = [o.kind for o in ended]
        print(
            f"recovered in {recovery_s:.1f}s; in flight at the crash: {len(kinds)} sent, "
            f"{kinds.count('completed')} completed, {kinds.count('failed cleanly')} failed "
            f"cleanly, {kinds.count('lost')} lost"
        )
        errors = sorted({(o.error or "")[:120] for o in ended if o.kind == "failed cleanly"})
        print("errors of the requests that failed:", errors)
        assert kinds.count("lost") == 0, [(o.status, o.error, o.done) for o in ended]
        for proc in procs:
            proc.check_alive()
            assert tracebacks(proc) == [], proc.log_tail()
    finally:
        for proc in reversed(procs):
            proc.stop(10)


async def test_a_worker_that_loses_the_broker_while_leaving_stops_at_once(
    broker: Broker, embedded_model: Path
) -> None:
    """The broker is frozen while the worker starts to leave, so the worker's first
    deregistration call hangs; then the broker dies (as when a killed launch script takes
    NATS and the worker down together). nats-py lets a call in flight run into its timeout
    (5 s for a key delete, and there are several), so the worker must notice the lost
    connection and stop without them: its keys expire with their leases."""
    worker = await mocker(broker.url, "leave" + uuid.uuid4().hex[:6], embedded_model).start()
    pid = broker.server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        stopping = asyncio.create_task(worker.stop(drain_timeout=5))
        await asyncio.sleep(0.5)
        assert not stopping.done()  # waiting on the frozen broker
    finally:
        killed_at = time.monotonic()
        broker.server.kill()
    await asyncio.wait_for(stopping, 30)
    # A deregistration call still in flight would end only at its 5 s timeout.
    assert time.monotonic() - killed_at < 4.5
