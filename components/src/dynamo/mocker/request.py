"""One request inside the simulated engine: its limits, its token stream, its outputs.

Everything here concerns a single request and no shared state, so the engine module is
left with scheduling and block accounting. `admit_request` validates a
`PreprocessedRequest` the way vLLM does before it reaches the scheduler (prompt within the
context, token ids in the vocabulary, max_tokens >= 1, top_p in (0, 1], no more logprobs
than `max_logprobs`) and fixes the request's limits;
`MockRequest.sample` applies them token by token exactly as vLLM's stop checker does
(EOS and stop tokens only once min_tokens are out, the stopping token kept in the output,
max_tokens last).
"""

from __future__ import annotations

import asyncio
import enum
import random
from dataclasses import dataclass, field

from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptLogprobs,
    PromptTokensDetails,
    RankedLogprob,
    SpecDecodeStats,
    TokenLogprob,
    TopLogprob,
)
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.handoff import KvHandoff
from dynamo.mocker.tokens import TokenSampler, request_seed


class RequestRejected(ValueError):
    """The request cannot be served at all (bad prompt, duplicate id, dead engine)."""


class InvalidRequest(RequestRejected):
    """The request's own parameters are refused (vLLM raises `VLLMValidationError`): the
    client's error, which a worker reports as such (HTTP 400 at the frontend)."""


class Phase(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"  # admitted, its prompt's KV arriving (`transfer`)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SpecTally:
    """Speculative statistics of one request (sent in its final output)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)

    def record(self, accepted: int, k: int) -> None:
        if not self.histogram:
            self.histogram = [0] * (k + 1)
        self.drafts += 1
        self.draft_tokens += k
        self.accepted += accepted
        self.histogram[accepted] += 1

    def stats(self, k: int) -> SpecDecodeStats:
        return SpecDecodeStats(
            num_drafts=self.drafts,
            num_draft_tokens=self.draft_tokens,
            num_accepted_tokens=self.accepted,
            acceptance_histogram=self.histogram or [0] * (k + 1),
        )


@dataclass(eq=False, slots=True)
class MockRequest:
    """A request's limits, generated tokens, block holdings and statistics."""

    request_id: str
    prompt_len: int
    tokens: list[int]  # prompt + output so far
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]  # empty with ignore_eos
    logprobs: int | None
    prompt_logprobs: int | None  # sent once, on the first output of sequence 0
    logprob_token_ids: tuple[int, ...]  # reported in place of the top `logprobs`
    sampler: TokenSampler
    accept_rng: random.Random
    outputs: asyncio.Queue[LLMEngineOutput] = field(default_factory=asyncio.Queue)
    phase: Phase = Phase.WAITING
    prefill_remaining: int = 0  # tokens still to compute before the next token
    pinned: list[int] = field(default_factory=list)  # cached blocks referenced, in order
    private: int = 0  # private blocks held
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    preemptions: int = 0
    spec: SpecTally = field(default_factory=SpecTally)
    index: int = 0  # which of the request's `n` sequences this is (its outputs say so)
    speculative: bool = True  # False: the request turned speculation off (one token a step)
    handoff: KvHandoff | None = None  # a prefill worker's KV to load at first admission

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def sample(
        self, count: int, eos_probability: float
    ) -> tuple[list[int], FinishReason | None, int | None]:
        """Up to `count` next tokens, cut at EOS, a stop token or max_tokens; returns them
        with the finish reason and, for a stop token, the token as stop reason."""
        tokens: list[int] = []
        if not self.eos_token_ids:
            eos_probability = 0.0
        for _ in range(count):
            produced = self.num_output + len(tokens)
            may_stop = produced >= self.min_tokens
            if may_stop and self.sampler.chance(eos_probability):
                token = min(self.eos_token_ids)
            else:
                forbidden = () if may_stop else self.stop_token_ids | self.eos_token_ids
                token = self.sampler.next_token(forbidden)
            tokens.append(token)
            if may_stop and token in self.eos_token_ids:
                return tokens, FinishReason.EOS, None
            if may_stop and token in self.stop_token_ids:
                return tokens, FinishReason.STOP, token
            if produced + 1 >= self.max_tokens:
                return tokens, FinishReason.LENGTH, None
        return tokens, None, None

    def output(self, tokens: list[int]) -> LLMEngineOutput:
        """One step's output (log-probabilities when the client asked for them; the
        prompt's, emulated, on the first output)."""
        output = LLMEngineOutput(
            token_ids=tokens, index=self.index, log_probs=self._logprobs(tokens)
        )
        if self.prompt_logprobs is not None:
            output.prompt_logprobs = self._prompt_logprobs(self.prompt_logprobs)
            self.prompt_logprobs = None
        return output

    def finish(
        self,
        output: LLMEngineOutput,
        reason: FinishReason,
        *,
        stop_reason: int | None,
        error: str | None,
        num_speculative_tokens: int,
    ) -> LLMEngineOutput:
        """Turn `output` into the final one: finish reason, usage (cached tokens from the
        simulated prefix cache) and, with speculation, the request's statistics."""
        output.index = self.index
        output.finish_reason = reason
        output.stop_reason = stop_reason
        output.error = error
        output.completion_usage = CompletionUsage(
            prompt_tokens=self.prompt_len,
            completion_tokens=self.num_output,
            total_tokens=len(self.tokens),
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens or 0),
        )
        if num_speculative_tokens:
            output.spec_decode_stats = self.spec.stats(num_speculative_tokens)
        self.phase = Phase.FINISHED
        return output

    def _prompt_logprobs(self, top: int) -> PromptLogprobs:
        """vLLM's shape: nothing for the first position, then the prompt's token and `top`
        alternatives, ranked (the values are the simulation's, not a model's)."""
        logprob = self.sampler.logprob
        positions: PromptLogprobs = [None]
        for token in self.tokens[1 : self.prompt_len]:
            ranked = [token, *self.sampler.alternatives(top, token)]
            positions.append(
                [RankedLogprob(t, logprob, rank) for rank, t in enumerate(ranked, start=1)]
            )
        return positions

    def _logprobs(self, tokens: list[int]) -> list[TokenLogprob] | None:
        if self.logprobs is None and not self.logprob_token_ids:
            return None
        logprob = self.sampler.logprob
        return [
            TokenLogprob(
                token_id=token,
                logprob=logprob,
                top=[TopLogprob(t, logprob) for t in self._reported(token)],
            )
            for token in tokens
        ]

    def _reported(self, token: int) -> list[int]:
        """The tokens whose logprobs a position reports: the sampled one, then the asked
        ids, or the top `logprobs` alternatives."""
        if self.logprob_token_ids:
            return list(dict.fromkeys((token, *self.logprob_token_ids)))
        return [token, *self.sampler.alternatives(self.logprobs or 0, token)]


def _check_sampling(request: PreprocessedRequest, config: MockEngineConfig) -> None:
    """The sampling checks of vLLM that a frontend cannot make for every worker (its
    `--max-logprobs`) or does not make (top_p of 0), in vLLM's words."""
    top_p = request.sampling_options.top_p
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}.")
    allowed = request.sampling_options.allowed_token_ids
    if allowed is not None and not allowed:
        raise InvalidRequest("allowed_token_ids is not None and empty!")
    if allowed and any(not 0 <= t < config.vocab_size for t in allowed):
        raise InvalidRequest("allowed_token_ids contains out-of-vocab token id!")
    chosen = request.output_options.logprob_token_ids or ()
    out_of_vocab = [t for t in chosen if not 0 <= t < config.vocab_size]
    if out_of_vocab:
        raise InvalidRequest(
            f"token_id(s) {out_of_vocab} in logprob_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {config.vocab_size}"
        )
    logprobs = request.output_options.logprobs
    if logprobs is not None and logprobs > config.max_logprobs:
        raise InvalidRequest(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
            f"{config.max_logprobs}"
        )
    prompt_logprobs = request.output_options.prompt_logprobs
    if prompt_logprobs == -1:
        prompt_logprobs = config.vocab_size
    if prompt_logprobs is not None and prompt_logprobs > config.max_logprobs:
        raise InvalidRequest(
            f"Requested prompt logprobs of {prompt_logprobs}, which is greater than max "
            f"allowed: {config.max_logprobs}"
        )


def _prompt_alternatives(request: PreprocessedRequest, config: MockEngineConfig) -> int | None:
    """Alternatives per prompt position the request asked for (-1: the vocabulary)."""
    asked = request.output_options.prompt_logprobs
    return config.vocab_size if asked == -1 else asked


def _check_supported(request: PreprocessedRequest) -> None:
    """Features the simulation cannot honour are refused, never ignored: random tokens
    that claim to follow a JSON schema would pass a 200 that breaks the client's parser."""
    if request.structured_output is not None:
        raise InvalidRequest(
            "structured output (`response_format`, `structured_outputs`, `guided_*`) "
            "is not supported by the mocker; use a vLLM worker"
        )
    sampling = request.sampling_options
    for name in MOCKER_CANNOT_EMULATE:
        if getattr(sampling, name):
            raise InvalidRequest(
                f"`{name}` cannot be emulated by the mocker (its tokens do not come from "
                "logits); use a vLLM worker"
            )


MOCKER_CANNOT_EMULATE = ("logit_bias", "bad_words", "thinking_token_budget")
"""Sampling fields whose effect random tokens cannot show (`allowed_token_ids` can: the
tokens are drawn from the allowed ids; the mocker has no reasoning to budget)."""


def admit_request(
    request: PreprocessedRequest,
    request_id: str,
    config: MockEngineConfig,
    *,
    index: int = 0,
    outputs: asyncio.Queue[LLMEngineOutput] | None = None,
) -> MockRequest:
    """Validate a request and fix its limits; raises RequestRejected. `index` is the
    sequence's index with `n` > 1 (its tokens differ from its siblings'), `outputs` the
    queue it shares with them (None: its own)."""
    prompt = list(request.token_ids)
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    if len(prompt) >= config.max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens; the context length is {config.max_model_len}"
        )
    bad = next((t for t in prompt if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is out of vocabulary (size {config.vocab_size})")
    stop = request.stop_conditions
    if stop.max_tokens is not None and stop.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {stop.max_tokens}")
    _check_sampling(request, config)
    _check_supported(request)
    room = config.max_model_len - len(prompt)
    max_tokens = room if stop.max_tokens is None else min(stop.max_tokens, room)
    eos = () if stop.ignore_eos else (request.eos_token_ids or config.eos_token_ids)
    # One seed per request: the same request produces the same tokens anywhere.
    rng = random.Random(request_seed(config.seed, request.sampling_options.seed, prompt, index))
    state = MockRequest(
        request_id=request_id,
        prompt_len=len(prompt),
        tokens=prompt,
        max_tokens=max_tokens,
        min_tokens=max(stop.min_tokens or 0, 0),
        stop_token_ids=frozenset(stop.stop_token_ids or ()),
        eos_token_ids=frozenset(eos),
        logprobs=request.output_options.logprobs,
        prompt_logprobs=_prompt_alternatives(request, config) if index == 0 else None,
        logprob_token_ids=tuple(request.output_options.logprob_token_ids or ()),
        sampler=TokenSampler(
            request.sampling_options.allowed_token_ids or prompt,
            random.Random(rng.getrandbits(64)),
            vocab_size=config.vocab_size,
            excluded=config.special_token_ids | frozenset(config.eos_token_ids),
        ),
        accept_rng=random.Random(rng.getrandbits(64)),
        index=index,
        speculative=request.sampling_options.speculative_decoding is not False,
    )
    if outputs is not None:
        state.outputs = outputs
    return state
