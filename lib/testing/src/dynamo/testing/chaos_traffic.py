"""The traffic of a chaos soak: client loops sending a mix of requests and recording how
each ended (completed, failed, connection lost, hung, wrong, cancelled).

Separate from the stack and the faults because it only speaks HTTP to the frontend, the
way a user would: `Traffic` knows the request mix, reads plain and streamed answers, and
checks the mocker's completions token for token (`dynamo.testing.mocker_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.chaos_records import Record, SoakConfig
from dynamo.testing.chaos_stack import MOCK_MODEL, SoakStack
from dynamo.testing.mocker_tokens import ExpectedTokens
from dynamo.testing.sse import sse_data

CHECKED_TOKENS = 40
PROMPT_TOKENS = 24
CANCEL_AFTER_CHUNKS = 3
RETRY_PAUSE_S = 0.5
"""A client's pause after an error before its next request (a 404 while the only worker of
a model restarts would otherwise be a spin of hundreds a second)."""


class Traffic:
    """The client loops and what they recorded."""

    def __init__(self, stack: SoakStack, config: SoakConfig, expected: ExpectedTokens) -> None:
        self.stack = stack
        self.config = config
        self.expected = expected
        self.records: list[Record] = []
        self.stop = asyncio.Event()
        kinds = ["checked_stream", "checked", "chat_stream", "chat", "n2", "cancel"]
        if config.vllm:
            kinds += ["vllm_structured", "vllm_tools", "vllm_seeded", "vllm_long"]
        self.kinds = kinds

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.config.clients)))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(f"{self.config.seed}:{index}")
        while not self.stop.is_set():
            kind = rng.choice(self.kinds)
            record = Record(kind, time.monotonic())
            self.records.append(record)
            try:
                await asyncio.wait_for(
                    self._send(session, kind, rng, record), self.config.request_deadline_s
                )
            except TimeoutError:
                record.outcome, record.detail = "hung", "no end within the deadline"
            except aiohttp.ClientError as exc:
                record.outcome, record.detail = "connection_lost", repr(exc)
            except ValueError as exc:  # a body that is not the JSON it should be
                record.outcome, record.detail = "failed", f"unreadable response: {exc!r}"
            record.ended = time.monotonic()
            if record.outcome in ("failed", "connection_lost"):
                await asyncio.sleep(RETRY_PAUSE_S)  # as a client would, not in a spin

    async def _send(
        self, session: aiohttp.ClientSession, kind: str, rng: random.Random, record: Record
    ) -> None:
        prompt = rng.sample(range(1000, 9000), PROMPT_TOKENS)
        chat = [{"role": "user", "content": f"Tell me about item {rng.randrange(10**6)}."}]
        mock = {"model": MOCK_MODEL}
        vllm = {"model": DEFAULT_MODEL, "max_tokens": 24}
        checked = {**mock, "prompt": prompt, "max_tokens": CHECKED_TOKENS, "ignore_eos": True}
        bodies: dict[str, tuple[str, dict[str, Any], bool]] = {
            "checked_stream": ("completions", checked, True),
            "checked": ("completions", checked, False),
            "chat_stream": ("chat/completions", {**mock, "messages": chat, "max_tokens": 30}, True),
            "chat": ("chat/completions", {**mock, "messages": chat, "max_tokens": 30}, False),
            "n2": ("completions", {**mock, "prompt": prompt, "max_tokens": 20, "n": 2}, False),
            "cancel": ("completions", {**mock, "prompt": prompt, "max_tokens": 200}, True),
            "vllm_structured": ("chat/completions", {**vllm, "messages": chat, "response_format": {
                "type": "json_schema", "json_schema": {"name": "item", "schema": {
                    "type": "object", "properties": {"name": {"type": "string"}},
                    "required": ["name"]}}}}, False),
            "vllm_tools": ("chat/completions", {**vllm, "messages": chat, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
                    "type": "object", "properties": {"item": {"type": "string"}}}}}]}, False),
            "vllm_seeded": ("completions", {**vllm, "prompt": "Once upon a time",
                "temperature": 0.8, "seed": rng.randrange(1000)}, True),
            "vllm_long": ("completions", {**vllm, "max_tokens": 8,
                "prompt": " ".join(f"word{rng.randrange(500)}" for _ in range(450))}, False),
        }  # fmt: skip
        path, body, stream = bodies[kind]
        url = f"{self.stack.base_url}/v1/{path}"
        if stream:
            text, usage = await self._stream(session, url, body, record, kind == "cancel")
        else:
            text, usage = await self._plain(session, url, body, record)
        if record.outcome == "completed" and kind.startswith("checked"):
            await self._check(prompt, text, usage, record)

    async def _plain(
        self, session: aiohttp.ClientSession, url: str, body: dict[str, Any], record: Record
    ) -> tuple[str, dict[str, Any]]:
        async with session.post(url, json=body) as resp:
            payload = await resp.json(content_type=None)
        if resp.status != 200:
            record.outcome, record.detail = "failed", str(payload.get("error", payload))[:200]
            return "", {}
        choices = payload.get("choices") or []
        if not choices or any(c.get("finish_reason") is None for c in choices):
            record.outcome, record.detail = "failed", f"no finish reason: {payload}"[:200]
            return "", {}
        record.outcome = "completed"
        return choices[0].get("text") or "", payload.get("usage") or {}

    async def _stream(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        record: Record,
        cancel: bool,
    ) -> tuple[str, dict[str, Any]]:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        texts: list[str] = []
        usage: dict[str, Any] = {}
        finished = done = False
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                record.outcome, record.detail = "failed", (await resp.text())[:200]
                return "", {}
            async for data in sse_data(resp.content):
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    record.outcome, record.detail = "failed", str(event["error"])[:200]
                    return "", {}
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    texts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                    finished = finished or choice.get("finish_reason") is not None
                if cancel and len(texts) >= CANCEL_AFTER_CHUNKS:
                    record.outcome = "cancelled"
                    return "", {}
        if done and finished:
            record.outcome = "completed"
        else:
            record.outcome, record.detail = "failed", "the stream ended without [DONE]"
        return "".join(texts), usage

    async def _check(
        self, prompt: list[int], text: str, usage: dict[str, Any], record: Record
    ) -> None:
        resumed = await asyncio.to_thread(self.expected.migrations, prompt, text, CHECKED_TOKENS)
        if resumed is None or usage.get("completion_tokens") != CHECKED_TOKENS:
            record.outcome = "wrong"
            # Whole, so that the tokens can be recomputed (`ExpectedTokens`) and compared.
            record.detail = f"prompt {prompt}, usage {usage}, text {text!r}"
        elif resumed:
            record.detail = f"resumed {resumed} time(s)"
