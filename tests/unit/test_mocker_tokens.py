"""`dynamo.testing.mocker_tokens`: the text a mocker completion streams through the
frontend, whole or resumed elsewhere, is recognised; a token lost or repeated is not.

The prompt below is one the chaos soak sent: the mocker's answer to it ends in two tokens
that each begin a three-byte character (" \\xe2"), which the frontend's detokenizer drops at
the end of the stream rather than sending U+FFFD; the soak counted that answer as wrong
until the expected text did the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.frontend.postprocess.detokenizer import IncrementalDetokenizer, make_decode_fn
from dynamo.testing.mocker_tokens import ExpectedTokens

PROMPT = [
    3073, 2368, 8019, 2507, 5929, 3155, 8020, 8523, 2020, 1418, 7890, 8370,
    3844, 7168, 4636, 1986, 6858, 2400, 8156, 5349, 4661, 7010, 2439, 5523,
]  # fmt: skip
COUNT = 40


@pytest.fixture(scope="module")
def expected(embedded_model: Path) -> ExpectedTokens:
    return ExpectedTokens(embedded_model, "mock")


def streamed(expected: ExpectedTokens, prompt: list[int], tokens: list[int]) -> str:
    """What the frontend streams for `tokens`, one token a chunk."""
    detokenizer = IncrementalDetokenizer(make_decode_fn(expected._tokenizer), prompt)
    return "".join(detokenizer.add([t]) for t in tokens) + detokenizer.flush()


def test_a_stream_ending_inside_a_character_is_recognised(expected: ExpectedTokens) -> None:
    tokens = expected.tokens(PROMPT, COUNT)
    assert "\ufffd" in expected._tokenizer.decode(tokens[-2:])  # the case this is about
    assert expected.migrations(PROMPT, streamed(expected, PROMPT, tokens), COUNT) == 0


def test_a_resumed_stream_is_recognised_and_a_repeated_token_is_not(
    expected: ExpectedTokens,
) -> None:
    tokens = expected.tokens(PROMPT, COUNT)
    cut = 17
    resumed = expected.tokens([*PROMPT, *tokens[:cut]], COUNT - cut)
    # The frontend feeds the continuation's tokens to the same detokenizer.
    text = streamed(expected, PROMPT, [*tokens[:cut], *resumed])
    assert expected.migrations(PROMPT, text, COUNT) == 1
    repeated = streamed(expected, PROMPT, [*tokens[:cut], tokens[cut - 1], *resumed[:-1]])
    assert expected.migrations(PROMPT, repeated, COUNT) is None
