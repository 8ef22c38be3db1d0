"""`truncate_prompt_tokens` and `truncation_side`: a prompt cut to its last (or first) N
tokens instead of refused, as vLLM's server does.

vLLM's rules, kept here: N is at least -1; -1 means "as much as the context allows"; N
larger than the context is a 400; the side defaults to the left (the prompt's end is
kept: what a generative model needs to go on), `right` keeps the start. The cut applies to
the token ids, after the chat template and tokenization, so it also applies to a prompt
given as ids. A text prompt far longer than the context is first trimmed by characters on
the same side (the context's worth of characters at the most per token), so the frontend
never tokenizes more than the context could hold.

One difference, on purpose: -1 keeps the context less one token, so the completion has
room for at least one token (vLLM does the same only when `max_tokens` is given).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.protocol import SamplingFields

SIDES = ("left", "right")


@dataclass(frozen=True)
class PromptTruncation:
    """How many prompt tokens to keep, and from which end."""

    keep: int
    keep_end: bool  # `left` truncation: the last `keep` tokens stay

    @classmethod
    def of(cls, req: SamplingFields, context_length: int) -> PromptTruncation | None:
        """The request's truncation (None: none asked, or -1 with an unknown context);
        a 400 naming the field for a value vLLM refuses."""
        side = req.truncation_side
        if side is not None and side not in SIDES:
            raise bad_request(
                "`truncation_side` must be either 'left' or 'right'.", "truncation_side"
            )
        keep = req.truncate_prompt_tokens
        if keep is None:
            return None
        if keep < -1:
            raise bad_request(
                f"`truncate_prompt_tokens` must be -1 or at least 0, got {keep}",
                "truncate_prompt_tokens",
            )
        if context_length > 0 and keep > context_length:
            raise bad_request(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{context_length}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if keep == -1:
            if context_length <= 0:
                return None
            keep = context_length - 1
        return cls(keep=keep, keep_end=side != "right")

    def apply(self, ids: list[int]) -> list[int]:
        """The ids that stay (all of them when the prompt is short enough)."""
        if len(ids) <= self.keep:
            return ids
        if self.keep == 0:
            return []
        return ids[-self.keep :] if self.keep_end else ids[: self.keep]

    def trim_text(self, text: str, max_chars: int) -> str:
        """`text` cut to `max_chars` characters on the side truncation removes."""
        if len(text) <= max_chars:
            return text
        return text[-max_chars:] if self.keep_end else text[:max_chars]
