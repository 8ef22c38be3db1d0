"""Incremental detokenization with a real byte-level BPE tokenizer (the tiny test one,
which splits every multi-byte character into one token per byte)."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo.frontend.postprocess.detokenizer import (
    IncrementalDetokenizer,
    TokenTexts,
    make_decode_fn,
)

MIXED = "Smile 😀 then 你好世界, naïve café 🎉🎉 done."


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def _split_char_tokens(tokenizer: Any, ids: list[int]) -> list[int]:
    """Tokens that decode to U+FFFD alone: they carry part of a multi-byte character."""
    decode = make_decode_fn(tokenizer)
    return [t for t in ids if "\ufffd" in decode([t])]


@pytest.mark.parametrize("group", [1, 2, 3, 5])
def test_emoji_and_cjk_split_across_tokens_never_leak_replacement_chars(
    tokenizer: Any, group: int
) -> None:
    ids = _encode(tokenizer, MIXED)
    assert _split_char_tokens(tokenizer, ids), "the text must split characters across tokens"
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer))
    deltas = [detok.add(ids[i : i + group]) for i in range(0, len(ids), group)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MIXED


def test_incomplete_character_is_held_until_its_last_byte(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "😀")
    assert len(ids) >= 2  # the emoji's bytes are spread over several tokens
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer))
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"


def test_flush_drops_a_character_cut_by_the_end_of_the_stream(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "ok 你")
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer))
    text = detok.add(ids[:-1])
    assert text + detok.flush() == "ok "


def test_prompt_context_gives_first_token_its_leading_space(tokenizer: Any) -> None:
    prompt = _encode(tokenizer, "Say")
    completion = _encode(tokenizer, "Say hello world")[len(prompt) :]
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer), prompt)
    text = "".join(detok.add([t]) for t in completion) + detok.flush()
    assert text == " hello world"


def test_special_tokens_are_skipped_or_kept_on_request(tokenizer: Any) -> None:
    ids = [*_encode(tokenizer, "Hi"), tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(make_decode_fn(tokenizer, skip_special_tokens=True))
    keep = IncrementalDetokenizer(make_decode_fn(tokenizer, skip_special_tokens=False))
    assert skip.add(ids) + skip.flush() == "Hi"
    assert keep.add(ids) + keep.flush() == "Hi" + tokenizer.eos_token


def test_token_texts_report_exact_bytes_of_partial_characters(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    ids = _encode(tokenizer, "😀")
    data = b"".join(bytes(texts.get(t)[1]) for t in ids)
    assert data == "😀".encode()
    partial_text, partial_bytes = texts.get(ids[0])
    assert partial_text == "".join(f"bytes:\\x{b:02x}" for b in partial_bytes)
    (whole_word,) = _encode(tokenizer, " hello")  # one token: a word the tokenizer knows
    assert texts.get(whole_word) == (" hello", list(b" hello"))
