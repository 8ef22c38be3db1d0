"""`--reasoning-parser`: vLLM's reasoning parsers driven delta by delta
(`dynamo.frontend.parsing.reasoning.ReasoningSplitter`) on canned model text.

The tokenizer is the tiny test tokenizer with `<think>` and `</think>` added as single
(non-special) tokens, as DeepSeek-R1's and Qwen3's tokenizers have them, so the text
of a delta shows the markers and its token ids contain their ids."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from frontend_support import MODEL, Frontend, Script, chat_request, openai_client
from http_support import running_frontend

from dynamo.frontend.__main__ import build_parser, config_from_args, main
from dynamo.frontend.openai.errors import OpenAIError
from dynamo.frontend.parsing.chat_output import ChatPieces, PlainText
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions, chat_output_parser
from dynamo.frontend.parsing.reasoning import (
    ReasoningSplitter,
    check_reasoning_parser_name,
    reasoning_splitter,
)
from dynamo.frontend.preprocess.tokenizer_setup import load_tokenizer
from dynamo.runtime.cli import ConfigError
from dynamo.testing.tokenizers import build_tiny_tokenizer

PARSERS = ("deepseek_r1", "qwen3")
"""Both think with `<think>`...`</think>`; deepseek_r1 is vLLM's token-pair parser
(`BaseThinkingReasoningParser`), qwen3 its engine-based one (holds text back)."""

STEPS = ((1,), (3,), (2, 5), (1000,))
"""Tokens per delta, cycled: one at a time as vLLM streams, batches as speculative
decoding gives them, and the whole response in one delta."""


def _with_think_tokens(directory: Path) -> Any:
    from tokenizers import AddedToken

    tokenizer = load_tokenizer(build_tiny_tokenizer(directory))
    tokenizer.add_tokens(
        [AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")]
    )
    return tokenizer


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _with_think_tokens(tmp_path_factory.mktemp("think-tokenizer"))


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """No `<think>` token: the tags are spelled with several ordinary tokens."""
    return load_tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("plain-tokenizer")))


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def deltas(tokenizer: Any, text: str, steps: Sequence[int]) -> list[tuple[str, list[int]]]:
    """`text` as the frontend's detokenizer hands it over: (text, ids) per engine batch."""
    ids = ids_of(tokenizer, text)
    out: list[tuple[str, list[int]]] = []
    sent, step, shown = 0, 0, ""
    while sent < len(ids):
        chunk = ids[sent : sent + steps[step % len(steps)]]
        sent, step = sent + len(chunk), step + 1
        decoded = tokenizer.decode(ids[:sent])
        out.append((decoded[len(shown) :], chunk))
        shown = decoded
    assert shown == text, "the test text must round-trip through the tokenizer"
    return out


def split(parser: Any, parts: Sequence[tuple[str, Sequence[int]]]) -> ChatPieces:
    """Everything `parser` returns for `parts` then `finish()`, merged."""
    pieces = ChatPieces()
    for text, ids in parts:
        pieces.extend(parser.feed(text, ids))
    pieces.extend(parser.finish())
    return pieces


class RecordingInner:
    """An inner (tool-call) parser that records what reaches it and passes it as content."""

    def __init__(self) -> None:
        self.fed: list[tuple[str, list[int]]] = []
        self.finished = 0

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        self.fed.append((text, list(token_ids)))
        return ChatPieces(content=text.upper())

    def finish(self) -> ChatPieces:
        self.finished += 1
        return ChatPieces()

    @property
    def made_tool_calls(self) -> bool:
        return True


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize(
    "text,reasoning,content",
    [
        ("<think>Hello there</think>The answer", "Hello there", "The answer"),
        # The template opened <think> in the prompt: the output starts inside reasoning.
        ("Hello there</think>The answer", "Hello there", "The answer"),
        # Cut off (max_tokens) before the end tag: all of it is reasoning.
        ("<think>Hello there, friend.", "Hello there, friend.", ""),
        ("<think></think>The answer", "", "The answer"),
    ],
)
def test_reasoning_then_content_in_any_batching(
    think_tokenizer: Any, name: str, steps: Sequence[int], text: str, reasoning: str, content: str
) -> None:
    splitter = reasoning_splitter(name, think_tokenizer, PlainText())
    pieces = split(splitter, deltas(think_tokenizer, text, steps))
    assert (pieces.reasoning, pieces.content) == (reasoning, content)
    assert not splitter.made_tool_calls


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize(
    "text",
    ["<think>Hello there</think>The answer", "Hello there</think>The answer", "<think>Hello"],
)
def test_the_split_agrees_with_vllms_non_streaming_extraction(
    think_tokenizer: Any, name: str, text: str
) -> None:
    """vLLM's `extract_reasoning` (what `vllm serve` uses for a non-streaming body) on the
    whole text gives the split the delta-by-delta path gives here for both modes."""
    from vllm.reasoning import ReasoningParserManager

    vllm_parser = ReasoningParserManager.get_reasoning_parser(name)(think_tokenizer)
    expected_reasoning, expected_content = vllm_parser.extract_reasoning(text, None)
    for steps in STEPS:
        pieces = split(
            reasoning_splitter(name, think_tokenizer, PlainText()),
            deltas(think_tokenizer, text, steps),
        )
        assert (pieces.reasoning, pieces.content) == (
            expected_reasoning or "",
            expected_content or "",
        ), steps


def test_a_marker_sharing_a_delta_with_text_stays_out_of_the_reasoning(
    think_tokenizer: Any,
) -> None:
    """vLLM's token-pair parser (deepseek_r1) puts `<think>` into the reasoning when the
    tag arrives in a delta with other tokens (an engine batch, speculative decoding): the
    splitter cuts each delta at the marker tokens first."""
    think = ids_of(think_tokenizer, "<think>")
    hello = ids_of(think_tokenizer, "Hello there")
    end = ids_of(think_tokenizer, "</think>The")
    splitter = reasoning_splitter("deepseek_r1", think_tokenizer, PlainText())
    pieces = split(splitter, [("<think>Hello there", think + hello), ("</think>The", end)])
    assert (pieces.reasoning, pieces.content) == ("Hello there", "The")


def test_a_tag_split_across_deltas_in_text(plain_tokenizer: Any) -> None:
    """With no `<think>` token the tag can be cut anywhere between deltas; qwen3's
    engine-based parser holds the partial tag back until it knows."""
    parts = ["<th", "ink>Hello", " there</th", "ink>The answer"]
    splitter = reasoning_splitter("qwen3", plain_tokenizer, PlainText())
    pieces = split(splitter, [(p, ids_of(plain_tokenizer, p)) for p in parts])
    assert (pieces.reasoning, pieces.content) == ("Hello there", "The answer")


@pytest.mark.parametrize("name", PARSERS)
def test_include_reasoning_false_drops_the_reasoning(think_tokenizer: Any, name: str) -> None:
    splitter = reasoning_splitter(name, think_tokenizer, PlainText(), include_reasoning=False)
    pieces = split(splitter, deltas(think_tokenizer, "<think>Hello there</think>The answer", (2,)))
    assert (pieces.reasoning, pieces.content) == ("", "The answer")


@pytest.mark.parametrize("name", PARSERS)
def test_a_prompt_that_closed_reasoning_starts_in_content(think_tokenizer: Any, name: str) -> None:
    """Qwen3's template with `enable_thinking: false` ends the prompt with an empty
    `<think></think>`: the model's text is all answer (vLLM checks the prompt the same
    way). A prompt that leaves `<think>` open keeps the reasoning."""
    closed = ids_of(think_tokenizer, "Hi<think></think>")
    text = "Hello there"
    pieces = split(
        reasoning_splitter(name, think_tokenizer, PlainText(), prompt_token_ids=closed),
        deltas(think_tokenizer, text, (1,)),
    )
    assert (pieces.reasoning, pieces.content) == ("", text)
    opened = ids_of(think_tokenizer, "Hi<think>")
    pieces = split(
        reasoning_splitter(name, think_tokenizer, PlainText(), prompt_token_ids=opened),
        deltas(think_tokenizer, text, (1,)),
    )
    assert (pieces.reasoning, pieces.content) == (text, "")


@pytest.mark.parametrize("name", PARSERS)
def test_only_the_content_reaches_the_inner_parser(think_tokenizer: Any, name: str) -> None:
    inner = RecordingInner()
    splitter = reasoning_splitter(name, think_tokenizer, inner)
    pieces = split(splitter, deltas(think_tokenizer, "<think>Hello</think>The answer", (1,)))
    assert pieces.reasoning == "Hello"
    assert "".join(text for text, _ in inner.fed) == "The answer"
    assert pieces.content == "THE ANSWER", "the inner parser's pieces are the content"
    assert inner.finished == 1
    assert splitter.made_tool_calls, "the inner parser decides the finish reason"
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    assert all(end not in ids for _, ids in inner.fed), "marker ids never reach the tools"


def test_a_parser_that_does_not_fit_the_tokenizer_is_a_clear_500(plain_tokenizer: Any) -> None:
    """deepseek_r1 needs `<think>` as a token: a misconfigured server, said as such."""
    with pytest.raises(OpenAIError) as info:
        reasoning_splitter("deepseek_r1", plain_tokenizer, PlainText())
    assert info.value.status == 500
    assert info.value.code == "reasoning_parser_error"
    assert "deepseek_r1" in info.value.message


def test_the_factory_puts_the_reasoning_parser_outermost(think_tokenizer: Any) -> None:
    options = ChatParsingOptions(reasoning_parser="deepseek_r1")
    parser = chat_output_parser(chat_request(), options, think_tokenizer)
    assert isinstance(parser, ReasoningSplitter)
    pieces = split(parser, deltas(think_tokenizer, "<think>Hello</think>The answer", (1,)))
    assert (pieces.reasoning, pieces.content) == ("Hello", "The answer")
    quiet = chat_output_parser(chat_request(include_reasoning=False), options, think_tokenizer)
    pieces = split(quiet, deltas(think_tokenizer, "<think>Hello</think>The answer", (1,)))
    assert (pieces.reasoning, pieces.content) == ("", "The answer")
    assert isinstance(chat_output_parser(chat_request(), ChatParsingOptions(), None), PlainText)


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_from_args(build_parser().parse_args(["--reasoning-parser", "qwen3"]))
    assert config.chat_parsing.reasoning_parser == "qwen3"
    monkeypatch.setenv("DYN_REASONING_PARSER", "deepseek_r1")
    config = config_from_args(build_parser().parse_args([]))
    assert config.chat_parsing.reasoning_parser == "deepseek_r1"
    monkeypatch.delenv("DYN_REASONING_PARSER")
    assert config_from_args(build_parser().parse_args([])).chat_parsing.reasoning_parser is None


def test_an_unknown_parser_name_is_a_start_up_error_listing_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError, match=r"valid names: .*deepseek_r1.*qwen3"):
        config_from_args(build_parser().parse_args(["--reasoning-parser", "deepseek-r1"]))
    assert main(["--reasoning-parser", "nope"]) == 2
    error = capsys.readouterr().err
    assert "--reasoning-parser" in error and "'nope'" in error and "deepseek_r1" in error
    assert check_reasoning_parser_name("deepseek_r1") == "deepseek_r1"


# --------------------------------------------------------------- through the frontend

REPLY = "<think>Hello there</think>The answer"
MESSAGES: Any = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def reasoning_frontend(think_tokenizer: Any) -> AsyncIterator[Frontend]:
    """A frontend started with `--reasoning-parser deepseek_r1` whose scripted engine
    answers `REPLY`'s token ids (the `<think>` tags are single tokens)."""
    async with running_frontend(
        think_tokenizer, chat_parsing=ChatParsingOptions(reasoning_parser="deepseek_r1")
    ) as running:
        running.engine.script = Script(reply=REPLY, steps=(2, 1), delay=0.002)
        yield running


@pytest.fixture
async def client(reasoning_frontend: Frontend) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(reasoning_frontend) as c:
        yield c


def _extra(model: Any, name: str) -> Any:
    """A vLLM extension field the `openai` client keeps in `model_extra`."""
    return (model.model_extra or {}).get(name)


async def test_reasoning_content_in_a_chat_completion(client: openai.AsyncOpenAI) -> None:
    result = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    message = result.choices[0].message
    assert _extra(message, "reasoning_content") == "Hello there"
    assert message.content == "The answer"
    assert result.choices[0].finish_reason == "stop"


async def test_reasoning_content_in_stream_deltas(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    reasoning, content, order = [], [], []
    async for chunk in stream:
        for choice in chunk.choices:
            if piece := _extra(choice.delta, "reasoning_content"):
                reasoning.append(piece)
                order.append("reasoning")
            if choice.delta.content:
                content.append(choice.delta.content)
                order.append("content")
    assert "".join(reasoning) == "Hello there"
    assert "".join(content) == "The answer"
    assert len(reasoning) > 1, "reasoning streams as it is generated"
    assert order == sorted(order, key=["reasoning", "content"].index), "thinking comes first"


async def test_include_reasoning_false_through_the_frontend(client: openai.AsyncOpenAI) -> None:
    result = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body={"include_reasoning": False}
    )
    message = result.choices[0].message
    assert _extra(message, "reasoning_content") is None
    assert message.content == "The answer"
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, extra_body={"include_reasoning": False}
    )
    text = ""
    async for chunk in stream:
        for choice in chunk.choices:
            assert _extra(choice.delta, "reasoning_content") is None
            text += choice.delta.content or ""
    assert text == "The answer"


async def test_the_rendered_prompt_sets_the_starting_state(
    client: openai.AsyncOpenAI, reasoning_frontend: Frontend
) -> None:
    """The frontend hands the parser the prompt's token ids: a prompt whose reasoning is
    already closed (as Qwen3's template writes it for `enable_thinking: false`; here the
    user message carries it) makes the whole reply content."""
    reasoning_frontend.engine.script = Script(reply="The answer", steps=(1,))
    result = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi<think></think>"}]
    )
    message = result.choices[0].message
    assert (message.content, _extra(message, "reasoning_content")) == ("The answer", None)
    opened = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi<think>"}]
    )
    message = opened.choices[0].message
    assert _extra(message, "reasoning_content") == "The answer"
    assert not message.content  # "" here; vLLM sends null


async def test_a_parser_that_does_not_fit_the_model_is_a_500_naming_it(tokenizer: Any) -> None:
    """deepseek_r1 on a model without `<think>` tokens: every chat request fails with a
    500 that names the parser (before any worker is asked), not text silently unsplit."""
    async with running_frontend(
        tokenizer, chat_parsing=ChatParsingOptions(reasoning_parser="deepseek_r1")
    ) as running:
        async with openai_client(running) as c:
            with pytest.raises(openai.InternalServerError) as info:
                await c.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert "deepseek_r1" in info.value.message
        assert info.value.code == "reasoning_parser_error"
        assert running.client.requests == [], "no worker was asked"
