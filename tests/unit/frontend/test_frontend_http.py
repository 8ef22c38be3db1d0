"""The HTTP server end to end over the scripted in-memory engine: responses, SSE framing,
coalescing, cancellation on disconnect, errors, operational endpoints."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import pytest
from frontend_support import MODEL, WORKER_WAIT_S, Frontend, Script, parse_sse
from http_support import chat as chat_body
from http_support import completion as completion_body

from dynamo.frontend.engine.errors import EngineFailedError, EngineUnavailableError
from dynamo.frontend.http import request_body
from dynamo.testing.waiting import wait_until_async

REPLY = "Hello there, friend."


async def post(frontend: Frontend, path: str, body: Any) -> tuple[int, Any, bytes]:
    """POST JSON (or raw bytes); returns (status, parsed JSON or None, raw body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            frontend.url + path, data=data, headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        raw = await resp.read()
        parsed = json.loads(raw) if resp.content_type == "application/json" else None
        return resp.status, parsed, raw


async def get(frontend: Frontend, path: str) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as session, session.get(frontend.url + path) as resp:
        return resp.status, await resp.read(), resp.content_type


def assert_openai_error(body: Any, *, param: str | None = None, code: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code


# ---------------------------------------------------------------------- unary responses


async def test_completion_returns_text_finish_reason_and_usage(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, steps=(1, 3), cached_tokens=2)
    status, body, _ = await post(frontend, "/v1/completions", completion_body())
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}
    request = frontend.client.requests[-1]
    reply_tokens = len(frontend.engine.reply_ids()) + 1  # + EOS
    assert body["usage"] == {
        "prompt_tokens": len(request.token_ids),
        "completion_tokens": reply_tokens,
        "total_tokens": len(request.token_ids) + reply_tokens,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert frontend.client.completed == [request.request_id]


async def test_chat_completion_applies_the_template_and_answers(
    frontend: Frontend, tokenizer: Any
) -> None:
    status, body, _ = await post(frontend, "/v1/chat/completions", chat_body())
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    sent = tokenizer.decode(frontend.client.requests[-1].token_ids)
    assert sent.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


async def test_max_tokens_gives_finish_reason_length(frontend: Frontend) -> None:
    status, body, _ = await post(frontend, "/v1/completions", completion_body(max_tokens=2))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    assert frontend.client.requests[-1].stop_conditions.max_tokens == 2


@pytest.mark.parametrize(
    ("header", "body_priority", "sent"), [(None, 3, 3), ("-7", 3, -7), (" 12 ", None, 12)]
)
async def test_the_priority_header_wins_over_the_body_as_in_vllm(
    frontend: Frontend, header: str | None, body_priority: int | None, sent: int
) -> None:
    body = completion_body(max_tokens=2)
    if body_priority is not None:
        body["priority"] = body_priority
    headers = {} if header is None else {"X-Vllm-Priority": header}
    async with (
        aiohttp.ClientSession() as session,
        session.post(frontend.url + "/v1/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
    assert frontend.client.requests[-1].priority == sent


@pytest.mark.parametrize("header", ["soon", "1.5", str(2**31)])
async def test_a_priority_header_that_is_no_32_bit_integer_is_a_400_naming_it(
    frontend: Frontend, header: str
) -> None:
    sent_before = len(frontend.client.requests)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            frontend.url + "/v1/chat/completions",
            json=chat_body(),
            headers={"X-Vllm-Priority": header},
        ) as resp,
    ):
        assert resp.status == 400
        assert_openai_error(await resp.json(), param="X-Vllm-Priority")
    assert len(frontend.client.requests) == sent_before


async def last_request_cancelled(frontend: Frontend) -> str:
    """Wait until the engine sees the last request it was handed cancelled; its id."""
    rid = frontend.client.requests[-1].request_id
    await wait_until_async(
        lambda: rid in frontend.client.cancelled,
        timeout=3.0,
        interval=0.01,
        what=f"the engine to see request {rid} cancelled",
    )
    return rid


async def test_stop_string_is_not_leaked_and_cancels_the_engine(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, steps=(1,), delay=0.005)
    status, body, _ = await post(frontend, "/v1/completions", completion_body(stop=["friend"]))
    assert status == 200
    assert body["choices"][0]["text"] == "Hello there, "
    assert body["choices"][0]["finish_reason"] == "stop"
    await last_request_cancelled(frontend)


def reply_token_texts(frontend: Frontend, tokenizer: Any, count: int) -> list[str]:
    """The texts of the first `count` tokens the scripted engine replies with."""
    return [tokenizer.decode([t]) for t in frontend.engine.reply_ids()[:count]]


async def test_echo_and_completion_logprobs(frontend: Frontend, tokenizer: Any) -> None:
    """vLLM's shape: the echoed prompt's tokens lead `logprobs` (the first with no value),
    then the completion's, with offsets counted over the echoed text."""
    status, body, _ = await post(
        frontend, "/v1/completions", completion_body(echo=True, logprobs=1, max_tokens=3)
    )
    assert status == 200
    choice = body["choices"][0]
    tokens = reply_token_texts(frontend, tokenizer, 3)
    assert REPLY.startswith("".join(tokens))
    prompt = completion_body()["prompt"]
    assert choice["text"] == prompt + "".join(tokens)
    prompt_ids = frontend.client.requests[-1].token_ids
    prompt_tokens = [tokenizer.decode([t]) for t in prompt_ids]
    assert "".join(prompt_tokens) == prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == prompt_tokens + tokens
    assert lp["token_logprobs"] == [None] + [-0.5] * (len(prompt_ids) - 1) + [-0.25] * 3
    everything = prompt_tokens + tokens
    starts = [len("".join(everything[:i])) for i in range(len(everything))]
    assert lp["text_offset"] == starts, "offsets count the echoed prompt"
    assert lp["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in lp["top_logprobs"][len(prompt_ids) :])


async def test_chat_logprobs(frontend: Frontend, tokenizer: Any) -> None:
    status, body, _ = await post(
        frontend,
        "/v1/chat/completions",
        chat_body(logprobs=True, top_logprobs=2, max_tokens=2),
    )
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    tokens = reply_token_texts(frontend, tokenizer, 2)
    assert REPLY.startswith("".join(tokens))
    assert [c["token"] for c in content] == tokens
    assert [c["bytes"] for c in content] == [list(t.encode()) for t in tokens]
    assert len(content[0]["top_logprobs"]) == 2


# ---------------------------------------------------------------------- streaming


async def _sse_payloads(frontend: Frontend, path: str, body: dict[str, Any]) -> list[str]:
    """POST `body`: the `data:` payloads of the 200 event stream, the last one `[DONE]`."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(frontend.url + path, json=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        payloads = parse_sse(await resp.read())
    assert payloads[-1] == "[DONE]"
    return payloads


async def _stream(frontend: Frontend, path: str, body: dict[str, Any]) -> list[Any]:
    payloads = await _sse_payloads(frontend, path, body)
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


async def _stream_ending_in_engine_error(
    frontend: Frontend, path: str, body: dict[str, Any]
) -> tuple[list[str], Any]:
    """A stream whose last event before `[DONE]` is an `engine_error`: the payloads
    before it, and the error."""
    payloads = await _sse_payloads(frontend, path, body)
    error = json.loads(payloads[-2])
    assert_openai_error(error, code="engine_error")
    return payloads[:-2], error


async def test_streamed_completion_sse_format_and_usage(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, steps=(2,), delay=0.002)
    chunks = await _stream(
        frontend,
        "/v1/completions",
        completion_body(stream=True, stream_options={"include_usage": True}),
    )
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in content) == REPLY
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(frontend.engine.reply_ids()) + 1
    assert all("usage" not in c for c in content)


async def test_streamed_chat_starts_with_the_role_and_omits_usage_unless_asked(
    frontend: Frontend,
) -> None:
    frontend.engine.script = Script(reply=REPLY, delay=0.002)
    chunks = await _stream(frontend, "/v1/chat/completions", chat_body(stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)


async def test_streamed_multibyte_text_arrives_whole(frontend: Frontend) -> None:
    reply = "Emoji 😀🎉 and 你好世界!"
    frontend.engine.script = Script(reply=reply, steps=(1,), delay=0.001)
    chunks = await _stream(frontend, "/v1/completions", completion_body(stream=True))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == reply
    assert all("\ufffd" not in t for t in texts)


async def test_stop_string_split_across_streamed_chunks(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply="one two three four five", steps=(1,), delay=0.002)
    chunks = await _stream(
        frontend, "/v1/completions", completion_body(stream=True, stop=["ee fo"])
    )
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "one two thr"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_queued_engine_outputs_are_coalesced_into_one_event(frontend: Frontend) -> None:
    # No delay: every output is already queued when the writer runs.
    frontend.engine.script = Script(reply=REPLY, steps=(1,), delay=0.0)
    burst = await _stream(frontend, "/v1/completions", completion_body(stream=True))
    outputs = len(frontend.engine.reply_ids()) + 1
    assert outputs > 3
    assert len(burst) == 1
    assert burst[0]["choices"][0] == {
        "index": 0,
        "text": REPLY,
        "logprobs": None,
        "finish_reason": "stop",
    }
    # Paced outputs: one event per engine step.
    frontend.engine.script = Script(reply=REPLY, steps=(1,), delay=0.01)
    paced = await _stream(frontend, "/v1/completions", completion_body(stream=True))
    assert len(paced) >= outputs - 2  # the EOS step adds no text, only the finish


async def test_engine_failure_mid_stream_is_reported_in_band(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, delay=0.002, fail_after=2)
    await _stream_ending_in_engine_error(frontend, "/v1/chat/completions", chat_body(stream=True))


async def test_engine_exception_mid_stream_ends_the_stream_with_an_error(
    frontend: Frontend,
) -> None:
    frontend.engine.script = Script(
        reply=REPLY, delay=0.002, raise_exc=EngineFailedError("worker lost"), raise_after=3
    )
    before, error = await _stream_ending_in_engine_error(
        frontend, "/v1/completions", completion_body(stream=True)
    )
    texts = [json.loads(p)["choices"][0]["text"] for p in before]
    assert REPLY.startswith("".join(texts)) and texts
    assert "worker lost" in error["error"]["message"]


async def test_client_disconnect_cancels_the_engine_stream(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, delay=0.01, never_finish=True)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            frontend.url + "/v1/completions", json=completion_body(stream=True)
        )
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        resp.close()  # drop the connection mid-stream
    rid = await last_request_cancelled(frontend)
    assert rid not in frontend.client.completed
    metrics = frontend.service.metrics
    await wait_until_async(
        lambda: metrics.inflight.labels(MODEL)._value.get() == 0,
        timeout=3.0,
        interval=0.01,
        what="no request in flight in the frontend's metrics",
    )
    assert metrics.disconnects.labels(MODEL)._value.get() == 1


async def test_client_disconnect_cancels_a_unary_request(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, delay=0.01, never_finish=True)
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(
            session.post(frontend.url + "/v1/completions", json=completion_body())
        )
        await wait_until_async(
            lambda: len(frontend.client.requests) == 1,
            timeout=3.0,
            interval=0.01,
            what="the request to reach the engine",
        )
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await last_request_cancelled(frontend)


async def test_client_sockets_have_tcp_nodelay(frontend: Frontend) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(frontend.url + "/live") as resp:
            assert resp.status == 200
        connections = frontend.service.connections
        assert connections, "the keep-alive connection is still open"
        for handler in connections:
            sock = handler.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/completions", b"{not json", 400, None, "invalid_json"),
        ("/v1/completions", b"", 400, None, "invalid_json"),
        ("/v1/completions", b"[1, 2]", 400, None, None),
        ("/v1/completions", {"prompt": "x"}, 400, "model", None),
        ("/v1/completions", {"model": 5, "prompt": "x"}, 400, "model", None),
        ("/v1/completions", completion_body(max_tokens=-1), 400, "max_tokens", None),
        ("/v1/completions", completion_body(max_tokens="ten"), 400, "max_tokens", None),
        ("/v1/completions", completion_body(temperature=9.0), 400, "temperature", None),
        ("/v1/completions", completion_body(n=17), 400, "n", None),
        (
            "/v1/completions",
            completion_body(prompt="word " * 400),
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            completion_body(max_tokens=10_000),
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"content": "x"}]},
            400,
            "messages",
            None,
        ),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
        ("/v1/chat/completions", chat_body(messages=[]), 400, "messages", None),
        ("/v1/chat/completions", chat_body(stream="yes"), 400, "stream", None),
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": []},
            404,
            "model",
            "model_not_found",
        ),
    ],
)
async def test_bad_requests_get_openai_shaped_4xx(
    frontend: Frontend, path: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    got, parsed, _ = await post(frontend, path, body)
    assert got == status
    assert_openai_error(parsed, param=param, code=code)
    assert frontend.client.requests == []  # nothing reached the engine


async def test_unknown_fields_are_ignored(frontend: Frontend) -> None:
    status, body, _ = await post(
        frontend,
        "/v1/chat/completions",
        chat_body(tools=[], response_format={"type": "text"}, foo=1),
    )
    assert status == 200
    assert body["choices"][0]["message"]["content"] == REPLY


async def test_ten_megabyte_body_is_413(frontend: Frontend) -> None:
    body = json.dumps(completion_body(prompt="x" * (10 * 1024 * 1024))).encode()
    status, parsed, _ = await post(frontend, "/v1/completions", body)
    assert status == 413
    assert_openai_error(parsed, code="request_too_large")


async def test_unknown_route_and_wrong_method_are_json(frontend: Frontend) -> None:
    status, raw, ctype = await get(frontend, "/v1/nothing")
    assert (status, ctype) == (404, "application/json")
    assert_openai_error(json.loads(raw))
    status, raw, ctype = await get(frontend, "/v1/completions")
    assert (status, ctype) == (405, "application/json")
    assert_openai_error(json.loads(raw))


@pytest.mark.parametrize("stream", [False, True])
async def test_known_model_without_workers_is_503(frontend: Frontend, stream: bool) -> None:
    await frontend.client.close()  # the in-memory client now has no instances
    start = asyncio.get_running_loop().time()
    status, body, _ = await post(frontend, "/v1/completions", completion_body(stream=stream))
    assert status == 503
    assert_openai_error(body, code="no_instances")
    # ... but only after waiting the configured time for one to come back.
    assert asyncio.get_running_loop().time() - start >= WORKER_WAIT_S


async def test_request_waits_for_a_worker_that_comes_back(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY)
    frontend.client.set_instance_ids([])  # a restart, or a lease heartbeat that came late

    async def come_back() -> None:
        await asyncio.sleep(WORKER_WAIT_S / 3)
        frontend.client.set_instance_ids([7])

    returning = asyncio.create_task(come_back())
    status, body, _ = await post(frontend, "/v1/chat/completions", chat_body())
    await returning
    assert status == 200
    assert body["choices"][0]["message"]["content"] == REPLY


async def test_worker_vanishing_before_output_is_503(frontend: Frontend) -> None:
    frontend.engine.script = Script(raise_exc=EngineUnavailableError("all gone"))
    status, body, _ = await post(frontend, "/v1/chat/completions", chat_body(stream=True))
    assert status == 503
    assert_openai_error(body, code="no_instances")


async def test_engine_failure_is_500_engine_error(frontend: Frontend) -> None:
    frontend.engine.script = Script(raise_exc=EngineFailedError("worker crashed"))
    status, body, _ = await post(frontend, "/v1/completions", completion_body())
    assert status == 500
    assert_openai_error(body, code="engine_error")
    assert "worker crashed" in body["error"]["message"]
    frontend.engine.script = Script(fail_after=1)
    status, body, _ = await post(frontend, "/v1/completions", completion_body())
    assert status == 500
    assert_openai_error(body, code="engine_error")


# ---------------------------------------------------------------------- operational endpoints


async def test_models_health_and_live(frontend: Frontend) -> None:
    status, raw, _ = await get(frontend, "/v1/models")
    listing = json.loads(raw)
    assert status == 200 and listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [MODEL]
    assert listing["data"][0]["object"] == "model"
    status, raw, _ = await get(frontend, f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(raw)["id"] == MODEL
    status, raw, _ = await get(frontend, "/v1/models/unknown")
    assert status == 404
    assert_openai_error(json.loads(raw), code="model_not_found")

    status, raw, _ = await get(frontend, "/health")
    assert status == 200
    assert json.loads(raw) == {"status": "healthy", "models": {MODEL: {"instances": [1]}}}
    assert (await get(frontend, "/live"))[0] == 200

    await frontend.client.close()
    status, raw, _ = await get(frontend, "/health")
    assert status == 503 and json.loads(raw)["status"] == "unhealthy"
    assert (await get(frontend, "/live"))[0] == 200


async def test_model_disappears_with_its_last_worker(frontend: Frontend) -> None:
    assert await frontend.manager.remove_instance(1) == [MODEL]
    status, body, _ = await post(frontend, "/v1/completions", completion_body())
    assert status == 404
    assert_openai_error(body, code="model_not_found")
    status, raw, _ = await get(frontend, "/v1/models")
    assert json.loads(raw)["data"] == []


async def test_metrics_count_requests_tokens_and_latency(frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, steps=(1,), delay=0.002)
    assert (await post(frontend, "/v1/completions", completion_body()))[0] == 200
    assert (await post(frontend, "/v1/chat/completions", chat_body(stream=True)))[0] == 200
    assert (await post(frontend, "/v1/completions", completion_body(n=17)))[0] == 400
    assert (await post(frontend, "/v1/completions", {"model": "x", "prompt": "y"}))[0] == 404
    status, raw, ctype = await get(frontend, "/metrics")
    assert status == 200 and ctype == "text/plain"
    text = raw.decode()
    tokens = len(frontend.engine.reply_ids()) + 1
    for line in [
        f'dynamo_frontend_requests_total{{endpoint="completions",model="{MODEL}",request_type="unary",status="200"}} 1.0',
        f'dynamo_frontend_requests_total{{endpoint="chat_completions",model="{MODEL}",request_type="stream",status="200"}} 1.0',
        f'dynamo_frontend_requests_total{{endpoint="completions",model="{MODEL}",request_type="unary",status="400"}} 1.0',
        'dynamo_frontend_requests_total{endpoint="completions",model="",request_type="unary",status="404"} 1.0',
        f'dynamo_frontend_output_tokens_total{{model="{MODEL}"}} {float(2 * tokens)}',
        f'dynamo_frontend_time_to_first_token_seconds_count{{model="{MODEL}"}} 2.0',
        f'dynamo_frontend_inter_token_latency_seconds_count{{model="{MODEL}"}} {float(2 * (tokens - 1))}',
        f'dynamo_frontend_request_duration_seconds_count{{model="{MODEL}"}} 2.0',
        f'dynamo_frontend_inflight_requests{{model="{MODEL}"}} 0.0',
    ]:
        assert line in text, line


async def test_a_body_that_never_completes_gets_408(
    frontend: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(request_body, "BODY_READ_TIMEOUT_S", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.service.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model":'
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    assert_openai_error(json.loads(await reader.readexactly(length)), code="request_timeout")
    writer.close()
