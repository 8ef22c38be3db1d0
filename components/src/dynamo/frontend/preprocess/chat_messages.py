"""A chat request's messages and top-level fields as the chat template takes them: text
content flattened per message, `documents` and `reasoning_effort`, vLLM's chat `echo`."""

from __future__ import annotations

from typing import Any

from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.protocol import ChatCompletionRequest, ChatMessage
from dynamo.frontend.preprocess.template_kwargs import REASONING_EFFORTS


def message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: content flattened to one string."""
    out: dict[str, Any] = {
        "role": message.role,
        "content": flatten_content(index, message.content),
    }
    for name in ("name", "tool_calls", "tool_call_id"):  # only those the message sets
        value = getattr(message, name)
        if value is not None:
            out[name] = value
    return out


def flatten_content(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"Unsupported content part `{part.type}` in `messages[{index}].content[{j}]`: "
                "only text parts are supported",
                "messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def chat_echo(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat `echo`: the last message's text when the assistant wrote it (the
    response then continues it), else nothing."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant":
        return None
    return flatten_content(len(req.messages) - 1, last.content) or None


def top_level_template_variables(
    req: ChatCompletionRequest, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """`documents` and `reasoning_effort` for the chat template, as vLLM passes them
    (they win over the same keys in `chat_template_kwargs`); a reasoning effort also sets
    `enable_thinking` (false for `none`) unless the kwargs set it."""
    variables: dict[str, Any] = {}
    if req.documents is not None:
        variables["documents"] = req.documents
    effort = req.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"`reasoning_effort` must be one of {', '.join(REASONING_EFFORTS)}",
                "reasoning_effort",
            )
        variables["reasoning_effort"] = effort
        if "enable_thinking" not in kwargs:
            variables["enable_thinking"] = effort != "none"
    return variables


def first_set(*values: bool | None) -> bool | None:
    """The first value that is not None (a top-level field wins over a template kwarg)."""
    return next((v for v in values if v is not None), None)
