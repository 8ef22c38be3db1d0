"""Incremental detokenization of a token stream into text deltas.

Byte-level BPE tokenizers split multi-byte UTF-8 characters (emoji, CJK) across tokens:
decoding a token alone yields U+FFFD for the incomplete bytes. The detokenizer therefore
decodes a short sliding window of tokens and only emits text once the window no longer
ends in U+FFFD, i.e. the character is complete. Decoding a window (instead of one token)
also keeps tokenizer-specific spacing right (SentencePiece's leading-space handling),
because each token is decoded with a few tokens of left context.

Cost per step is two decodes of a handful of tokens through the Rust tokenizer; the
window is reset after every emitted delta, so it only grows while a character is held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

DecodeFn = Callable[[list[int]], str]

REPLACEMENT = "\ufffd"
# Prompt tokens used as left context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 5


def make_decode_fn(tokenizer: Any, *, skip_special_tokens: bool = True) -> DecodeFn:
    """A fast `ids -> text` function for a Hugging Face tokenizer.

    Uses the Rust `tokenizers.Tokenizer` directly when there is one: the Python wrapper's
    `decode` adds per-call overhead (cleanup of tokenization spaces, type checks) that
    matters on the per-token path and would also change text between windows.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is not None and hasattr(backend, "decode"):
        decode = backend.decode

        def fast(ids: list[int]) -> str:
            return decode(ids, skip_special_tokens=skip_special_tokens)

        return fast

    def slow(ids: list[int]) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return slow


class IncrementalDetokenizer:
    """Turns token ids, fed in any grouping, into text deltas that never contain a
    partially decoded character.

    `prompt_ids` (optional) gives left context so the first generated token decodes with
    the spacing it has in context; none of the prompt's text is emitted.
    """

    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, decode: DecodeFn, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly "" while a character
        is still incomplete)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._window_text(self._read_offset)
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held at the end of the stream. A character the stream cut in the
        middle (e.g. max_tokens reached inside an emoji) is dropped, not sent as U+FFFD."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._window_text(self._read_offset)
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :].rstrip(REPLACEMENT)

    def _window_text(self, end: int) -> str:
        if end <= self._prefix_offset:
            return ""
        return self._decode(self._ids[self._prefix_offset : end])


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte→printable-character table used by byte-level BPE vocabs."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTexts:
    """Per-token text and bytes for logprobs (OpenAI reports each sampled and top token).

    For byte-level BPE vocabularies the exact bytes of a token are recovered from its
    vocabulary string, so a token holding half an emoji reports its real bytes.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decode = make_decode_fn(tokenizer, skip_special_tokens=False)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self._decode([token_id])
        data = self._bytes(token_id, text)
        if REPLACEMENT in text:
            # Incomplete UTF-8 in one token: name it by its bytes, as OpenAI does.
            text = "".join(f"bytes:\\x{b:02x}" for b in data)
        entry = (text, data)
        if len(self._cache) < 100_000:
            self._cache[token_id] = entry
        return entry

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _unicode_to_byte()
            if isinstance(piece, str) and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(text.encode("utf-8"))
