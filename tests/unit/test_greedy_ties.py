"""`dynamo.testing.greedy`: a text matches a greedy reference when equal, or when it parts
from it only onto an alternative the reference found within rounding of its choice."""

from __future__ import annotations

import pytest

from dynamo.testing.greedy import (
    BF16_TIE_NATS,
    ReferenceToken,
    first_divergence,
    mismatch,
    reference_from_chat_logprobs,
    reference_text,
)


def entry(token: str, logprob: float, *alternatives: tuple[str, float]) -> dict:
    """One `logprobs.content` entry as the chat API sends it (the chosen token listed
    among the top ones, as vLLM does)."""
    top = [(token, logprob), *alternatives]
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
    }


# "The capital is Tokyo." with a near-tie at " capital" (" city" 0.125 behind, " town"
# 0.375 behind, " seat" 2 behind) and a confident " Tokyo" (" Kyoto" 4 behind).
REFERENCE = reference_from_chat_logprobs(
    [
        entry("The", -0.1, ("A", -2.5)),
        entry(" capital", -0.6, (" city", -0.725), (" town", -0.975), (" seat", -2.6)),
        entry(" is", -0.01, (" was", -5.0)),
        entry(" Tokyo", -0.02, (" Kyoto", -4.02)),
        entry(".", -0.3, ("!", -3.0)),
    ]
)


def test_the_reference_text_is_its_tokens_joined() -> None:
    assert reference_text(REFERENCE) == "The capital is Tokyo."
    assert REFERENCE[1].alternatives == ((b" city", -0.725), (b" town", -0.975), (b" seat", -2.6))


def test_an_equal_text_matches() -> None:
    assert first_divergence(REFERENCE, "The capital is Tokyo.") is None
    assert mismatch(REFERENCE, "The capital is Tokyo.") is None


def test_parting_at_a_tie_onto_a_close_alternative_matches() -> None:
    for text, lead in (("The city of Japan is Tokyo.", 0.125), ("The town is Tokyo.", 0.375)):
        divergence = first_divergence(REFERENCE, text)
        assert divergence is not None and divergence.token_index == 1
        assert divergence.lead is not None and abs(divergence.lead - lead) < 1e-9
        assert divergence.is_tie(BF16_TIE_NATS)
        assert mismatch(REFERENCE, text) is None


def test_parting_at_a_confident_token_fails_with_where_and_why() -> None:
    problem = mismatch(REFERENCE, "The capital is Kyoto.")
    assert problem is not None
    assert "token 3" in problem and "led the other text's by 4.000 nats" in problem


def test_a_listed_but_distant_alternative_fails() -> None:
    assert mismatch(REFERENCE, "The seat of power is Tokyo.") is not None


def test_an_unlisted_continuation_fails() -> None:
    divergence = first_divergence(REFERENCE, "The metropolis is Tokyo.")
    assert divergence is not None and divergence.token_index == 1 and divergence.lead is None
    problem = mismatch(REFERENCE, "The metropolis is Tokyo.")
    assert problem is not None and "none of the alternatives" in problem


def test_the_tolerance_decides_what_counts_as_a_tie() -> None:
    assert mismatch(REFERENCE, "The town is Tokyo.", tolerance=0.375) is None
    assert mismatch(REFERENCE, "The town is Tokyo.", tolerance=0.3) is not None


def test_a_text_that_stops_early_or_runs_on_fails() -> None:
    assert mismatch(REFERENCE, "The capital is") is not None  # stopped where " Tokyo" led by 4
    run_on = first_divergence(REFERENCE, "The capital is Tokyo. It is big.")
    assert run_on is not None and run_on.token_index == len(REFERENCE)
    assert mismatch(REFERENCE, "The capital is Tokyo. It is big.") is not None


def test_multibyte_characters_split_over_tokens_compare_by_bytes() -> None:
    cafe = "café".encode()  # the "é" is two bytes, split over two tokens
    tokens = [
        {"token": "caf", "logprob": -0.1, "bytes": list(cafe[:3]), "top_logprobs": []},
        {"token": "bytes:\\xc3", "logprob": -0.1, "bytes": list(cafe[3:4]), "top_logprobs": []},
        {"token": "bytes:\\xa9", "logprob": -0.1, "bytes": list(cafe[4:]), "top_logprobs": []},
    ]
    reference = reference_from_chat_logprobs(tokens)
    assert reference_text(reference) == "café"
    assert mismatch(reference, "café") is None
    assert first_divergence(reference, "cafe") is not None


def test_stopping_where_the_reference_went_on_is_a_tie_only_onto_a_close_end_token() -> None:
    reference = reference_from_chat_logprobs(
        [entry("Yes", -0.1, ("No", -3.0)), entry(".", -0.7, ("<|im_end|>", -0.8), ("!", -3.0))]
    )
    stops = frozenset({b"<|im_end|>"})
    assert mismatch(reference, "Yes", stops=stops) is None  # end token 0.1 behind "."
    assert mismatch(reference, "Yes") is not None  # without knowing the end token
    assert mismatch(reference, "", stops=stops) is not None  # "Yes" led the end by far more


def test_a_reference_taken_past_its_end_token_ends_there_and_judges_texts_that_go_on() -> None:
    stops = frozenset({b"<|im_end|>"})
    reference = reference_from_chat_logprobs(
        [
            entry("Yes", -0.1, ("No", -3.0)),
            entry("<|im_end|>", -0.6, ("\n\n", -0.9), ("!", -4.0)),
            entry("<|im_start|>", -0.2),  # generated past the end (ignore_eos): cut off
        ],
        stops,
    )
    assert reference_text(reference) == "Yes"
    assert len(reference) == 2 and reference[1].alternatives == ((b"\n\n", -0.9), (b"!", -4.0))
    assert mismatch(reference, "Yes", stops=stops) is None
    went_on = first_divergence(reference, "Yes\n\nIndeed.", stops)
    assert went_on is not None and went_on.token_index == 1
    assert went_on.lead is not None and abs(went_on.lead - 0.3) < 1e-9
    assert mismatch(reference, "Yes\n\nIndeed.", stops=stops) is None  # the end led by 0.3
    assert mismatch(reference, "Yes! Indeed.", stops=stops) is not None  # it led "!" by 3.4


def assert_tie_accepted(
    reference: list[ReferenceToken], text: str, *, token_index: int, lead: float
) -> None:
    """`text` parts from `reference` at `token_index`, where the reference's choice led the
    other text's by `lead` nats: a near tie, so no mismatch."""
    divergence = first_divergence(reference, text)
    assert divergence is not None and divergence.token_index == token_index
    assert divergence.lead is not None and abs(divergence.lead - lead) < 1e-9
    assert mismatch(reference, text) is None


def assert_refused_at(reference: list[ReferenceToken], text: str, *, token_index: int) -> None:
    """`text` parts from `reference` at `token_index` onto an alternative 3 nats behind: a
    mismatch that names the token and the lead."""
    problem = mismatch(reference, text)
    assert problem is not None and f"token {token_index}" in problem and "3.000 nats" in problem


@pytest.mark.parametrize(
    ("tied", "text", "lead", "confident"),
    [
        # The reference chose " a" then " way"; the other text chose " and" (a near tie) at
        # the same position. Their bytes part one token later (after " a"), but the choice
        # was made at " a", and it is judged there (seen on a loaded machine with Eagle3).
        pytest.param(
            [
                entry("Art", -0.1, ("Music", -3.0)),
                entry(",", -0.05, (" is", -4.0)),
                entry(" a", -0.9, (" and", -1.1), (" the", -2.5)),
                entry(" way", -0.2, (" form", -1.9)),
                entry(" of", -0.01, (" to", -5.0)),
            ],
            "Art, and it shows.",
            0.2,
            entry(" a", -0.1, (" and", -3.1)),
            id="onto-a-longer-alternative-that-the-reference-token-begins",
        ),
        # The reference chose " an" (then " expert"); the other text chose " a" (then
        # " professional"), which the target scored exactly as high. The bytes part inside
        # " an", after the " a" both begin with, and the choice was made at that token (seen
        # in the Eagle3 head's module: "You don't need to be a professional").
        pytest.param(
            [
                entry(" to", -0.134, (" a", -2.634)),
                entry(" be", -1.413, (" know", -2.038)),
                entry(" an", -0.831, (" a", -0.831), (" super", -4.581)),
                entry(" expert", -1.1, (" engineer", -2.0)),
            ],
            " to be a professional",
            0.0,
            entry(" an", -0.1, (" a", -3.1)),
            id="onto-a-shorter-alternative-that-begins-the-reference-token",
        ),
    ],
)
def test_parting_inside_the_reference_token_is_judged_at_that_token(
    tied: list[dict], text: str, lead: float, confident: dict
) -> None:
    """The bytes of `text` part from the reference's inside its token 2, where the choice
    was made: a near tie there (led by `lead` nats) matches. The same parting where the
    reference chose `confident` instead (3 nats ahead) still fails, at the same token."""
    assert_tie_accepted(reference_from_chat_logprobs(tied), text, token_index=2, lead=lead)
    far = reference_from_chat_logprobs([*tied[:2], confident, tied[3]])
    assert_refused_at(far, text, token_index=2)


def test_the_same_bytes_cut_into_other_tokens_is_a_parting_where_the_cut_differs() -> None:
    """The reference chose "\\n" then "\\n" then "1"; the other text took the one token
    "\\n\\n" (the target put it close behind) and then "First", which the reference, in its
    own context, did not list. The bytes part at "1", but the other text left the
    reference's tokens at the first "\\n" (seen in the Eagle3 head's module: "Here's a plan
    to make it happen:\\n\\n1. **" against "...:\\n\\nFirst, let's")."""
    reference = reference_from_chat_logprobs(
        [
            entry(" happen", -0.3, (" work", -2.0)),
            entry(":", -0.2, (".", -2.1)),
            entry("\n", -0.7, ("\n\n", -0.9), (" ", -4.0)),
            entry("\n", -0.05, ("1", -4.0)),
            entry("1", -0.4, ("**", -2.0)),
        ]
    )
    text = " happen:\n\nFirst, let's start"
    assert_tie_accepted(reference, text, token_index=2, lead=0.2)
    # The other way round: the reference took "\n\n", the other text "\n" + "\n".
    joined = reference_from_chat_logprobs(
        [
            entry(":", -0.2, (".", -2.1)),
            entry("\n\n", -0.6, ("\n", -0.75)),
            entry("1", -0.4, ("**", -2.0)),
        ]
    )
    assert mismatch(joined, ":\n\nFirst") is None
    # A cut the target put far below its choice still fails.
    far = reference_from_chat_logprobs(
        [
            entry(":", -0.2, (".", -2.1)),
            entry("\n\n", -0.1, ("\n", -3.1)),
            entry("1", -0.4, ("**", -2.0)),
        ]
    )
    assert_refused_at(far, ":\n\nFirst", token_index=1)
