"""Structured output: the request fields that constrain the output's shape, turned into
one `StructuredOutput` for the worker, or a 400 naming what is wrong.

Three spellings reach us, and a client may use any of them:

* OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`);
* vLLM's `structured_outputs` extension (`json`, `regex`, `choice`, `grammar`,
  `json_object`, `structural_tag`, plus whitespace options), which may also carry only
  options next to a `response_format` (vLLM merges the two the same way);
* the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` /
  `guided_whitespace_pattern` fields. vLLM 0.32 removed them and ignores them with a
  warning, so a client still using them gets unconstrained text; here they are honoured,
  because an ignored constraint fails far from its cause.

Two constraints in one request are refused rather than one silently winning. A JSON
schema is checked here against its own meta-schema (`jsonschema`), so a broken schema is
a 400 before any worker is touched; what only the engine's grammar compiler can judge
(a regex, a grammar, schema features xgrammar does not support) comes back from the
worker as the client's error, also a 400.

`strict` is accepted and needs no work: decoding is constrained to the schema whether or
not it is set, which is what OpenAI's strict mode promises.

What a constraint may cost is bounded before it is checked: a schema's JSON text at most
`MAX_SCHEMA_CHARS` characters and `MAX_SCHEMA_DEPTH` levels deep, a regex, grammar or
structural tag at most `MAX_CONSTRAINT_CHARS`, the choices of `choice` together at most
`MAX_CONSTRAINT_CHARS`. Checking a schema is pure Python (about 3.5 us a character), so
the preprocessor runs these checks in a pool of their own (`constraint_pool`), never on
the event loop and never in the pool chat templates render in.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.protocol import (
    ResponseFormat,
    SamplingFields,
    StructuredOutputsField,
)
from dynamo.llm.protocols import StructuredOutput

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_ERROR_CHARS = 300
"""A schema error message quotes the offending part of the schema: bounded."""
MAX_SCHEMA_CHARS = 128 * 1024
"""Largest JSON schema served, as compact JSON text. OpenAI bounds a strict schema's names
and enum values to 120,000 characters together; checking this much takes about half a
second of one core, and the engine compiles it into a grammar again."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in a schema (OpenAI allows 10 levels of
properties, each of which takes two here: the `properties` object and the property)."""
MAX_CONSTRAINT_CHARS = 64 * 1024
"""Largest regex, grammar or structural tag, and the most characters all `choice` entries
may have together: each is compiled into a grammar on the worker."""
CONSTRAINT_POOL_THREADS = 2
"""Threads checking schemas. Requests that carry one queue here rather than in the pool
chat templates use, so a burst of large schemas cannot delay every chat request."""

log = logging.getLogger(__name__)
_constraint_pool: ThreadPoolExecutor | None = None


def constraint_pool() -> ThreadPoolExecutor:
    """The process's pool for checking request constraints (created on first use: a
    process that serves no constrained request starts no thread)."""
    global _constraint_pool
    if _constraint_pool is None:
        _constraint_pool = ThreadPoolExecutor(
            CONSTRAINT_POOL_THREADS, thread_name_prefix="constraint-check"
        )
    return _constraint_pool


@dataclass(frozen=True)
class _Constraint:
    """One constraint as the request spelled it, and the field that spelled it."""

    param: str
    output: StructuredOutput


def structured_output_of(req: SamplingFields) -> StructuredOutput | None:
    """The request's output constraint, or None when it has none.

    Raises `OpenAIError` (400) naming the field for a constraint that is malformed, a
    schema that is not a valid JSON schema, or two constraints in one request.
    """
    found = [
        c
        for c in (
            _from_response_format(req.response_format),
            _from_structured_outputs(req.structured_outputs),
            _from_guided(req),
        )
        if c is not None
    ]
    if len(found) > 1:
        names = " and ".join(f"`{c.param}`" for c in found)
        raise bad_request(
            f"{names} both constrain the output; send only one of them", found[1].param
        )
    options = req.structured_outputs
    if not found:
        if options is not None:
            raise bad_request(
                "`structured_outputs` must set one of "
                + ", ".join(f"`{f}`" for f in CONSTRAINT_FIELDS),
                "structured_outputs",
            )
        return None
    return _with_options(found[0].output, options, req.guided_whitespace_pattern)


def carries_constraint(req: SamplingFields) -> bool:
    """Whether `req` sets any field `structured_output_of` checks (cheap: no checking)."""
    return (
        (req.response_format is not None and req.response_format.type != "text")
        or req.structured_outputs is not None
        or any(
            value is not None
            for value in (req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
        )
    )


# ---------------------------------------------------------------------- the three spellings


def _from_response_format(fmt: ResponseFormat | None) -> _Constraint | None:
    param = "response_format"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _Constraint(param, StructuredOutput(json_object=True))
    if fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None:
            raise bad_request(
                "`response_format.json_schema` is required when `response_format.type` is "
                "`json_schema`",
                param,
            )
        if spec.schema_ is None:
            raise bad_request("`response_format.json_schema.schema` is required", param)
        schema = checked_json_schema(spec.schema_, "response_format.json_schema.schema")
        return _Constraint(param, StructuredOutput(json_schema=schema))
    raise bad_request(
        f"`response_format.type` `{fmt.type}` is not supported; use one of "
        + ", ".join(f"`{t}`" for t in RESPONSE_FORMAT_TYPES),
        param,
    )


def _from_structured_outputs(so: StructuredOutputsField | None) -> _Constraint | None:
    param = "structured_outputs"
    if so is None:
        return None
    values = {name: _constraint_value(so, name) for name in CONSTRAINT_FIELDS}
    set_fields = [name for name, value in values.items() if value is not None]
    if not set_fields:
        return None  # options only (or nothing): the caller decides
    if len(set_fields) > 1:
        raise bad_request(
            "`structured_outputs` may set only one constraint, got "
            + ", ".join(f"`{f}`" for f in set_fields),
            param,
        )
    name = set_fields[0]
    value = values[name]
    where = f"{param}.{name}"
    if name == "json":
        return _Constraint(param, StructuredOutput(json_schema=checked_json_schema(value, where)))
    if name == "json_object":
        if value is not True:
            raise bad_request(
                f"`{where}` must be true if set; leave `structured_outputs` out for "
                "unconstrained output",
                param,
            )
        return _Constraint(param, StructuredOutput(json_object=True))
    if name == "regex":
        return _Constraint(param, StructuredOutput(regex=_checked_regex(value, where)))
    if name == "choice":
        return _Constraint(param, StructuredOutput(choice=_checked_choice(value, where)))
    if name == "grammar":
        return _Constraint(param, StructuredOutput(grammar=_checked_text(value, where)))
    return _Constraint(param, StructuredOutput(structural_tag=_checked_text(value, where)))


def _constraint_value(so: StructuredOutputsField, name: str) -> Any:
    """One constraint field of `structured_outputs` (the six are listed explicitly so a
    renamed field fails type checking rather than reading as unset)."""
    fields: dict[str, Any] = {
        "json": so.json,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object,
        "structural_tag": so.structural_tag,
    }
    return fields[name]


def _from_guided(req: SamplingFields) -> _Constraint | None:
    given = {
        "guided_json": req.guided_json,
        "guided_regex": req.guided_regex,
        "guided_choice": req.guided_choice,
        "guided_grammar": req.guided_grammar,
    }
    set_fields = [name for name, value in given.items() if value is not None]
    if not set_fields:
        return None
    if len(set_fields) > 1:
        raise bad_request(
            "Only one of "
            + ", ".join(f"`{f}`" for f in GUIDED_FIELDS)
            + " may be set, got "
            + ", ".join(f"`{f}`" for f in set_fields),
            set_fields[1],
        )
    name = set_fields[0]
    value = given[name]
    if name == "guided_json":
        output = StructuredOutput(json_schema=checked_json_schema(value, name))
    elif name == "guided_regex":
        output = StructuredOutput(regex=_checked_regex(value, name))
    elif name == "guided_choice":
        output = StructuredOutput(choice=_checked_choice(value, name))
    else:
        output = StructuredOutput(grammar=_checked_text(value, name))
    return _Constraint(name, output)


def _with_options(
    output: StructuredOutput, options: StructuredOutputsField | None, guided_ws: str | None
) -> StructuredOutput:
    """The constraint with the whitespace options of `structured_outputs` (or the older
    `guided_whitespace_pattern`) applied."""
    pattern = guided_ws
    if options is not None:
        output.disable_any_whitespace = bool(options.disable_any_whitespace)
        output.disable_additional_properties = bool(options.disable_additional_properties)
        pattern = options.whitespace_pattern or pattern
    output.whitespace_pattern = pattern
    return output


# ---------------------------------------------------------------------- checks


def checked_json_schema(value: Any, where: str, param: str | None = None) -> str:
    """A JSON schema given as an object or as JSON text, checked against its meta-schema
    (the draft its `$schema` names, 2020-12 otherwise); returned as compact JSON text.
    A broken one is a 400 naming `where`, with `param` (by default the top-level field of
    `where`) as the error's `param`: the client's error, found before any worker."""
    param = param or where.split(".", 1)[0]
    if isinstance(value, str):
        if not value.strip():
            raise bad_request(f"`{where}` must not be empty", param)
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise bad_request(f"`{where}` is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(
            f"`{where}` must be a JSON schema object, got {type(value).__name__}", param
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise bad_request(f"`{where}` is nested too deeply", param) from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad_request(
            f"`{where}` has {len(text)} characters as compact JSON; at most "
            f"{MAX_SCHEMA_CHARS} are allowed",
            param,
        )
    if _nesting_depth(value) > MAX_SCHEMA_DEPTH:
        raise bad_request(
            f"`{where}` nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep",
            param,
        )
    meta = value.get("$schema")
    if meta is not None and not isinstance(meta, str):
        raise bad_request(
            f"`{where}.$schema` must be a string naming a JSON schema draft, got "
            f"{type(meta).__name__}",
            param,
        )
    _check_against_meta_schema(value, where, param)
    return text


def _check_against_meta_schema(schema: dict[str, Any], where: str, param: str) -> None:
    """`schema` checked against the meta-schema of the draft its `$schema` names."""
    try:
        validator = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator
        )
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        at = "/".join(str(p) for p in exc.path)
        location = f" at `{at}`" if at else ""
        raise bad_request(
            f"`{where}` is not a valid JSON schema{location}: {_bounded(exc.message)}", param
        ) from None
    except RecursionError:
        raise bad_request(f"`{where}` is nested too deeply", param) from None
    except Exception as exc:  # the schema is the client's, and so is its fault
        log.warning("checking a client's JSON schema raised %s: %s", type(exc).__name__, exc)
        raise bad_request(
            f"`{where}` could not be checked as a JSON schema: {_bounded(str(exc))}", param
        ) from None


def _nesting_depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (a scalar: 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def _checked_regex(value: str, where: str) -> str:
    # A NUL is never meaningful in a pattern and the engine's regex converter mishandles
    # it; every other regex is judged by the engine's own compiler (its syntax is not
    # Python's).
    _check_length(len(value), where)
    if "\x00" in value:
        raise bad_request(f"`{where}` must not contain a NUL character", where.split(".")[0])
    return value


def _checked_choice(value: list[str], where: str) -> list[str]:
    if not value:
        raise bad_request(f"`{where}` must list at least one choice", where.split(".")[0])
    _check_length(sum(len(choice) for choice in value), where)
    return list(value)


def _checked_text(value: str, where: str) -> str:
    _check_length(len(value), where)
    if not value.strip():
        raise bad_request(f"`{where}` must not be empty", where.split(".")[0])
    return value


def _check_length(chars: int, where: str) -> None:
    if chars > MAX_CONSTRAINT_CHARS:
        raise bad_request(
            f"`{where}` has {chars} characters; at most {MAX_CONSTRAINT_CHARS} are allowed",
            where.split(".")[0],
        )


def _bounded(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."
