"""Which `ChatOutputParser` a chat request's output goes through.

One place decides it, from the request (`tools`, `tool_choice`) and the frontend's
flags (`--tool-call-parser`, `--reasoning-parser`), so the response formatter never
needs to know which parsers exist. The flags are checked once at start-up
(`ChatParsingOptions`); the request is checked here, before a worker is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dynamo.frontend.openai.protocol import ChatCompletionRequest
from dynamo.frontend.parsing.chat_output import ChatOutputParser, PlainText
from dynamo.frontend.parsing.reasoning import reasoning_splitter
from dynamo.frontend.parsing.tool_calls import ToolMode, tool_mode, tool_output_parser


@dataclass(frozen=True)
class ChatParsingOptions:
    """The frontend's parser flags: `--tool-call-parser` (for `tool_choice` `auto`) and
    `--reasoning-parser`; None where the flag is not given."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def chat_output_parser(
    req: ChatCompletionRequest,
    options: ChatParsingOptions,
    tokenizer: Any,
    prompt_token_ids: Sequence[int] | None = None,
) -> ChatOutputParser:
    """The parser for one choice of `req`'s response. `prompt_token_ids` (the rendered
    prompt) tells a reasoning parser whether the template already closed reasoning.

    Raises `OpenAIError` (400) when the request asks for automatic tool calls and no
    `--tool-call-parser` is configured."""
    mode = tool_mode(req, options.tool_call_parser)
    parser: ChatOutputParser = PlainText()
    if mode is not ToolMode.NONE:
        parser = tool_output_parser(req, mode, options.tool_call_parser, tokenizer)
    if options.reasoning_parser is not None:  # outermost: only content reaches the tools
        parser = reasoning_splitter(
            options.reasoning_parser,
            tokenizer,
            parser,
            include_reasoning=req.include_reasoning is not False,
            prompt_token_ids=prompt_token_ids,
        )
    return parser
