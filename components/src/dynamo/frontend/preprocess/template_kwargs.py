"""Which `chat_template_kwargs` a request may hand to the model's chat template.

`chat_template_kwargs` reaches `tokenizer.apply_chat_template(**kwargs)`, whose own
parameters do more than fill template variables: `chat_template` replaces the model's
template with the request's (an arbitrary Jinja program the frontend would run), and
`tokenize`, `truncation`, `return_dict`, ... change what the call returns. `vllm serve`
refuses a request template unless started with `--trust-request-chat-template` and drops
kwargs that are neither parameters of the call nor variables of the template; this
frontend has no trust switch and answers 400 for both, so a client learns that its key had
no effect instead of being silently ignored.

A key is accepted when it is a variable the model's template reads (found with
`jinja2.meta.find_undeclared_variables` on the template source, parsed once per model) or
one of a few variables well-known templates read (`COMMON_TEMPLATE_VARIABLES`), and it is
not one of the call's own parameters or the template's helper functions.

Three accepted keys have top-level counterparts with rules of their own, and the kwargs
spelling must not skip them (`check_shadowed_fields`): `tools` is refused here (the
top-level field is where tool schemas are checked, rendered and parsed back out),
`documents` must have the shape of vLLM's top-level field (objects of strings), and
`reasoning_effort` one of the values vLLM's top-level field accepts.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from dynamo.frontend.openai.errors import OpenAIError, bad_request

log = logging.getLogger(__name__)

# Read by widely used templates (Qwen3 `enable_thinking`, DeepSeek `thinking`, gpt-oss
# `reasoning_effort`, tool and RAG templates); harmless for a template that ignores them,
# so generic clients that always send them keep working.
COMMON_TEMPLATE_VARIABLES = frozenset(
    {
        "enable_thinking",
        "thinking",
        "reasoning_effort",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
    }
)
# Parameters of `apply_chat_template` that are template inputs as well, so they may come
# through kwargs; every other parameter of the call is refused.
_TEMPLATE_INPUT_PARAMETERS = frozenset(
    {"tools", "documents", "add_generation_prompt", "continue_final_message"}
)
# Refused even where a tokenizer's signature does not list them: they replace the
# template, steer tokenization, or shadow the conversation and the template's helpers.
ALWAYS_REFUSED = frozenset(
    {
        "chat_template",
        "tokenize",
        "conversation",
        "messages",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "raise_exception",
        "strftime_now",
    }
)
# The values vLLM's top-level `reasoning_effort` accepts.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# The preprocessor passes these to `apply_chat_template` itself.
_CALL_FLAGS = ("add_generation_prompt", "continue_final_message")
_MAX_KEY_SHOWN = 64


@dataclass(frozen=True)
class TemplateArguments:
    """A request's checked kwargs: template variables, plus the two call flags when the
    request gave them in `chat_template_kwargs` rather than at the top level."""

    variables: dict[str, Any]
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


@dataclass(frozen=True)
class TemplateKwargsPolicy:
    """The keys one model's template accepts; built once per model, shared by requests."""

    accepted: frozenset[str]
    refused: frozenset[str]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TemplateKwargsPolicy:
        refused = ALWAYS_REFUSED | (
            _call_parameters(tokenizer.apply_chat_template) - _TEMPLATE_INPUT_PARAMETERS
        )
        variables = template_variables(_template_sources(tokenizer.chat_template))
        return cls(accepted=(variables | COMMON_TEMPLATE_VARIABLES) - refused, refused=refused)

    def check(self, kwargs: Mapping[str, Any] | None) -> TemplateArguments:
        """The request's kwargs, or a 400 whose `param` is `chat_template_kwargs.<key>`."""
        if not kwargs:
            return TemplateArguments(variables={})
        for key in kwargs:
            if key in self.refused:
                raise _refused(key)
            if key not in self.accepted:
                raise _unknown(key, self.accepted)
        check_shadowed_fields(kwargs)
        variables = dict(kwargs)
        flags = {name: _flag(name, variables.pop(name, None)) for name in _CALL_FLAGS}
        return TemplateArguments(variables=variables, **flags)


def check_shadowed_fields(kwargs: Mapping[str, Any]) -> None:
    """The rules of the top-level fields that `tools`, `documents` and `reasoning_effort`
    in `chat_template_kwargs` would otherwise bypass; a 400 naming the key."""
    if "tools" in kwargs:
        raise bad_request(
            "`chat_template_kwargs.tools` is not allowed: send tools in the top-level "
            "`tools` field, where their schemas are checked and calls are parsed back out",
            "chat_template_kwargs.tools",
        )
    if "documents" in kwargs:
        documents = kwargs["documents"]
        if not isinstance(documents, list) or not all(
            isinstance(doc, dict) and all(isinstance(v, str) for v in doc.values())
            for doc in documents
        ):
            raise bad_request(
                "`chat_template_kwargs.documents` must be a list of objects whose values "
                "are strings",
                "chat_template_kwargs.documents",
            )
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(
            f"`chat_template_kwargs.reasoning_effort` must be one of "
            f"{', '.join(REASONING_EFFORTS)}",
            "chat_template_kwargs.reasoning_effort",
        )


def template_variables(sources: Iterable[str]) -> frozenset[str]:
    """Every variable the templates read from their context. A template that does not
    parse yields none (rendering it fails later with a clear 400 anyway)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    found: set[str] = set()
    for source in sources:
        try:
            found |= jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            log.warning("cannot analyse the chat template's variables: %s", exc)
    return frozenset(found)


class _GenerationTag(jinja2.ext.Extension):
    """Parses `{% generation %}...{% endgeneration %}` (which Hugging Face templates use
    to mark assistant tokens) as a plain block, so such templates can be analysed."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _template_sources(chat_template: Any) -> list[str]:
    """A tokenizer's template(s): one string, or a name -> template mapping."""
    if isinstance(chat_template, str):
        return [chat_template]
    if isinstance(chat_template, Mapping):
        return [t for t in chat_template.values() if isinstance(t, str)]
    return []


def _call_parameters(function: Callable[..., Any]) -> frozenset[str]:
    """Named parameters of `apply_chat_template` (whatever the transformers version)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return frozenset(p.name for p in parameters if p.kind not in variadic)


def _flag(name: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise bad_request(
        f"`chat_template_kwargs.{name}` must be a boolean", f"chat_template_kwargs.{name}"
    )


def _shown(key: str) -> str:
    return key if len(key) <= _MAX_KEY_SHOWN else key[:_MAX_KEY_SHOWN] + "..."


def _refused(key: str) -> OpenAIError:
    if key == "chat_template":
        reason = "requests cannot supply a chat template; the model's own template is used"
    else:
        reason = "it is not a template variable but controls how the template is applied"
    return bad_request(
        f"`chat_template_kwargs.{_shown(key)}` is not allowed: {reason}",
        f"chat_template_kwargs.{_shown(key)}",
    )


def _unknown(key: str, accepted: frozenset[str]) -> OpenAIError:
    return bad_request(
        f"`chat_template_kwargs.{_shown(key)}` is not a variable of this model's chat "
        f"template; accepted keys: {', '.join(sorted(accepted))}",
        f"chat_template_kwargs.{_shown(key)}",
    )
