"""Per-request speculative decoding statistics in OpenAI responses.

Claims: with `"return_spec_stats": true` (or the frontend's `--return-spec-stats`), the
statistics the worker sends on its final output come back as `metrics.speculative_decoding`
in vLLM's per-request shape, beside usage: in the body of a unary response, in the final
usage chunk of a stream (and in no other chunk); without the request, or when the worker
sends none (it does not speculate), the field is absent. The derived numbers (mean
acceptance length, acceptance rate, acceptance per position) follow from the histogram.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from frontend_support import MODEL, Frontend, ScriptedEngine, parse_sse, start_frontend

from dynamo.frontend.__main__ import build_parser, config_from_args
from dynamo.frontend.postprocess.postprocessor import speculative_decoding_metrics
from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest, SpecDecodeStats

# K = 3: two steps accepted nothing, one accepted 1 draft, three accepted 3.
STATS = SpecDecodeStats(
    num_drafts=6, num_draft_tokens=18, num_accepted_tokens=10, acceptance_histogram=[2, 1, 0, 3]
)
EXPECTED = {
    "mean_acceptance_length": 1 + 10 / 6,
    "draft_acceptance_rate": 10 / 18,
    "acceptance_histogram": [2, 1, 0, 3],
    "num_spec_steps": 6,
    "num_accepted_draft_tokens": 10,
    "num_draft_tokens": 18,
    "num_spec_tokens": 3,
    "acceptance_per_position": [4, 3, 3],
}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class SpeculatingEngine:
    """The scripted engine, with `stats` on its final output (as a speculating vLLM
    worker sends them)."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner = inner
        self.stats: SpecDecodeStats | None = STATS

    async def __call__(self, request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        async for output in self.inner(request):
            if output.finish_reason is not None:
                output.spec_decode_stats = self.stats
            yield output


async def _start(tokenizer: Any, **service_kwargs: Any) -> tuple[Frontend, SpeculatingEngine]:
    """`frontend_support.start_frontend`, with the speculating engine behind it."""
    engine = SpeculatingEngine(ScriptedEngine(tokenizer))
    frontend = await start_frontend(
        tokenizer, engine=engine.inner, handler=engine, **service_kwargs
    )
    return frontend, engine


@pytest.fixture(scope="module")
async def served(tokenizer: Any) -> AsyncIterator[tuple[Frontend, SpeculatingEngine]]:
    running, engine = await _start(tokenizer)
    try:
        yield running, engine
    finally:
        await running.service.stop()


@pytest.fixture
def frontend(served: tuple[Frontend, SpeculatingEngine]) -> Frontend:
    served[1].stats = STATS
    return served[0]


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        base["prompt"] = "Hi"
    return {**base, **fields}


async def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as resp:
            return resp.status, await resp.read()


def test_the_response_shape_follows_from_the_histogram() -> None:
    assert msgspec.to_builtins(speculative_decoding_metrics(STATS)) == EXPECTED


def test_a_step_with_no_drafts_yields_no_positions() -> None:
    metrics = speculative_decoding_metrics(SpecDecodeStats())
    assert metrics.num_spec_tokens == 0 and metrics.acceptance_per_position == []
    assert metrics.mean_acceptance_length == 1.0 and metrics.draft_acceptance_rate == 0.0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_unary_responses_carry_the_stats_beside_usage(frontend: Frontend, path: str) -> None:
    status, raw = await post(frontend.url + path, body_for(path, return_spec_stats=True))
    assert status == 200, raw
    reply = json.loads(raw)
    assert reply["usage"]["completion_tokens"] > 0
    assert reply["metrics"]["speculative_decoding"] == EXPECTED


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_without_the_request_field_there_are_no_metrics(
    frontend: Frontend, path: str
) -> None:
    for fields in ({}, {"return_spec_stats": False}):
        status, raw = await post(frontend.url + path, body_for(path, **fields))
        assert status == 200, raw
        assert "metrics" not in json.loads(raw)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_stream_carries_the_stats_in_its_final_usage_chunk_only(
    frontend: Frontend, path: str
) -> None:
    body = body_for(
        path, stream=True, stream_options={"include_usage": True}, return_spec_stats=True
    )
    status, raw = await post(frontend.url + path, body)
    assert status == 200, raw
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    final = chunks[-1]
    assert final["choices"] == [] and "usage" in final
    assert final["metrics"]["speculative_decoding"] == EXPECTED
    assert all("metrics" not in chunk for chunk in chunks[:-1])


async def test_a_worker_that_does_not_speculate_sends_no_stats(
    frontend: Frontend, served: tuple[Frontend, SpeculatingEngine]
) -> None:
    served[1].stats = None
    status, raw = await post(frontend.url + CHAT, body_for(CHAT, return_spec_stats=True))
    assert status == 200, raw
    assert "metrics" not in json.loads(raw)


async def test_the_frontend_flag_returns_stats_for_every_request(tokenizer: Any) -> None:
    running, _ = await _start(tokenizer, return_spec_stats=True)
    try:
        status, raw = await post(running.url + CHAT, body_for(CHAT))
    finally:
        await running.service.stop()
    assert status == 200, raw
    assert json.loads(raw)["metrics"]["speculative_decoding"] == EXPECTED


def test_the_cli_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    monkeypatch.delenv("DYN_RETURN_SPEC_STATS", raising=False)
    assert config_from_args(build_parser().parse_args([])).http.return_spec_stats is False
    assert config_from_args(parser.parse_args(["--return-spec-stats"])).http.return_spec_stats
    monkeypatch.setenv("DYN_RETURN_SPEC_STATS", "1")
    assert config_from_args(build_parser().parse_args([])).http.return_spec_stats is True
    off = build_parser().parse_args(["--no-return-spec-stats"])
    assert config_from_args(off).http.return_spec_stats is False
