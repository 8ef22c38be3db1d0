"""Bodies of OpenAI chat completion requests, as the tests send them."""

from __future__ import annotations

from typing import Any


def chat_body(model: str, content: str, **fields: Any) -> dict[str, Any]:
    """A `/v1/chat/completions` body: one user message `content` to `model`, with `fields`
    (sampling, `n`, `stream`, ...) beside them."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}
