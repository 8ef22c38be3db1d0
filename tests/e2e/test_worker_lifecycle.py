"""The worker's life cycle as an orchestrator sees it: readiness, metrics, SIGTERM, and a
dying engine.

Claims:
* `/health` answers while the engine loads, with 503, and turns 200 only once the worker
  serves and has registered its model card;
* `/metrics` carries vLLM's own series (`vllm:*`) next to the worker's (`dynamo_worker_*`);
* SIGTERM: the instance leaves every client's routing set at once, `/health` is no longer
  200, a request in flight still completes (or ends with a terminal frame) within the
  drain bound, then the process exits 0 and its registration is gone;
* the vLLM engine core dying (SIGKILL) makes the worker deregister and exit 1, so an
  orchestrator restarts it, whether it was idle or streaming (the stream then ends with
  an error output rather than hanging).

The workers run the tiny Eagle3 pair of `tiny_eagle3` (quick to load, and the drain then
covers a speculating engine). Tests on `lifecycle_worker` run in file order; the SIGTERM
test ends that worker, so it comes last among them. The three workers the later tests end
(`late_workers`) start together, once that worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from e2e_prompts import chat_ids, greedy_request
from tiny_eagle3 import build_pair

from dynamo.llm.model_card import ModelCardWatcher
from dynamo.llm.protocols import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from dynamo.runtime import Client, DistributedRuntime, InstanceGoneError
from dynamo.testing.command_lines import cpu_engine_flags
from dynamo.testing.http import http_get
from dynamo.testing.processes import (
    ENGINE_START_TIMEOUT_S,
    WorkerProcess,
    stop_all,
    wait_while_alive,
)
from dynamo.testing.waiting import wait_until_async
from dynamo.vllm.config.args import DEFAULT_DRAIN_TIMEOUT_S as DRAIN_TIMEOUT_S

NAMESPACE = "e2e-lifecycle"
MAX_MODEL_LEN = 512
LONG_MODEL_LEN = 2048  # the target's max_position_embeddings
DEREGISTER_WITHIN_S = 2.0
ENGINE_SHUTDOWN_S = 30.0
SHORT_DRAIN_S = 1.0  # the drain-timeout test's worker's --drain-timeout


@dataclass
class HealthProbe:
    """One `/health` poll during start-up: seconds since start, HTTP status (None: no
    answer, e.g. the port not open yet) and the reported detail."""

    at: float
    status: int | None
    detail: str = ""


def start_and_probe(worker: WorkerProcess) -> list[HealthProbe]:
    """Poll `/health` from the moment the process starts until it says 200."""
    t0 = time.monotonic()
    probes: list[HealthProbe] = []

    def probe() -> bool:
        try:
            status, body = http_get(worker.health_url, timeout=5)
        except OSError:
            probes.append(HealthProbe(time.monotonic() - t0, None))
            return False
        probes.append(HealthProbe(time.monotonic() - t0, status, json.loads(body)["detail"]))
        return status == 200

    # No retry_on: a /health body without its `detail` fails the test at once.
    wait_while_alive(
        probe,
        [worker],
        timeout=ENGINE_START_TIMEOUT_S,
        interval=0.25,
        what="the worker's /health to say 200",
        retry_on=(),
    )
    return probes


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path):
    return build_pair(tmp_path_factory.mktemp("lifecycle"), embedded_model)


def new_worker(
    name: str,
    eagle3_pair,
    nats_url: str,
    log_dir: Path,
    extra: list[str] | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> WorkerProcess:
    _, checkpoint = eagle3_pair
    return WorkerProcess(
        name,
        checkpoint,
        nats_url,
        log_dir,
        namespace=NAMESPACE,
        component=name,
        engine_flags=cpu_engine_flags(max_model_len),
        extra=extra or (),
    )


@pytest.fixture(scope="module")
def lifecycle_worker(eagle3_pair, nats_url: str, e2e_log_dir: Path):
    """(worker, the `/health` probes of its start-up)."""
    worker = new_worker("lifecycle", eagle3_pair, nats_url, e2e_log_dir)
    try:
        probes = start_and_probe(worker)
        yield worker, probes
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def late_workers(
    eagle3_pair, nats_url: str, e2e_log_dir: Path
) -> Iterator[dict[str, WorkerProcess]]:
    """The workers the drain-timeout and engine-death tests end, by name, started together
    when the first of those tests asks (after the tests of `lifecycle_worker`): their
    engines load side by side instead of one after another."""
    workers = {
        "short-drain": new_worker(
            "short-drain", eagle3_pair, nats_url, e2e_log_dir,
            extra=["--drain-timeout", str(SHORT_DRAIN_S)], max_model_len=LONG_MODEL_LEN,
        ),
        "doomed-idle": new_worker("doomed-idle", eagle3_pair, nats_url, e2e_log_dir),
        "doomed-streaming": new_worker("doomed-streaming", eagle3_pair, nats_url, e2e_log_dir),
    }  # fmt: skip
    try:
        yield workers
    finally:
        stop_all(workers.values())


async def client_of(runtime: DistributedRuntime, worker: WorkerProcess) -> Client:
    client = (
        await runtime.namespace(NAMESPACE).component(worker.component).endpoint("generate").client()
    )
    await client.wait_for_instances(timeout=30)
    return client


def long_request(tokenizer, max_tokens: int) -> PreprocessedRequest:
    ids = chat_ids(tokenizer, "Tell me a long story.")
    return greedy_request(ids, max_tokens, model="target", ignore_eos=True)


async def wait_gone(client: Client, instance: int, timeout: float) -> None:
    """Until `client` no longer routes to `instance` (it deregistered or died)."""
    await wait_until_async(
        lambda: instance not in client.instance_ids(),
        timeout=timeout,
        what=f"instance {instance:x} to leave the routable instances",
    )


async def wait_forgotten(client: Client, instance: int, timeout: float) -> None:
    """Until `client` no longer lists `instance` among every instance it knows."""
    await wait_until_async(
        lambda: instance not in client.instances(),
        timeout=timeout,
        what=f"instance {instance:x} to be forgotten",
    )


async def card_components(runtime: DistributedRuntime) -> set[str]:
    """Components of the model cards registered in the namespace right now."""
    watcher = await ModelCardWatcher(runtime, NAMESPACE).start()
    await asyncio.sleep(0.5)  # the watcher delivers the current cards first
    components = {card.component for card in watcher.cards}
    await watcher.close()
    return components


# --------------------------------------------------------------------------- readiness


def test_health_is_503_while_the_engine_loads(lifecycle_worker) -> None:
    _, probes = lifecycle_worker
    answered = [p for p in probes if p.status is not None]
    assert answered[-1].status == 200
    before_ready = answered[:-1]
    assert before_ready, "the first answer was already 200: nothing probed the start-up"
    assert all(p.status == 503 for p in before_ready)
    assert any(p.detail == "engine not ready" for p in before_ready)
    # Once the port is open the event loop answers every probe: the engine loads beside it.
    first = probes.index(answered[0])
    assert all(p.status is not None for p in probes[first:])


async def test_ready_means_routable_and_registered(runtime, lifecycle_worker) -> None:
    worker, _ = lifecycle_worker
    client = await client_of(runtime, worker)
    assert len(client.instance_ids()) == 1
    assert worker.component in await card_components(runtime)


async def test_metrics_have_vllm_and_worker_series(runtime, lifecycle_worker, tokenizer) -> None:
    worker, _ = lifecycle_worker
    client = await client_of(runtime, worker)
    outputs = [
        out
        async for out in client.round_robin(
            long_request(tokenizer, 16), response_type=LLMEngineOutput
        )
    ]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    _, text = http_get(worker.metrics_url)
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert {"vllm:num_requests_running", "vllm:spec_decode_num_drafts_total"} <= names
    assert {"dynamo_worker_requests_in_flight", "dynamo_worker_kv_cache_usage"} <= names
    assert worker.metric("vllm:spec_decode_num_drafts_total") > 0
    assert worker.metric("dynamo_worker_requests_total") >= 1


async def stream_in_flight(
    client: Client,
    instance: int,
    request: PreprocessedRequest,
    on_first_output: Callable[[], None],
) -> tuple[asyncio.Task[None], list[LLMEngineOutput]]:
    """Start streaming `request` from `instance` in a task and call `on_first_output` (a
    signal, a kill) the moment its first output arrives, with the request surely running;
    return once that has happened, with the list the outputs go into.

    The call happens inside the consumer, not after this coroutine resumes: with Eagle3
    drafts accepted four at a time, a few hundred repetitive tokens can all arrive before a
    waiting test gets the event loop back (seen on a fast CI machine)."""
    outputs: list[LLMEngineOutput] = []
    streaming = asyncio.Event()

    async def consume() -> None:
        async for out in client.direct(request, instance, response_type=LLMEngineOutput):
            outputs.append(out)
            if not streaming.is_set():
                on_first_output()
                streaming.set()

    stream = asyncio.create_task(consume())
    await asyncio.wait_for(streaming.wait(), 60)
    return stream, outputs


# --------------------------------------------------------------------------- SIGTERM


async def test_sigterm_deregisters_drains_and_exits_0(runtime, lifecycle_worker, tokenizer) -> None:
    worker, _ = lifecycle_worker
    client = await client_of(runtime, worker)
    (instance,) = client.instance_ids()
    request = long_request(tokenizer, MAX_MODEL_LEN - 64)
    stream, outputs = await stream_in_flight(
        client, instance, request, lambda: worker.popen.send_signal(signal.SIGTERM)
    )
    signalled = time.monotonic()
    assert outputs[0].finish_reason is None  # in flight when the signal was sent

    await wait_gone(client, instance, DEREGISTER_WITHIN_S)
    if not stream.done():  # still draining: not ready any more (or already closed)
        try:
            status, _ = http_get(worker.health_url, timeout=2)
            assert status == 503
        except OSError:
            pass

    try:
        await asyncio.wait_for(stream, DRAIN_TIMEOUT_S + 10)
        final = outputs[-1]
        assert final.finish_reason is FinishReason.LENGTH
        assert sum(len(out.token_ids) for out in outputs) == request.stop_conditions.max_tokens
    except InstanceGoneError as exc:  # the drain bound ran out: a terminal frame, not silence
        assert "shut down before the request finished" in str(exc)
    assert time.monotonic() - signalled < DRAIN_TIMEOUT_S + 10

    code = await asyncio.to_thread(worker.popen.wait, DRAIN_TIMEOUT_S + ENGINE_SHUTDOWN_S)
    assert code == 0, worker.log_tail()
    await wait_forgotten(client, instance, DEREGISTER_WITHIN_S)
    assert worker.component not in await card_components(runtime)


async def test_sigterm_aborts_what_outlives_the_drain_timeout(
    runtime, late_workers: dict[str, WorkerProcess], tokenizer
) -> None:
    """`--drain-timeout 1`: a request that cannot finish in time is cut off after about
    one second with a terminal error frame, and the worker still exits 0.

    The request cannot finish because its engine core is paused (SIGSTOP) from its first
    output until the cut: how long the worker takes to start draining (deregistering over
    NATS first) then cannot decide the outcome, as it did when the test relied on a long
    request outlasting it (a loaded machine once let the whole request finish first)."""
    drain_s = SHORT_DRAIN_S
    worker = late_workers["short-drain"]
    core: psutil.Process | None = None
    try:
        await asyncio.to_thread(worker.wait_ready)
        core = engine_core_of(worker.pid)
        client = await client_of(runtime, worker)
        (instance,) = client.instance_ids()
        request = long_request(tokenizer, LONG_MODEL_LEN - 64)

        def pause_and_stop() -> None:
            assert core is not None
            core.suspend()
            worker.popen.send_signal(signal.SIGTERM)

        stream, outputs = await stream_in_flight(client, instance, request, pause_and_stop)
        signalled = time.monotonic()
        # The worker went away under the request: the same error as a worker that died, so
        # a frontend re-places or migrates it.
        with pytest.raises(InstanceGoneError, match="shut down before the request finished"):
            await asyncio.wait_for(stream, drain_s + 10)
        assert time.monotonic() - signalled < drain_s + 5
        core.resume()  # the engine shuts down as usual
        produced = sum(len(out.token_ids) for out in outputs)
        assert 0 < produced < request.stop_conditions.max_tokens
        code = await asyncio.to_thread(worker.popen.wait, ENGINE_SHUTDOWN_S)
        assert code == 0, worker.log_tail()
    finally:
        if core is not None:
            with contextlib.suppress(psutil.Error):
                core.resume()
        worker.stop()


# --------------------------------------------------------------------------- engine death


def engine_core_of(pid: int) -> psutil.Process:
    """The vLLM engine-core process a worker spawned (titled `VLLM::EngineCore`, or found
    as the spawned child that is not multiprocessing's resource tracker)."""
    children = psutil.Process(pid).children()
    for child in children:
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
            return child
    spawned = [
        child
        for child in children
        if "spawn_main" in " ".join(child.cmdline())
        and "resource_tracker" not in " ".join(child.cmdline())
    ]
    assert len(spawned) == 1, [c.cmdline() for c in children]
    return spawned[0]


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "streaming"])
async def test_engine_core_death_deregisters_and_exits_1(
    in_flight: bool, runtime, late_workers: dict[str, WorkerProcess], tokenizer
) -> None:
    """Idle, the worker's watchdog notices; streaming, the request meets the dead engine
    and ends with an error output instead of hanging."""
    worker = late_workers[f"doomed-{'streaming' if in_flight else 'idle'}"]
    try:
        await asyncio.to_thread(worker.wait_ready)
        client = await client_of(runtime, worker)
        (instance,) = client.instance_ids()
        outputs: list[LLMEngineOutput] = []
        stream = None
        engine_core = engine_core_of(worker.pid)
        if in_flight:
            request = long_request(tokenizer, MAX_MODEL_LEN - 64)
            stream, outputs = await stream_in_flight(client, instance, request, engine_core.kill)
            assert outputs[0].finish_reason is None  # in flight when the engine died
        else:
            engine_core.kill()  # SIGKILL

        if stream is not None:
            await asyncio.wait_for(stream, ENGINE_SHUTDOWN_S)
            assert outputs[-1].finish_reason is FinishReason.ERROR
            assert "engine dead" in (outputs[-1].error or "")
        await wait_gone(client, instance, ENGINE_SHUTDOWN_S)
        code = await asyncio.to_thread(worker.popen.wait, DRAIN_TIMEOUT_S + ENGINE_SHUTDOWN_S)
        assert code == 1, worker.log_tail()
        await wait_forgotten(client, instance, DEREGISTER_WITHIN_S)
        assert worker.component not in await card_components(runtime)
    finally:
        worker.stop()
