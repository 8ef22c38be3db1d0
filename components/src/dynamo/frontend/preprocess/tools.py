"""Tool calling on the request side: `tools` and `tool_choice` checked and turned into what
the chat template and the engine need (the `tools` variable, and for `required` or a named
function the structured output that constrains the call).

The model's text is read back into `tool_calls` by `parsing.tool_calls`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.protocol import (
    ChatCompletionRequest,
    ToolChoiceFunction,
    ToolDefinition,
)
from dynamo.frontend.preprocess.structured_output import checked_json_schema
from dynamo.frontend.preprocess.template_kwargs import template_variables
from dynamo.llm.protocols import StructuredOutput

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: what the chat template gets and the output constraint
    (`required` / named only)."""

    template_tools: list[dict[str, Any]]
    constraint: StructuredOutput | None


def tool_request(req: ChatCompletionRequest) -> ToolRequest | None:
    """`req`'s tools checked (names, schemas, the named function); None without tools.

    Raises `OpenAIError` (400) naming the field at fault."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice != "none":
            raise bad_request("`tool_choice` needs `tools`", "tool_choice")
        return None
    for index, tool in enumerate(req.tools):
        _check_tool(index, tool)
    _check_unique_names(req.tools)
    choice = req.tool_choice
    constraint = None
    if isinstance(choice, ToolChoiceFunction):
        constraint = _tool_json(named_schema(req.tools, choice))
    elif choice == "required":
        schema = required_schema(req.tools, parallel=req.parallel_tool_calls is not False)
        constraint = _tool_json(schema)
    return ToolRequest(
        template_tools=[msgspec.to_builtins(tool) for tool in req.tools],
        constraint=constraint,
    )


def with_tool_constraint(
    own: StructuredOutput | None, tool_constraint: StructuredOutput | None
) -> StructuredOutput | None:
    """The request's one output constraint: its own structured output or the one its
    `tool_choice` implies; both at once is a 400 (one would silently lose)."""
    if own is not None and tool_constraint is not None:
        raise bad_request(
            "`tool_choice` `required` or a named function constrains the output to the "
            "tool's arguments; it cannot be combined with `response_format`, "
            "`structured_outputs` or `guided_*`",
            "tool_choice",
        )
    return own if own is not None else tool_constraint


def template_reads_tools(chat_template: Any) -> bool:
    """Whether a chat template (a Jinja source, or a name -> source mapping / list as
    Hugging Face stores several) reads the `tools` variable."""
    if chat_template is None:
        return False
    if isinstance(chat_template, str):
        sources = [chat_template]
    elif isinstance(chat_template, dict):
        sources = [v for v in chat_template.values() if isinstance(v, str)]
    else:
        sources = [t.get("template", "") for t in chat_template if isinstance(t, dict)]
    return "tools" in template_variables(sources)


def named_schema(tools: Sequence[ToolDefinition], choice: ToolChoiceFunction) -> dict[str, Any]:
    """The output schema for a named function: its parameters object."""
    if choice.type != "function":
        raise bad_request(
            f'`tool_choice.type` must be "function", got "{choice.type}"', "tool_choice"
        )
    for tool in tools:
        if tool.function.name == choice.function.name:
            return _parameters(tool)
    raise bad_request(
        f"`tool_choice` names function `{choice.function.name}`, which is not in `tools`",
        "tool_choice",
    )


def required_schema(tools: Sequence[ToolDefinition], *, parallel: bool) -> dict[str, Any]:
    """The output schema for `required`: an array of `{"name", "parameters"}` objects,
    one alternative per tool (at most one item when `parallel_tool_calls` is false)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _check_tool(index: int, tool: ToolDefinition) -> None:
    where = f"tools[{index}]"
    if tool.type != "function":
        raise bad_request(f'`{where}.type` must be "function", got "{tool.type}"', f"{where}.type")
    if not TOOL_NAME.match(tool.function.name):
        raise bad_request(
            f"`{where}.function.name` must be 1 to 64 letters, digits, `_` or `-`",
            f"{where}.function.name",
        )
    if tool.function.parameters is not None:
        where_schema = f"{where}.function.parameters"
        checked_json_schema(tool.function.parameters, where_schema, param=where_schema)


def _check_unique_names(tools: Sequence[ToolDefinition]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(
                f"`tools[{index}].function.name` `{tool.function.name}` is defined twice",
                f"tools[{index}].function.name",
            )
        seen.add(tool.function.name)


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def _tool_json(schema: dict[str, Any]) -> StructuredOutput:
    """The structured output for a tool call: compact JSON, no free whitespace (a small
    model under greedy decoding can otherwise spend its whole budget on newlines, and a
    call's arguments need no layout)."""
    return StructuredOutput(json_schema=_compact(schema), disable_any_whitespace=True)


def _compact(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
