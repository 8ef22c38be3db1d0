"""The `/v1/completions` formatter: `text_completion` objects from `TextDelta`s, with
vLLM's echo of the prompt, completion-style logprobs and their text offsets.

Separate from the chat formatter because the two APIs share no response shape: what they
do share lives in `formatters.py`.
"""

from __future__ import annotations

from typing import Any

from dynamo.frontend.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PerRequestMetrics,
    Usage,
)
from dynamo.frontend.postprocess.formatters import (
    ChoiceAccumulator,
    ChoicesFormatter,
    encode_json,
    prompt_logprobs_field,
    sse_event,
)
from dynamo.frontend.postprocess.postprocessor import TextDelta, TokenLogprobs


class _CompletionChoice:
    """One choice of a completion response: its accumulated text and its echo/offsets."""

    def __init__(self, echo_text: str | None) -> None:
        self.acc = ChoiceAccumulator()
        self.echo_pending = echo_text is not None
        self.offset = len(echo_text or "")  # text_offset of the next token
        self.prompt_ids_sent = False  # `return_token_ids`: on the first chunk only


class CompletionFormatter(ChoicesFormatter[_CompletionChoice]):
    """`/v1/completions` objects (`text_completion`). With `n` > 1 each choice (the
    delta's `index`) keeps its own text, echo and logprob offsets."""

    chunk_type = Completion

    def events(self, delta: TextDelta) -> bytes:
        state = self._choice(delta.index)
        self._prompt.extend(delta.prompt_logprobs or ())
        echo_items = self._echo_logprobs() if state.echo_pending else None
        text = self._take_echo(state) + delta.text
        if (
            not text
            and delta.finish_reason is None
            and not delta.logprobs
            and not delta.generated_ids
        ):
            return b""
        choice = CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=self._logprobs(state, delta.logprobs, echo_items),
            finish_reason=delta.finish_reason,
            **self._token_ids(state, delta.generated_ids),
        )
        return sse_event(self._response(Completion, [choice]))

    def add(self, delta: TextDelta) -> None:
        self._choice(delta.index).acc.add(delta)
        self._prompt.extend(delta.prompt_logprobs or ())

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        choices = [self._body_choice(index) for index in self._body_indices()]
        return encode_json(self._response(Completion, choices, usage, metrics))

    def _body_choice(self, index: int) -> CompletionChoice:
        state = self._choice(index)
        acc = state.acc
        echo_items = self._echo_logprobs() if state.echo_pending else None
        text = self._take_echo(state) + acc.text
        logprobs = None
        if self.plan.logprobs is not None:
            logprobs = self._logprobs(state, acc.logprobs, echo_items)
        prompt_logprobs = None
        if self.plan.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_field(self._prompt)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=acc.finish_reason,
            prompt_logprobs=prompt_logprobs,
            **self._token_ids(state, acc.generated_ids),
        )

    def _echo_logprobs(self) -> CompletionLogprobs | None:
        """The echoed prompt's part of `logprobs` (vLLM reports one entry per prompt
        token before the completion's; the first has no logprob), when both were asked
        for and the prompt's logprobs have arrived."""
        if self.plan.logprobs is None or not self._prompt:
            return None
        offsets, offset = [], 0
        for position in self._prompt:
            offsets.append(offset)
            offset += len(position.text)
        return CompletionLogprobs(
            tokens=[p.text for p in self._prompt],
            token_logprobs=[p.logprob for p in self._prompt],
            top_logprobs=[
                None
                if p.ranked is None
                else {e.alternative.token: e.alternative.logprob for e in p.ranked}
                for p in self._prompt
            ],
            text_offset=offsets,
        )

    def _token_ids(self, state: _CompletionChoice, generated: list[int]) -> dict[str, Any]:
        """`prompt_token_ids` (once per choice) and `token_ids`, with `return_token_ids`."""
        if not self.plan.return_token_ids:
            return {}
        fields: dict[str, Any] = {"token_ids": generated}
        if not state.prompt_ids_sent:
            state.prompt_ids_sent = True
            fields["prompt_token_ids"] = self.plan.prompt_token_ids
        return fields

    def _new_choice(self, index: int) -> _CompletionChoice:
        return _CompletionChoice(self.plan.echo_text)

    def _take_echo(self, state: _CompletionChoice) -> str:
        """The echoed prompt, once per choice (each choice starts with it)."""
        if not state.echo_pending:
            return ""
        state.echo_pending = False
        return self.plan.echo_text or ""

    def _logprobs(
        self,
        state: _CompletionChoice,
        items: list[TokenLogprobs] | None,
        echoed: CompletionLogprobs | None = None,
    ) -> CompletionLogprobs | None:
        """The generated tokens' logprobs, after the echoed prompt's when there are any."""
        if self.plan.logprobs is None or (items is None and echoed is None):
            return None
        items = items or []
        offsets = []
        for item in items:
            offsets.append(state.offset)
            state.offset += len(item.sampled.token)
        generated = CompletionLogprobs(
            tokens=[i.sampled.token for i in items],
            token_logprobs=[i.sampled.logprob for i in items],
            top_logprobs=[{alt.token: alt.logprob for alt in i.top} for i in items],
            text_offset=offsets,
        )
        if echoed is None:
            return generated
        return CompletionLogprobs(
            tokens=echoed.tokens + generated.tokens,
            token_logprobs=echoed.token_logprobs + generated.token_logprobs,
            top_logprobs=(echoed.top_logprobs or []) + (generated.top_logprobs or []),
            text_offset=echoed.text_offset + generated.text_offset,
        )
