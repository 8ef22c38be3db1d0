"""Bodies of OpenAI chat completion requests, as the tests and benchmarks send them, and
what they ask about."""

from __future__ import annotations

from typing import Any

PEOPLE_TO_DESCRIBE = (
    "a retired baker from Lyon",
    "a young pilot from Oslo",
    "a teacher living in Madrid",
    "a farmer near Nairobi",
    "a student in Tokyo",
    "a painter from Florence",
    "a sailor from Lisbon",
    "a chef in Bangkok",
)
"""Everyday people to ask for as JSON ("Describe ... as JSON."): the structured-output
test and benchmark ask about the same ones, so the benchmark's outputs are of a kind the
test checks."""


def chat_body(model: str, content: str, **fields: Any) -> dict[str, Any]:
    """A `/v1/chat/completions` body: one user message `content` to `model`, with `fields`
    (sampling, `n`, `stream`, ...) beside them."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}
