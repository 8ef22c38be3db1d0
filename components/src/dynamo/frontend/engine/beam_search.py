"""Beam search (vLLM's `use_beam_search`), run by the frontend over any `EngineClient`.

vLLM serves beam search in its OpenAI server, not in its engine, and so does this
frontend, with vLLM's algorithm: for each token, every live beam is sent to a worker as a
request for one token with `2 x width` logprobs; each beam's candidates are scored by
cumulative logprob; a candidate that is the end-of-sequence token completes its beam
(unless `ignore_eos`); the `width` best of the others go on. At the end the completed
beams and the live ones are sorted by `cumulative logprob / length ** length_penalty`
(the length counts the prompt, and not a final end token) and the `width` best are the
response's choices, best first.

Each step's requests go through the engine client like any request, so they are routed
(a beam's prefix is what the KV router sees cached), placed again when a worker is lost,
and cancelled with the response. The choices are sent as one output each at the end:
beam search has nothing to stream before the last step decides which beams win.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import msgspec

from dynamo.frontend.engine.client import EngineClient
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BeamSearch:
    """A request's beam search: vLLM's `BeamSearchParams` for it."""

    width: int  # the request's `n`
    max_tokens: int
    temperature: float
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


@dataclass
class Beam:
    """One sequence of the search: its generated tokens and their summed logprob."""

    tokens: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finished: bool = False  # ended at the end-of-sequence token


def beam_score(beam: Beam, prompt_len: int, eos_token_id: int, length_penalty: float) -> float:
    """vLLM's sort key: the cumulative logprob over the length (prompt included, a final
    end token not) to the power `length_penalty`."""
    length = prompt_len + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] == eos_token_id:
        length -= 1
    return beam.cumulative_logprob / (max(length, 1) ** length_penalty)


class BeamSearchEngineClient:
    """An `EngineClient` that answers a request with the `width` best beams, one output
    per choice (`index` 0 is the best), by running the search over `engine`."""

    def __init__(self, engine: EngineClient, search: BeamSearch, eos_token_id: int) -> None:
        self.engine = engine
        self.search = search
        self.eos_token_id = eos_token_id

    def instance_ids(self) -> list[int]:
        return self.engine.instance_ids()

    async def close(self) -> None:
        """Nothing of its own: `engine` belongs to the model registry."""

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        search = self.search
        live = [Beam()]
        completed: list[Beam] = []
        for step in range(search.max_tokens):
            steps = [self._step(request, beam, step, i) for i, beam in enumerate(live)]
            results = await asyncio.gather(*steps)
            failure = next((r for r in results if isinstance(r, str)), None)
            if failure is not None:
                yield LLMEngineOutput(finish_reason=FinishReason.ERROR, error=failure)
                return
            candidates: list[Beam] = []
            for beam, top in zip(live, results, strict=True):
                assert not isinstance(top, str)
                for token_id, logprob in top:
                    grown = Beam([*beam.tokens, token_id], beam.cumulative_logprob + logprob)
                    if token_id == self.eos_token_id and not search.ignore_eos:
                        grown.finished = True
                        if not search.include_stop_str_in_output:
                            grown.tokens.pop()
                        completed.append(grown)
                    else:
                        candidates.append(grown)
            candidates.sort(key=lambda b: -b.cumulative_logprob)
            live = candidates[: search.width]
            if not live:
                break
        for output in self._choices(request, [*completed, *live]):
            yield output

    def _choices(self, request: PreprocessedRequest, beams: list[Beam]) -> list[LLMEngineOutput]:
        prompt_len = len(request.token_ids)
        penalty = self.search.length_penalty
        best = sorted(
            beams, key=lambda b: beam_score(b, prompt_len, self.eos_token_id, penalty), reverse=True
        )[: self.search.width]
        return [
            LLMEngineOutput(
                token_ids=beam.tokens,
                index=index,
                finish_reason=FinishReason.EOS if beam.finished else FinishReason.LENGTH,
                completion_usage=CompletionUsage(
                    prompt_tokens=prompt_len,
                    completion_tokens=len(beam.tokens),
                    total_tokens=prompt_len + len(beam.tokens),
                ),
            )
            for index, beam in enumerate(best)
        ]

    async def _step(
        self, request: PreprocessedRequest, beam: Beam, step: int, index: int
    ) -> list[tuple[int, float]] | str:
        """The candidates after `beam` (token, logprob), from one token's request; or why
        the request failed."""
        leg = step_request(request, beam, self.search, f"{request.request_id}-beam{step}-{index}")
        stream = self.engine.generate(leg)
        try:
            return await _first_logprobs(stream)
        finally:
            await stream.aclose()


def step_request(
    request: PreprocessedRequest, beam: Beam, search: BeamSearch, request_id: str
) -> PreprocessedRequest:
    """What vLLM asks its engine for at each step of a beam: one token at the search's
    temperature, with `2 x width` logprobs, and nothing else of the request's sampling."""
    return msgspec.structs.replace(
        request,
        request_id=request_id,
        token_ids=[*request.token_ids, *beam.tokens],
        sampling_options=SamplingOptions(temperature=search.temperature),
        stop_conditions=StopConditions(max_tokens=1),
        output_options=OutputOptions(logprobs=2 * search.width),
        structured_output=None,
        prefill_result=None,
    )


async def _first_logprobs(stream: AsyncIterator[LLMEngineOutput]) -> list[tuple[int, float]] | str:
    async for output in stream:
        if output.error is not None or output.finish_reason is FinishReason.ERROR:
            return output.error or "the engine failed a beam's step"
        if output.log_probs:
            top = output.log_probs[0].top or []
            return list(dict((t.token_id, t.logprob) for t in top).items())
    return "a beam's step ended without logprobs"
