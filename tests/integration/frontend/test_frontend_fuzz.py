"""The real frontend process (`python -m dynamo.frontend`, kv router mode) in front of a
mocker worker (`python -m dynamo.mocker`) over the session's nats-server, under hostile
clients:

* schemathesis generates requests, valid and invalid, from the frontend's own OpenAPI
  document (`GET /openapi.json`) and validates every answer against it: no 5xx, only
  documented statuses, content types and bodies, invalid data rejected;
* integers msgpack cannot carry (`seed`, `top_k` at 2**64) are 400s and leave the KV
  router with nothing booked (they used to be 500s that leaked a booking);
* "slowloris" clients trickling request heads are disconnected at the header timeout
  while others are served;
* a streaming client that stops reading is cut at the write timeout, its request
  cancelled on the worker, the frontend's memory bounded;
* a burst of 300 concurrent requests is answered with 200 or 503 (`Retry-After`), never
  another 5xx, and the frontend stays up.

Bounded: about 100 fuzzed requests (derandomized, no shrinking), small timeouts.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import hypothesis
import psutil
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

from dynamo.testing.http import debug_kv_views, http_get, http_post_json, metric_total
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_while_alive
from dynamo.testing.raw_http import connect, trickle
from dynamo.testing.waiting import wait_until, wait_until_async

MODEL = "fuzz-model"
HEADER_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 1.0
MAX_INFLIGHT = 32
FUZZ_EXAMPLES = 40  # per generation operation and mode; GET operations get fewer


@dataclass
class Stack:
    frontend: FrontendProcess
    mocker: ManagedProcess
    namespace: str

    @property
    def base(self) -> str:
        return self.frontend.base_url

    def kv_workers(self) -> list[dict[str, Any]]:
        """Each frontend process's KV router view of each worker (bookings included):
        one process, or N with `--http-workers N`."""
        views = []
        for process in debug_kv_views(self.base):
            (router,) = process["models"][MODEL].values()
            views.extend(router["workers"].values())
        return views

    def booked_requests(self) -> int:
        return sum(w["active_requests"] for w in self.kv_workers())

    def routed_requests(self) -> int:
        return sum(w["routed"]["requests"] for w in self.kv_workers())


@pytest.fixture(scope="module")
def stack(
    nats_url: str, embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    namespace = "fuzz" + uuid.uuid4().hex[:8]
    logs = tmp_path_factory.mktemp("fuzz-logs")
    mocker_command = mocker_argv(
        embedded_model, nats_url, namespace,
        "--lease-ttl", "10",
        "--speed-up", "40",
        "--max-model-len", "65536",
        "--eos-probability", "0.05",  # fuzzed requests end after ~20 tokens on average
        served_model_name=MODEL,
    )  # fmt: skip
    frontend_flags = [
        "--router-mode", "kv",
        "--tokenizer-cache", str(tmp_path_factory.mktemp("fuzz-tokenizers")),
        "--max-inflight-requests", str(MAX_INFLIGHT),
        "--header-timeout", str(HEADER_TIMEOUT_S),
        "--keep-alive-timeout", "5",
        "--write-timeout", str(WRITE_TIMEOUT_S),
    ]  # fmt: skip
    with running([]) as procs:
        mocker = ManagedProcess("mocker", mocker_command, logs)
        procs.append(mocker)
        frontend = FrontendProcess(
            "frontend", nats_url, logs, namespace=namespace, extra=frontend_flags
        )
        procs.append(frontend)
        # The frontend loads the tokenizer from the card first (seconds on a busy host).
        wait_while_alive(
            lambda: http_get(f"{frontend.base_url}/health")[0] == 200,
            [mocker, frontend],
            timeout=90,
            what=f"the frontend to serve {MODEL}",
            interval=0.25,
        )
        yield Stack(frontend, mocker, namespace)
        assert frontend.alive(), frontend.log_tail()


# --------------------------------------------------------------------------- fuzzing


def fuzz_schema(base: str) -> Any:
    """The served OpenAPI document, with the generation operations' `model` pinned to the
    served model (a random name only ever reaches the 404 path)."""
    status, text = http_get(f"{base}/openapi.json")
    assert status == 200
    document = json.loads(text)
    schemas = document["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        schemas[request]["properties"]["model"] = {"enum": [MODEL]}
    return schemathesis.openapi.from_dict(document)


CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
]


def fuzz_operation(
    operation: Any, base: str, mode: GenerationMode, examples: int, session: requests.Session
) -> None:
    checks = CHECKS + (
        [st_checks.negative_data_rejection] if mode is GenerationMode.NEGATIVE else []
    )

    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=base, session=session, timeout=30)
        case.validate_response(response, checks=checks)

    run()


def test_fuzzing_the_openapi_document_finds_no_server_error(stack: Stack) -> None:
    schema = fuzz_schema(stack.base)
    routed_before = stack.routed_requests()
    with requests.Session() as session:
        for path, method, examples in [
            ("/v1/completions", "POST", FUZZ_EXAMPLES),
            ("/v1/chat/completions", "POST", FUZZ_EXAMPLES),
            ("/v1/responses", "POST", FUZZ_EXAMPLES // 2),  # a thin layer over chat
            ("/v1/models/{model}", "GET", 5),
            ("/v1/models", "GET", 1),
            ("/health", "GET", 1),
            ("/openapi.json", "GET", 1),
        ]:
            operation = schema[path][method]
            fuzz_operation(operation, stack.base, GenerationMode.POSITIVE, examples, session)
            if method == "POST":  # a GET's only parameter (a model name) cannot be invalid
                fuzz_operation(operation, stack.base, GenerationMode.NEGATIVE, examples, session)
    assert stack.routed_requests() > routed_before, "some fuzzed requests reached the worker"
    wait_until(
        lambda: stack.booked_requests() == 0,
        timeout=15,
        interval=0.2,
        what="the KV router to hold no booking once the fuzzed requests ended",
    )


# --------------------------------------------------------------------------- hostile integers


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hello there", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "Hello there", "top_k": 2**64}, "top_k"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "seed": 2**70, "stream": True},
            "seed",
        ),
    ],
)
def test_huge_integers_are_400s_and_book_nothing(
    stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    routed = stack.routed_requests()
    status, text = http_post_json(f"{stack.base}{path}", {"model": MODEL, **body})
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == param
    assert stack.routed_requests() == routed, "the request never reached the router"
    assert stack.booked_requests() == 0


def test_a_request_over_the_nats_payload_limit_is_carried_and_served(stack: Stack) -> None:
    """400,000 in-vocabulary stop token ids: about 1.2 MB as msgpack, over nats-server's
    1 MiB message limit. nats-py's MaxPayloadError used to be a 500, then a 400; now the
    request travels in parts (dynamo.runtime.request_parts) and is served, and the router's
    booking is released when it ends."""
    stop_token_ids = [1 + i % 40_000 for i in range(400_000)]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stop_token_ids": stop_token_ids}
    status, text = http_post_json(f"{stack.base}/v1/completions", body)
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] >= 1
    wait_until(
        lambda: stack.booked_requests() == 0,
        timeout=10,
        what=lambda: f"the booking released; {stack.booked_requests()} left",
    )


# --------------------------------------------------------------------------- slow clients


async def slowloris(port: int, head: bytes, interval: float, give_up_after: float) -> float:
    """A client of its own trickling `head`; seconds until the server closed it."""
    reader, writer = await connect(port)
    try:
        return await trickle(reader, writer, head, interval, give_up_after=give_up_after)
    finally:
        writer.close()


async def test_slowloris_clients_are_cut_at_the_header_timeout(stack: Stack) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 400 + b"\r\n"
    clients = [
        asyncio.ensure_future(slowloris(stack.frontend.port, head, 0.05, 10.0)) for _ in range(50)
    ]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        while not all(c.done() for c in clients):
            async with session.post(f"{stack.base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            await asyncio.sleep(0.1)
    held = await asyncio.gather(*clients)
    assert max(held) < HEADER_TIMEOUT_S + 2.0, held  # the head alone would take 20 s


async def test_a_client_that_stops_reading_is_cut_and_memory_stays_bounded(
    stack: Stack,
) -> None:
    frontend = psutil.Process(stack.frontend.pid)
    rss_before = frontend.memory_info().rss
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me everything"}],
        "stream": True,
        "max_tokens": 60000,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,  # ~1 KB of JSON per token: the buffers fill in seconds
    }
    payload = json.dumps(body).encode()
    reader, writer = await connect(stack.frontend.port, receive_buffer=4096)
    disconnects = stack.frontend.metric("dynamo_frontend_client_disconnects_total")
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # From here on the client reads nothing, and keeps the connection open.
        peak = rss_before

        def cut() -> bool:
            nonlocal peak
            peak = max(peak, frontend.memory_info().rss)
            after = stack.frontend.metric("dynamo_frontend_client_disconnects_total")
            return after > disconnects and stack.booked_requests() == 0

        await wait_until_async(
            cut,
            timeout=30,
            interval=0.2,
            what="the stalled stream to be cut and its request cancelled on the worker",
        )
    finally:
        writer.close()
    assert peak - rss_before < 200 * 2**20, f"frontend RSS grew by {(peak - rss_before) >> 20} MiB"


# --------------------------------------------------------------------------- burst


async def test_a_burst_of_connections_gets_200_or_503_and_the_frontend_stays_up(
    stack: Stack,
) -> None:
    shed_before = stack.frontend.metric(
        "dynamo_frontend_rejected_requests_total", reason="inflight_limit"
    )
    frontend = psutil.Process(stack.frontend.pid)
    rss_before = frontend.memory_info().rss
    # Long enough (128 simulated steps) that the burst outnumbers the bound.
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 128, "ignore_eos": True}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)

    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None]:
        async with session.post(f"{stack.base}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status, resp.headers.get("Retry-After")

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        answers = await asyncio.gather(*(one(session) for _ in range(300)))
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) >= MAX_INFLIGHT
    assert statuses.count(503) > 0, "300 at once exceed the bound of 32, which held"
    assert all(retry == "1" for status, retry in answers if status == 503)
    shed = stack.frontend.metric("dynamo_frontend_rejected_requests_total", reason="inflight_limit")
    assert shed - shed_before == statuses.count(503)
    assert stack.frontend.alive()
    assert http_get(f"{stack.base}/health")[0] == 200
    grown = frontend.memory_info().rss - rss_before
    assert grown < 200 * 2**20, f"frontend RSS grew by {grown >> 20} MiB"
    wait_until(
        lambda: stack.booked_requests() == 0,
        timeout=15,
        interval=0.2,
        what="every booking of the burst to be released",
    )
    assert metric_total(f"{stack.base}/metrics", "dynamo_frontend_inflight_requests", {}) == 0
