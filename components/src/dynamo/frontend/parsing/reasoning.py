"""`--reasoning-parser NAME`: a reasoning model's thinking split from its answer.

Reasoning models write their chain of thought before the answer, delimited by markers
that differ per family (`<think>` ... `</think>` for DeepSeek-R1 and Qwen3). vLLM ships
one parser per family (`vllm.reasoning.ReasoningParserManager`, the names `vllm serve
--reasoning-parser` takes); `ReasoningSplitter` drives one of them delta by delta, the
way vLLM's own serving layer does, and returns the thinking as
`ChatPieces.reasoning` (the response's `reasoning_content`) and the rest as content,
which it passes on to the inner parser (tool calls) so reasoning never reaches it.

Three things the serving layer of vLLM does around a parser are done here too:

* the prompt decides the starting state: a prompt whose reasoning is already closed
  (Qwen3's template with `enable_thinking: false` writes `<think></think>` into it)
  starts in content, and an engine-based parser is told the prompt so it can start
  inside an open `<think>` the template wrote;
* engine-based parsers (`engine_based_streaming`, e.g. `qwen3`) hold text back and
  release it with `finish_streaming()`, at the end of reasoning and of the response;
* `include_reasoning: false` (a vLLM request field) drops the reasoning.

One thing differs on purpose: a delta is cut at the marker tokens before it reaches
the parser, so each marker arrives alone, as it does in vLLM's one-token-per-step
streaming. Our deltas are engine batches (several tokens with speculative decoding),
and `BaseThinkingReasoningParser` (deepseek_r1) puts the `<think>` tag itself into the
reasoning when the tag shares a delta with other tokens.

`vllm.reasoning` takes seconds to import, so it is imported only when a reasoning
parser is configured.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo.frontend.openai.errors import OpenAIError
from dynamo.frontend.parsing.chat_output import ChatOutputParser, ChatPieces

if TYPE_CHECKING:
    from vllm.reasoning import ReasoningParser

log = logging.getLogger(__name__)


class UnknownReasoningParser(ValueError):
    """`--reasoning-parser` names no parser vLLM registers."""


def reasoning_parser_names() -> list[str]:
    """The names `--reasoning-parser` accepts: vLLM's registered reasoning parsers."""
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.list_registered()


def check_reasoning_parser_name(name: str) -> str:
    """`name` if vLLM registers a reasoning parser by that name (its module is imported
    now, so a broken one fails at start-up); UnknownReasoningParser listing the valid
    names otherwise."""
    from vllm.reasoning import ReasoningParserManager

    names = reasoning_parser_names()
    if name not in names:
        raise UnknownReasoningParser(
            f"unknown reasoning parser {name!r}; valid names: {', '.join(names)}"
        )
    ReasoningParserManager.get_reasoning_parser(name)
    return name


class _CachedVocabTokenizer:
    """The model's tokenizer as vLLM's parsers use it, with `get_vocab()` built once.

    vLLM's parsers call `get_vocab()` in their constructor (a dict of the whole
    vocabulary: ~30 ms for 49k tokens), and a parser is stateful, so one is built per
    response. The other methods the parsers of `vllm.reasoning` / `vllm.parser` call go
    to the tokenizer unchanged; a parser that needs more (Mistral's own tokenizer
    object) fails to build with AttributeError, reported as `reasoning_parser_unusable`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._vocab: dict[str, int] = tokenizer.get_vocab()
        self.all_special_tokens: list[str] = list(tokenizer.all_special_tokens)
        self.all_special_ids: list[int] = list(tokenizer.all_special_ids)

    def get_vocab(self) -> dict[str, int]:
        return self._vocab

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return self._tokenizer.encode(text, *args, **kwargs)

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> str:
        return self._tokenizer.decode(token_ids, *args, **kwargs)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        return self._tokenizer.convert_tokens_to_ids(tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self._tokenizer.convert_ids_to_tokens(ids)

    def __len__(self) -> int:
        return len(self._tokenizer)


_reported_unusable: set[str] = set()
_views: weakref.WeakKeyDictionary[Any, _CachedVocabTokenizer] = weakref.WeakKeyDictionary()


def _view(tokenizer: Any) -> _CachedVocabTokenizer:
    view = _views.get(tokenizer)
    if view is None:
        view = _views[tokenizer] = _CachedVocabTokenizer(tokenizer)
    return view


def reasoning_parser_unusable(name: str, exc: Exception) -> OpenAIError:
    """A configured parser that cannot work with the model's tokenizer (deepseek_r1 on a
    tokenizer without `<think>`): a server misconfiguration, not the client's fault."""
    return OpenAIError(
        500,
        f"The reasoning parser `{name}` (--reasoning-parser) does not work with this "
        f"model's tokenizer: {exc}",
        type="internal_error",
        code="reasoning_parser_error",
    )


def reasoning_splitter(
    name: str,
    tokenizer: Any,
    inner: ChatOutputParser,
    *,
    include_reasoning: bool = True,
    prompt_token_ids: Sequence[int] | None = None,
) -> ReasoningSplitter:
    """A `ReasoningSplitter` over a new vLLM parser `name` for one response.

    Raises `OpenAIError` (500) when the parser rejects the model's tokenizer."""
    from vllm.reasoning import ReasoningParserManager

    parser_cls = ReasoningParserManager.get_reasoning_parser(name)
    view = _view(tokenizer)
    try:
        parser = parser_cls(view)
    except (RuntimeError, ValueError, KeyError, AttributeError) as exc:
        if name not in _reported_unusable:  # once: every request of the model fails alike
            _reported_unusable.add(name)
            log.error("reasoning parser %s cannot be used with a served model: %s", name, exc)
        raise reasoning_parser_unusable(name, exc) from exc
    return ReasoningSplitter(
        parser,
        inner,
        vocab=view.get_vocab(),
        include_reasoning=include_reasoning,
        prompt_token_ids=prompt_token_ids,
    )


@dataclass(frozen=True)
class Marker:
    """A reasoning tag that is one token: its id and its text."""

    token_id: int
    text: str


def _markers(parser: ReasoningParser, vocab: dict[str, int]) -> tuple[Marker, ...]:
    """The parser's start/end markers that are single tokens of this vocabulary."""
    found = []
    for text in (parser.reasoning_start_str, parser.reasoning_end_str):
        if text and text in vocab:
            found.append(Marker(vocab[text], text))
    return tuple(found)


def cut_at_markers(
    text: str, token_ids: Sequence[int], markers: Sequence[Marker]
) -> list[tuple[str, list[int]]]:
    """`(text, ids)` in pieces, each marker token alone in its own piece.

    The text before a marker goes with the ids before it. A marker id whose text is not
    found where expected (held back by the detokenizer, or hidden by
    `skip_special_tokens`) stops the cutting: the rest stays one piece."""
    by_id = {m.token_id: m.text for m in markers}
    pieces: list[tuple[str, list[int]]] = []
    cursor = 0  # in text
    start = 0  # in token_ids
    for index, token_id in enumerate(token_ids):
        marker = by_id.get(token_id)
        if marker is None:
            continue
        at = text.find(marker, cursor)
        if at < 0:
            break
        if at > cursor or index > start:
            pieces.append((text[cursor:at], list(token_ids[start:index])))
        pieces.append((marker, [token_id]))
        cursor, start = at + len(marker), index + 1
    if cursor < len(text) or start < len(token_ids):
        pieces.append((text[cursor:], list(token_ids[start:])))
    return pieces


class ReasoningSplitter:
    """A `ChatOutputParser` that takes the reasoning out with a vLLM reasoning parser and
    hands the content to `inner` (plain text, or a tool-call parser).

    Streaming and non-streaming responses both feed it delta by delta
    (`ChatFormatter`), so they split the same text the same way."""

    def __init__(
        self,
        parser: ReasoningParser,
        inner: ChatOutputParser,
        *,
        vocab: dict[str, int],
        include_reasoning: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._parser = parser
        self._inner = inner
        self._include_reasoning = include_reasoning
        self._engine_based = parser.engine_based_streaming
        self._markers = _markers(parser, vocab)
        self._text = ""  # all text fed so far (vLLM's previous_text)
        self._ids: list[int] = []
        self._ended = False  # reasoning is over: the rest is content
        if prompt_token_ids is not None:
            self._start_from_prompt(prompt_token_ids)

    def _start_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """As vLLM does: a prompt whose reasoning is closed starts in content; one left
        inside reasoning lets an engine-based parser set its state."""
        ids = list(prompt_token_ids)
        if self._parser.is_reasoning_end(ids):
            self._ended = True
        else:
            self._parser.adjust_initial_state_from_prompt(ids)

    @property
    def made_tool_calls(self) -> bool:
        return self._inner.made_tool_calls

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        pieces = ChatPieces()
        if self._ended:
            pieces.extend(self._inner.feed(text, token_ids))
            return pieces
        for part_text, part_ids in cut_at_markers(text, token_ids, self._markers):
            if self._ended:
                pieces.extend(self._inner.feed(part_text, part_ids))
            else:
                pieces.extend(self._step(part_text, part_ids))
        return pieces

    def finish(self) -> ChatPieces:
        pieces = ChatPieces()
        if not self._ended and self._engine_based:
            flushed = self._parser.finish_streaming()
            if flushed is not None:
                pieces.reasoning = self._kept(flushed.reasoning or "")
                if flushed.content:
                    pieces.extend(self._inner.feed(flushed.content, []))
        pieces.extend(self._inner.finish())
        return pieces

    def _step(self, text: str, token_ids: list[int]) -> ChatPieces:
        """One piece of a delta, still inside reasoning, through the vLLM parser."""
        previous_text, previous_ids = self._text, self._ids
        self._text, self._ids = previous_text + text, previous_ids + token_ids
        message = self._parser.extract_reasoning_streaming(
            previous_text, self._text, text, previous_ids, self._ids, token_ids
        )
        reasoning = (message.reasoning if message else None) or ""
        content = (message.content if message else None) or ""
        content_ids = token_ids
        if self._reasoning_ended(token_ids):
            self._ended = True
            content_ids = self._parser.extract_content_ids(token_ids)
            if self._engine_based:  # it holds back text after the end marker
                flushed = self._parser.finish_streaming()
                content += (flushed.content if flushed else None) or ""
        pieces = ChatPieces(reasoning=self._kept(reasoning))
        if content:
            pieces.extend(self._inner.feed(content, content_ids))
        return pieces

    def _reasoning_ended(self, token_ids: list[int]) -> bool:
        if self._engine_based:
            return self._parser.has_engine_confirmed_reasoning_end()
        return self._parser.is_reasoning_end_streaming(self._ids, token_ids)

    def _kept(self, reasoning: str) -> str:
        return reasoning if self._include_reasoning else ""
