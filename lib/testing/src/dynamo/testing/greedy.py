"""Greedy outputs compared the way bf16 arithmetic allows: equal, or apart only at a tie.

Speculative decoding is lossless in exact arithmetic: the target checks every draft, so
greedy text with speculation equals the target's own. In bf16 it is lossless up to
rounding. A verification step runs the target over K + 1 positions of each sequence and a
plain step over one; matrix products of other shapes add in another order and round
differently (vLLM-CPU's AMX bf16 kernels, picked on CPUs that have them, show it within a
few hundred tokens). Where the target's two best tokens are within rounding of each
other, either may win, and from there the texts part for good.

So a reference is taken with the top log-probabilities of every token, and another text
matches it when the two are equal, or when they agree up to a token where the other text
went on with one of the reference's alternatives that the reference itself found within
`tolerance` nats of its choice. Anything else (a confident token replaced, a token the
reference did not list near the top) is a real difference and fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The logits leave the model in bf16: near the logit magnitudes of a small model (16 to
# 32) neighbouring bf16 values are 0.125 apart, so a few such steps is all rounding can move
# a difference of two logits.
BF16_TIE_NATS = 0.5
MAX_TOKEN_BYTES = 64
"""Longer than any vocabulary token's text: how far back a choice is looked for."""


@dataclass(frozen=True)
class ReferenceToken:
    """One generated token of the reference: its bytes and log-probability, and the other
    candidates the response listed at that position (bytes, log-probability)."""

    data: bytes
    logprob: float
    alternatives: tuple[tuple[bytes, float], ...]

    def lead_over(self, continuation: bytes, stops: frozenset[bytes] = frozenset()) -> float | None:
        """How far (nats) this token led the best listed alternative that `continuation`
        starts with (an empty continuation: the other text stopped, so one of `stops`, the
        end-of-sequence tokens' texts); None where no listed alternative fits it."""
        if not continuation:
            fits = [lp for alt, lp in self.alternatives if alt in stops]
        else:
            fits = [lp for alt, lp in self.alternatives if continuation.startswith(alt)]
        return self.logprob - max(fits) if fits else None


@dataclass(frozen=True)
class Divergence:
    """Where another text first leaves the reference."""

    token_index: int
    """Index of the reference token at which the texts part (len(reference) past its end)."""
    lead: float | None
    """How far the reference's token led the alternative the other text went on with, in
    nats; None where the other text's continuation is none of the listed alternatives."""
    context: str
    """A few words before and after, for a readable failure."""

    def is_tie(self, tolerance: float) -> bool:
        """A part that rounding explains: onto an alternative within `tolerance`."""
        return self.lead is not None and self.lead <= tolerance


def _token_bytes(entry: Mapping[str, Any]) -> bytes:
    raw = entry.get("bytes")
    return bytes(raw) if raw is not None else str(entry["token"]).encode()


def reference_from_chat_logprobs(
    content: Sequence[Mapping[str, Any]], stops: frozenset[bytes] = frozenset()
) -> list[ReferenceToken]:
    """Reference tokens from an OpenAI chat response's `choices[i].logprobs.content`,
    requested with a generous `top_logprobs` (20, OpenAI's most): bf16 logits come in
    steps of 0.125 nats near a small model's magnitudes, so exact ties happen, five tokens
    wide at times, and the one the other text took must be among those listed.

    `stops`: the end-of-sequence tokens' texts, for a reference taken with `ignore_eos`.
    A response that ends at its end token leaves that token, and so the alternatives at
    its position, out of its logprobs: another text that went on there could not be
    judged. Taken with `ignore_eos`, the reference ends at its first end token, kept as a
    last token with no text whose alternatives are the ones the end token beat."""
    tokens = []
    for entry in content:
        chosen = _token_bytes(entry)
        alternatives = tuple(
            (_token_bytes(alt), float(alt["logprob"]))
            for alt in entry.get("top_logprobs", [])
            if _token_bytes(alt) != chosen
        )
        ends = chosen in stops
        tokens.append(
            ReferenceToken(b"" if ends else chosen, float(entry["logprob"]), alternatives)
        )
        if ends:
            break
    return tokens


def reference_from_completion_logprobs(logprobs: Mapping[str, Any]) -> list[ReferenceToken]:
    """Reference tokens from a completions response's `choices[i].logprobs` (`tokens`,
    `token_logprobs`, `top_logprobs` as token text -> logprob), requested with a generous
    `logprobs` (see `reference_from_chat_logprobs`). The completions API gives no bytes:
    a token's text stands for them."""
    tokens = []
    for text, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        alternatives = tuple(
            (alt.encode(), float(value)) for alt, value in (top or {}).items() if alt != text
        )
        tokens.append(ReferenceToken(text.encode(), float(logprob), alternatives))
    return tokens


def reference_text(reference: Sequence[ReferenceToken]) -> str:
    """The reference's text (its tokens' bytes, joined and decoded)."""
    return b"".join(t.data for t in reference).decode(errors="replace")


def first_divergence(
    reference: Sequence[ReferenceToken], text: str, stops: frozenset[bytes] = frozenset()
) -> Divergence | None:
    """Where `text` first leaves the reference, or None where the two are the same.
    `stops`: the end-of-sequence tokens' texts, for a text that ended where the reference
    went on."""
    ours = text.encode()
    theirs = b"".join(t.data for t in reference)
    if ours == theirs:
        return None
    offset = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    starts = []
    start = 0
    for index, token in enumerate(reference):
        starts.append(start)
        if offset < start + len(token.data) or (not token.data and offset == start):
            return _divergence_at(reference, starts, index, ours, theirs, offset, stops)
        start += len(token.data)
    # The other text goes on where the reference ended: nothing to compare it with.
    return Divergence(len(reference), None, _context(ours, theirs, start))


def _divergence_at(
    reference: Sequence[ReferenceToken],
    starts: list[int],
    index: int,
    ours: bytes,
    theirs: bytes,
    offset: int,
    stops: frozenset[bytes],
) -> Divergence:
    """The texts' bytes part at `offset`, inside reference token `index`. The other text
    may have parted there, or at an earlier token where it took another listed token that
    its bytes begin with:
    - one that reaches past the agreed bytes (the reference's " a" + " way" against
      " and": the bytes part after " a", but the choice was made at " a");
    - a shorter one that begins the reference's token (the reference's " an" against
      " a" + " professional": the bytes part inside " an", after the " a");
    - the same bytes cut into other tokens (the reference's "\n" + "\n" + "1" against
      "\n\n" + "First": the bytes part at "1", but from the "\n\n" on the other text
      followed a context the reference never scored).
    Every such token within `MAX_TOKEN_BYTES` of the parting is a candidate, and the
    closest call explains the parting."""
    best: Divergence | None = None
    for at in range(index, -1, -1):
        if at < index and offset - starts[at] >= MAX_TOKEN_BYTES:
            break  # no token is that long: an earlier choice cannot reach the parting
        lead = reference[at].lead_over(ours[starts[at] :], stops)
        if lead is not None and (best is None or best.lead is None or lead < best.lead):
            best = Divergence(at, lead, _context(ours, theirs, starts[at]))
        if best is None:
            best = Divergence(at, None, _context(ours, theirs, starts[at]))
    assert best is not None
    return best


def _context(ours: bytes, theirs: bytes, at: int, width: int = 60) -> str:
    before = theirs[max(0, at - width) : at].decode(errors="replace")
    return (
        f"...{before}[reference: {theirs[at : at + width].decode(errors='replace')!r} | "
        f"other: {ours[at : at + width].decode(errors='replace')!r}]"
    )


def mismatch(
    reference: Sequence[ReferenceToken],
    text: str,
    tolerance: float = BF16_TIE_NATS,
    stops: frozenset[bytes] = frozenset(),
) -> str | None:
    """None where `text` matches the reference (equal, or apart only at a tie); otherwise
    why not, for an assertion message."""
    divergence = first_divergence(reference, text, stops)
    if divergence is None or divergence.is_tie(tolerance):
        return None
    if divergence.lead is None:
        why = "the other text went on with none of the alternatives the reference listed"
    else:
        why = f"the reference's token led the other text's by {divergence.lead:.3f} nats"
    return (
        f"parts from the reference at token {divergence.token_index}, where {why} "
        f"(a tie is <= {tolerance}): {divergence.context}"
    )


def assert_same_greedy(
    prompts: Sequence[str],
    texts: Sequence[str],
    reference: Sequence[Sequence[ReferenceToken]],
    stops: frozenset[bytes] = frozenset(),
) -> None:
    """Every text is the reference's, or parts from it only at a bf16 tie (printed, with
    the reference's lead there). `stops` as in `first_divergence`."""
    margins = []
    for prompt, text, expected in zip(prompts, texts, reference, strict=True):
        problem = mismatch(expected, text, stops=stops)
        assert problem is None, f"{prompt!r}: {problem}"
        if (divergence := first_divergence(expected, text, stops)) is not None:
            margins.append(f"{divergence.lead:.3f}")
    print(
        f"{len(texts) - len(margins)} of {len(texts)} answers equal the reference; "
        f"{len(margins)} part at a tie (the reference's lead there, nats: {', '.join(margins)})"
    )
