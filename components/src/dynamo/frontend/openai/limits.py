"""Bounds on the work one request can ask of the frontend, checked before the work.

The body size limit (`--max-request-bytes`) caps what a request can send, not what it
costs: 8 MiB of stop strings are matched against every generated character, 8 MiB of
tiny messages make the chat template loop a million times, and a prompt far longer than
the context is tokenized in full only to be refused. These checks refuse such requests
with a 400 naming the field, before templating or tokenizing:

* `stop`: at most `MAX_STOP_STRINGS` strings (OpenAI allows 4, vLLM does not limit them;
  16 leaves room for clients that list several end markers), each at most
  `MAX_STOP_CHARS` characters (the detokenizer holds back up to that much text);
* `messages`: at most `MAX_MESSAGES`;
* a text prompt (or rendered chat) longer than the context could hold however it is
  tokenized: `context length x PromptBound.chars_per_token` characters, where
  `chars_per_token` is twice the longest token of the vocabulary (the factor covers
  normalizers that drop characters). Such a prompt is refused without tokenizing it;
* a prompt given as token ids that does not fit the context is refused before its ids
  are checked against the vocabulary;
* a non-streamed response with logprobs is held whole until it ends: at most
  `MAX_BUFFERED_LOGPROBS` logprob entries (`n x max_tokens x (1 + top alternatives)`,
  max_tokens as the context allows when not given). A stream sends each entry as it comes,
  so it has no such bound.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

from dynamo.frontend.openai.errors import OpenAIError, bad_request

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_MESSAGES = 4096
MAX_BUFFERED_LOGPROBS = 1 << 20
"""Logprob entries one non-streamed response may hold (each a token's text, bytes and
value: a few hundred bytes in memory, so about 0.3 GB at the bound). n=1 with 20
alternatives reaches it at about 50,000 tokens."""
# Characters one token can cover, at the least (also the bound for an empty vocabulary).
MIN_CHARS_PER_TOKEN = 16
# Headroom over the longest vocabulary token for normalizers that drop characters.
CHARS_PER_TOKEN_FACTOR = 2


def check_stop(stop: str | list[str] | None) -> None:
    """At most `MAX_STOP_STRINGS` stop strings of at most `MAX_STOP_CHARS` characters."""
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(
            f"`stop` has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    for i, item in enumerate(items):
        if len(item) > MAX_STOP_CHARS:
            where = "`stop`" if isinstance(stop, str) else f"`stop[{i}]`"
            raise bad_request(
                f"{where} has {len(item)} characters; at most {MAX_STOP_CHARS} are allowed",
                "stop",
            )


def check_buffered_logprobs(
    *, choices: int, max_tokens: int | None, alternatives: int | None, stream: bool
) -> None:
    """A non-streamed request's logprobs must fit `MAX_BUFFERED_LOGPROBS` entries
    (`alternatives`: None when logprobs were not asked for; `max_tokens` None: unknown,
    the worker's context decides, and nothing is refused here)."""
    if stream or alternatives is None or max_tokens is None:
        return
    entries = choices * max_tokens * (1 + alternatives)
    if entries > MAX_BUFFERED_LOGPROBS:
        raise bad_request(
            f"A non-streamed response with logprobs holds n x max_tokens x (1 + top "
            f"logprobs) = {choices} x {max_tokens} x {1 + alternatives} = {entries} entries; "
            f"at most {MAX_BUFFERED_LOGPROBS} are allowed. Stream the response, or lower "
            f"`max_tokens`, `n` or the number of top logprobs.",
            "logprobs",
        )


def check_buffered_prompt_logprobs(prompt_tokens: int, alternatives: int) -> None:
    """A response's prompt logprobs (held whole: vLLM sends them only unstreamed) must fit
    `MAX_BUFFERED_LOGPROBS` entries, `prompt tokens x (1 + alternatives)`."""
    entries = prompt_tokens * (1 + alternatives)
    if entries > MAX_BUFFERED_LOGPROBS:
        raise bad_request(
            f"The prompt's logprobs would hold prompt tokens x (1 + alternatives) = "
            f"{prompt_tokens} x {1 + alternatives} = {entries} entries; at most "
            f"{MAX_BUFFERED_LOGPROBS} are allowed. Lower `prompt_logprobs`.",
            "prompt_logprobs",
        )


def check_message_count(messages: Sized) -> None:
    if len(messages) > MAX_MESSAGES:
        raise bad_request(
            f"`messages` has {len(messages)} messages; at most {MAX_MESSAGES} are allowed",
            "messages",
        )


def context_exceeded(context_length: int, prompt_tokens: int, param: str) -> OpenAIError:
    """The 400 for a prompt that leaves no room for the completion."""
    return bad_request(
        f"This model's maximum context length is {context_length} tokens, but the prompt has "
        f"{prompt_tokens} tokens, leaving no room for the completion.",
        param,
        code="context_length_exceeded",
    )


def check_token_prompt(token_count: int, context_length: int, param: str) -> None:
    """A token-id prompt must leave room for one generated token (0: context unknown)."""
    if context_length > 0 and token_count >= context_length:
        raise context_exceeded(context_length, token_count, param)


@dataclass(frozen=True)
class PromptBound:
    """The most characters one token of this tokenizer can stand for, with headroom."""

    chars_per_token: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PromptBound:
        """Measured on the vocabulary (added tokens included). Byte-level vocabularies
        spell one byte per character, so their lengths overstate characters: safe."""
        longest = max(map(len, tokenizer.get_vocab()), default=0)
        return cls(max(MIN_CHARS_PER_TOKEN, CHARS_PER_TOKEN_FACTOR * longest))

    def max_chars(self, context_length: int) -> int | None:
        """The longest text that could fit `context_length` tokens (None: unknown)."""
        return context_length * self.chars_per_token if context_length > 0 else None

    def check_text(self, chars: int, context_length: int, param: str) -> None:
        """Refuse text that cannot fit the context, before spending time tokenizing it."""
        limit = self.max_chars(context_length)
        if limit is not None and chars > limit:
            raise bad_request(
                f"The prompt has {chars} characters; this model's context of "
                f"{context_length} tokens holds at most {limit} characters "
                f"({self.chars_per_token} per token at the most).",
                param,
                code="context_length_exceeded",
            )
