"""Request bodies into request structs, with every way a body can be hostile ending as a 400.

msgspec checks JSON syntax, types and ranges in one pass (`openai/protocol.py` bounds every
integer the workers receive, so a value msgpack cannot carry never gets past here) and
reports most failures as `ValidationError` / `DecodeError` with a JSON path, which
`errors.from_validation_error` turns into a 400 naming the field. Two failures it reports
otherwise, and they used to leave as 500s:

* invalid UTF-8 inside a JSON string raises `UnicodeDecodeError` (msgspec 0.22; from
  0.23 a `DecodeError` saying "Invalid UTF-8 encoded string"), which carries no
  location. Only then (the error path, never a valid request) a body of at most 1 MiB is
  parsed once more with the standard library, with the invalid bytes escaped to lone
  surrogates (`surrogateescape`), to find the field that holds them (about 10 ms per MiB:
  larger hostile bodies get the 400 without the field, so they cannot buy event-loop time);
* nesting deeper than the interpreter's recursion limit (about a thousand levels) raises
  `RecursionError`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from dynamo.frontend.openai.errors import OpenAIError, bad_request, from_validation_error
from dynamo.frontend.openai.unsupported_fields import log_unknown_fields

# What `surrogateescape` turns an undecodable byte 0x80..0xFF into.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
# Largest body whose invalid UTF-8 is located (see the module docstring).
LOCATE_MAX_BYTES = 1 << 20


def decode_request(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """`decoder.decode(body)`; `OpenAIError` (400) for any body it cannot decode. Fields
    outside the schema are ignored and, at debug level, logged (`unsupported_fields`;
    fields in the schema set to a value we do not serve are refused there, once the
    request's model is known, so that the refusal is counted for the model)."""
    request = _decode(decoder, body)
    if isinstance(decoder.type, type) and issubclass(decoder.type, msgspec.Struct):
        log_unknown_fields(body, decoder.type)
    return request


# How msgspec 0.23 and later word a JSON string that is not valid UTF-8.
_INVALID_UTF8 = "Invalid UTF-8"


def _decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from exc
    except msgspec.DecodeError as exc:
        if str(exc).startswith(_INVALID_UTF8):
            raise invalid_utf8(locate_invalid_utf8(body)) from exc
        raise from_validation_error(exc) from exc
    except UnicodeDecodeError as exc:
        raise invalid_utf8(locate_invalid_utf8(body)) from exc
    except RecursionError as exc:
        raise bad_request(
            "Request body is nested too deeply to decode.", code="invalid_json"
        ) from exc


def invalid_utf8(path: str | None) -> OpenAIError:
    """400 for a string that is not valid UTF-8; `param` is the top-level field."""
    if not path:
        return bad_request("Request body contains a string that is not valid UTF-8.")
    param = re.split(r"[.\[]", path, maxsplit=1)[0] or None
    return bad_request(f"Invalid value for `{path}`: not valid UTF-8.", param=param)


def locate_invalid_utf8(body: bytes) -> str | None:
    """The JSON path (`messages[0].content`) of the first string in `body` holding invalid
    UTF-8; for a bad object key, the path of its object. None for a body over
    `LOCATE_MAX_BYTES`, one that cannot be parsed this way (malformed or too deep anyway),
    or when nothing is found."""
    if len(body) > LOCATE_MAX_BYTES:
        return None
    try:
        document = json.loads(body.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None
    return _first_escaped(document)


def _first_escaped(document: object) -> str | None:
    """Depth-first, in document order, without recursion (the document may be deep)."""
    stack: list[tuple[str, object]] = [("", document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _ESCAPED_BYTE.search(value):
                return path
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                if _ESCAPED_BYTE.search(key):
                    return path  # never echo the undecodable key itself
                children.append((f"{path}.{key}" if path else key, item))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None
