"""vLLM's `X-Vllm-Priority` request header: a request's priority set by a proxy or gateway
without touching the body.

As in vLLM's server, an integer in the header wins over the body's `priority`. Unlike
vLLM, which ignores a header it cannot parse, a value that is not an integer in range is a
400 naming the header: a priority a gateway meant to set and that silently did not apply
would be found only under load.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.protocol import Priority

PRIORITY_HEADER = "X-Vllm-Priority"


def header_priority(headers: Mapping[str, str]) -> int | None:
    """The priority the request's header sets; None without the header."""
    text = headers.get(PRIORITY_HEADER)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise bad_request(
            f"the {PRIORITY_HEADER} header must be an integer, got {text!r}", PRIORITY_HEADER
        ) from None
    try:
        return msgspec.convert(value, Priority)  # the bounds of the body's `priority`
    except msgspec.ValidationError:
        raise bad_request(
            f"the {PRIORITY_HEADER} header must be a 32-bit integer, got {value}", PRIORITY_HEADER
        ) from None
