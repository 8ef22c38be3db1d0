"""From the engine's token stream to text deltas: the inverse of the preprocessor.

One `Postprocessor` per request consumes `LLMEngineOutput`s (1..K+1 token ids per step
with speculation, possibly several steps at once when they queued up) and produces
`TextDelta`s that are independent of the OpenAI endpoint: incremental detokenization,
stop strings (never leaked), hidden stop tokens, logprobs, finish reason and usage.
`formatters.py` then shapes them into completion or chat objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from dynamo.frontend.openai.protocol import (
    PerRequestMetrics,
    PromptTokensDetails,
    SpeculativeDecodingMetrics,
    Usage,
)
from dynamo.frontend.postprocess.detokenizer import DecodeFn, IncrementalDetokenizer, TokenTexts
from dynamo.frontend.postprocess.stop_strings import StopStringMatcher
from dynamo.frontend.preprocess.preprocessor import OutputPlan
from dynamo.llm.acceptance import acceptance_rate
from dynamo.llm.protocols import FinishReason, LLMEngineOutput, SpecDecodeStats, TokenLogprob

# Wire finish reasons as OpenAI names them. `error` is not here: it becomes an error.
_OPENAI_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",  # aborted by the engine (vLLM's name for it)
}


def one_token_outputs(output: LLMEngineOutput) -> Iterator[LLMEngineOutput]:
    """`output` split into one output per token, the way vLLM's detokenizer checks stop
    strings: a worker's output carries several tokens with speculation, or when engine
    steps queued up behind a busy consumer, and a stop string completed by one of them
    ends the response there (later tokens are neither counted nor returned, whatever the
    timing). Each piece keeps its token's logprobs; the last keeps how the output ended
    (finish and stop reasons, usage, statistics)."""
    ids, logprobs = output.token_ids, output.log_probs
    last = len(ids) - 1
    for i, token in enumerate(ids):
        own = logprobs[i : i + 1] if logprobs else None
        if i == last:
            yield msgspec.structs.replace(output, token_ids=[token], log_probs=own)
        else:
            yield LLMEngineOutput(token_ids=[token], index=output.index, log_probs=own)


def speculative_decoding_metrics(stats: SpecDecodeStats) -> SpeculativeDecodingMetrics:
    """The response shape of one request's speculation statistics (vLLM's, see
    `SpeculativeDecodingMetrics`). Position i's acceptance counts the steps that accepted
    more than i drafts: acceptance stops at the first rejected draft, so a step that
    accepted j drafts accepted positions 0..j-1, as vLLM's per-position counter counts."""
    histogram = list(stats.acceptance_histogram or [])
    spec_tokens = max(len(histogram) - 1, 0)
    per_position = [sum(histogram[i + 1 :]) for i in range(spec_tokens)]
    drafted = stats.num_draft_tokens
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=stats.mean_acceptance_length,
        draft_acceptance_rate=acceptance_rate(stats.num_accepted_tokens, drafted),
        acceptance_histogram=histogram,
        num_spec_steps=stats.num_drafts,
        num_accepted_draft_tokens=stats.num_accepted_tokens,
        num_draft_tokens=drafted,
        num_spec_tokens=spec_tokens,
        acceptance_per_position=per_position,
    )


def openai_finish_reason(reason: FinishReason) -> str | None:
    """OpenAI's name for a wire finish reason; None for `error`."""
    return _OPENAI_FINISH.get(reason)


@dataclass(frozen=True)
class Alternative:
    """One candidate token at a position: its text, raw bytes and log-probability."""

    token: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token at one position and the top alternatives there."""

    sampled: Alternative
    top: list[Alternative]


@dataclass(frozen=True)
class RankedAlternative:
    """One entry of a prompt position's logprobs: the token, its text and logprob, and
    its rank in the model's distribution."""

    token_id: int
    alternative: Alternative
    rank: int


@dataclass(frozen=True)
class PromptPosition:
    """The logprobs of one prompt token (vLLM's `prompt_logprobs` entry): `ranked` is
    None at the first position, which nothing predicts; else the prompt's own token first,
    then the top alternatives."""

    token_id: int
    text: str
    ranked: list[RankedAlternative] | None

    @property
    def logprob(self) -> float | None:
        return self.ranked[0].alternative.logprob if self.ranked else None


@dataclass
class TextDelta:
    """What one batch of engine outputs adds to the response."""

    text: str = ""
    index: int = 0  # the choice this delta belongs to (`n` > 1: 0..n-1)
    token_count: int = 0  # tokens the engine produced in this batch (hidden ones included)
    # The visible tokens of this batch (a final EOS/stop token excluded): parsers of the
    # chat output (`chat_output.py`) look for marker tokens in them.
    token_ids: list[int] = field(default_factory=list)
    # Every token id of this batch as the engine produced it, a final EOS/stop token
    # included (vLLM's `token_ids`); filled only when the request asked
    # (`return_token_ids`).
    generated_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    # The prompt's logprobs (`prompt_logprobs`, or completions' `echo` with `logprobs`),
    # on the delta of the output(s) that carried them.
    prompt_logprobs: list[PromptPosition] | None = None
    finish_reason: str | None = None  # OpenAI name, set on the last delta
    error: str | None = None  # the engine failed the request

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class _Counts:
    completion_tokens: int = 0
    engine_usage: Usage | None = None
    spec_stats: SpecDecodeStats | None = None
    stop_reason: str | int | None = None


class Postprocessor:
    """Per-request state from engine outputs to text deltas."""

    def __init__(
        self,
        plan: OutputPlan,
        prompt_ids: Sequence[int],
        decode: DecodeFn,
        token_texts: TokenTexts | None = None,
        report_spec_stats: bool = False,
    ) -> None:
        """`report_spec_stats`: the response carries the engine's speculation statistics
        (`metrics()`), asked for by the request or for all requests by the frontend."""
        self._plan = plan
        self._report_spec_stats = report_spec_stats
        self._prompt_tokens = len(prompt_ids)
        self._prompt_ids = prompt_ids  # read only for the prompt's logprobs
        self._prompt_position = 0  # the next prompt position whose logprobs arrive
        self._detok = IncrementalDetokenizer(decode, prompt_ids)
        self._stops = StopStringMatcher(plan.stop_strings, plan.include_stop_str)
        self._texts = token_texts
        self._counts = _Counts()
        self.finished = False

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        return self._counts.spec_stats

    def metrics(self) -> PerRequestMetrics | None:
        """The response's `metrics` field: the request's speculation statistics when they
        were asked for and the engine sent them (a worker that does not speculate sends
        none), else None (the field is left out)."""
        stats = self._counts.spec_stats
        if not self._report_spec_stats or stats is None:
            return None
        return PerRequestMetrics(speculative_decoding=speculative_decoding_metrics(stats))

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string or stop token id that ended the response, if any."""
        return self._counts.stop_reason

    def usage(self) -> Usage:
        """Token counts. The prompt count is the frontend's own (it tokenized the prompt);
        the completion count is the engine's when it sent one (it also counts tokens the
        frontend never saw, e.g. after a stop string), else the tokens received."""
        counts = self._counts
        completion = counts.completion_tokens
        details = None
        if counts.engine_usage is not None:
            completion = max(completion, counts.engine_usage.completion_tokens)
            details = counts.engine_usage.prompt_tokens_details
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=completion,
            total_tokens=self._prompt_tokens + completion,
            prompt_tokens_details=details,
        )

    def process(self, outputs: Sequence[LLMEngineOutput]) -> TextDelta:
        """Fold a batch of engine outputs into one delta. Outputs after the end of the
        response (a stop string matched, or a finish reason arrived) are ignored."""
        delta = TextDelta()
        parts: list[str] = []
        if self._plan.prompt_logprobs is not None:
            self._add_prompt_logprobs(outputs, delta)
        if self._plan.stop_strings or self._plan.logprobs is not None:
            # Per output: a stop string ends the response at the output that completed
            # it (later tokens are not counted), and logprobs are per token anyway.
            for output in outputs:
                if self.finished:
                    break
                self._step(output, delta, parts)
        else:
            self._fold_plain_runs(outputs, delta, parts)
        delta.text = "".join(parts)
        return delta

    def _fold_plain_runs(
        self, outputs: Sequence[LLMEngineOutput], delta: TextDelta, parts: list[str]
    ) -> None:
        """Outputs that neither finish nor fail only add tokens: a run of them is
        detokenized in one call (two decodes through the tokenizer for the whole run,
        not per output), which is what a burst of engine steps that queued up costs."""
        run: list[int] = []
        for output in outputs:
            if self.finished:
                break
            if output.finish_reason is None and output.error is None:
                run.extend(output.token_ids)
                continue
            if run:
                self._add_tokens(run, delta, parts)
                run = []
            self._step(output, delta, parts)
        if run and not self.finished:
            self._add_tokens(run, delta, parts)

    def _add_tokens(self, ids: list[int], delta: TextDelta, parts: list[str]) -> None:
        """Tokens of outputs that neither finish nor fail, with no stop strings to watch."""
        self._counts.completion_tokens += len(ids)
        delta.token_count += len(ids)
        delta.token_ids.extend(ids)
        if self._plan.return_token_ids:
            delta.generated_ids.extend(ids)
        parts.append(self._detok.add(ids))

    def end_of_stream(self) -> TextDelta:
        """The engine's stream ended without a finish reason (it should not): release
        held text and report the response as aborted."""
        if self.finished:
            return TextDelta()
        self.finished = True
        text, _ = self._stops.feed(self._detok.flush())
        return TextDelta(text=text + self._stops.flush(), finish_reason="abort")

    # ------------------------------------------------------------------ internals

    def _step(self, output: LLMEngineOutput, delta: TextDelta, parts: list[str]) -> None:
        """One output; with stop strings to watch, one token at a time (`one_token_outputs`),
        so a stop string ends the response at the token that completed it."""
        if (
            self._stops.active
            and len(output.token_ids) > 1
            and output.error is None
            and output.finish_reason is not FinishReason.ERROR
        ):
            for piece in one_token_outputs(output):
                self._step_output(piece, delta, parts)
                if self.finished:
                    return
            return
        self._step_output(output, delta, parts)

    def _step_output(self, output: LLMEngineOutput, delta: TextDelta, parts: list[str]) -> None:
        ids = output.token_ids
        self._counts.completion_tokens += len(ids)
        delta.token_count += len(ids)
        visible = self._visible_ids(output)
        delta.token_ids.extend(visible)
        if self._plan.return_token_ids:
            delta.generated_ids.extend(ids)
        if self._plan.logprobs is not None and output.log_probs:
            # Every token's, the hidden final EOS or stop token included (vLLM's).
            self._add_logprobs(delta, output.log_probs)
        if output.error is not None or output.finish_reason is FinishReason.ERROR:
            self.finished = True
            delta.error = output.error or "the engine failed the request"
            return
        text = self._detok.add(visible)
        if output.finish_reason is not None:
            text += self._detok.flush()
        emitted, matched = self._stops.feed(text)
        parts.append(emitted)
        if matched is not None:
            self._finish(delta, "stop", matched)
        elif output.finish_reason is not None:
            parts.append(self._stops.flush())
            self._record_final(output)
            reason = openai_finish_reason(output.finish_reason) or "stop"
            self._finish(delta, reason, output.stop_reason)

    def _visible_ids(self, output: LLMEngineOutput) -> list[int]:
        """Token ids whose text belongs in the response: a final EOS or stop token is
        dropped, as OpenAI and vLLM leave it out of the text."""
        ids = output.token_ids
        if (
            ids
            and output.finish_reason in (FinishReason.EOS, FinishReason.STOP)
            and ids[-1] in self._plan.hidden_stop_ids
        ):
            return ids[:-1]
        return ids

    def _record_final(self, output: LLMEngineOutput) -> None:
        usage = output.completion_usage
        if usage is not None:
            details = usage.prompt_tokens_details
            self._counts.engine_usage = Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                prompt_tokens_details=(
                    PromptTokensDetails(cached_tokens=details.cached_tokens) if details else None
                ),
            )
        self._counts.spec_stats = output.spec_decode_stats

    def _finish(self, delta: TextDelta, reason: str, stop_reason: str | int | None) -> None:
        self.finished = True
        delta.finish_reason = reason
        self._counts.stop_reason = stop_reason

    def _add_logprobs(self, delta: TextDelta, entries: Sequence[TokenLogprob]) -> None:
        if self._texts is None:
            return
        wanted = self._plan.logprobs or 0
        chosen = self._plan.logprob_token_ids
        items = delta.logprobs if delta.logprobs is not None else []
        for entry in entries:
            sampled = self._alternative(entry.token_id, entry.logprob)
            if chosen:  # vLLM's order: the sampled token, then the ids as asked
                order = {t: i for i, t in enumerate(dict.fromkeys((entry.token_id, *chosen)))}
                top = sorted(entry.top or (), key=lambda t: order.get(t.token_id, len(order)))
            else:
                top = sorted(entry.top or (), key=lambda t: -t.logprob)[:wanted]
            items.append(
                TokenLogprobs(sampled, [self._alternative(t.token_id, t.logprob) for t in top])
            )
        delta.logprobs = items

    def _add_prompt_logprobs(self, outputs: Sequence[LLMEngineOutput], delta: TextDelta) -> None:
        """The prompt positions these outputs carry, each named by its prompt token."""
        if self._texts is None:
            return
        for output in outputs:
            for entry in output.prompt_logprobs or ():
                position = self._prompt_position
                self._prompt_position += 1
                if position >= len(self._prompt_ids):
                    break  # a misbehaving worker sent more positions than the prompt has
                token_id = self._prompt_ids[position]
                ranked = None
                if entry is not None:
                    ranked = [
                        RankedAlternative(
                            e.token_id, self._alternative(e.token_id, e.logprob), e.rank
                        )
                        for e in entry
                    ]
                if delta.prompt_logprobs is None:
                    delta.prompt_logprobs = []
                text = self._alternative(token_id, 0.0).token
                delta.prompt_logprobs.append(PromptPosition(token_id, text, ranked))

    def _alternative(self, token_id: int, logprob: float) -> Alternative:
        """One logprob entry; named `token_id:N` when the request asked for ids
        (`return_tokens_as_token_ids`, for tokens whose text is not valid UTF-8 alone)."""
        assert self._texts is not None
        text, data = self._texts.get(token_id)
        if self._plan.tokens_as_ids:
            text = f"token_id:{token_id}"
        return Alternative(text, data, logprob)
