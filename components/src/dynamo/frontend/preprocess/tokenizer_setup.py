"""A served model's tokenizer made ready for the frontend: loaded from its local
directory, its EOS ids, no silent truncation, and the fastest thread-safe encoder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamo.llm.protocols import ModelCard


def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """Load a Hugging Face tokenizer from a local directory (never from a hub).

    Slow (imports transformers, parses tokenizer.json): call it from a thread.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def eos_ids(card: ModelCard, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the card (the worker knows the generation config); the tokenizer's
    own EOS only when the card has none."""
    if card.eos_token_ids:
        return tuple(card.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()


def disable_truncation(tokenizer: Any) -> None:
    """A tokenizer.json may carry truncation/padding settings for training; a prompt must
    never be cut silently (the context check reports it instead). Done once, before the
    tokenizer is shared between threads."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    if getattr(backend, "truncation", None) is not None:
        backend.no_truncation()
    if getattr(backend, "padding", None) is not None:
        backend.no_padding()


def make_encode_fn(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """`(text, add_special_tokens) -> ids` through the Rust tokenizer when available: it is
    faster and, unlike the Python wrapper, mutates no truncation state, so concurrent
    calls from threads are safe."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        # The batch-of-one "fast" entry point skips computing character offsets, which
        # nothing here reads: a third less time for a 256-token prompt (0.45 against
        # 0.68 ms measured on the embedded model's tokenizer), the same ids.
        encode_batch = backend.encode_batch_fast

        def fastest(text: str, add_special_tokens: bool) -> list[int]:
            return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

        return fastest
    if backend is not None and hasattr(backend, "encode"):

        def fast(text: str, add_special_tokens: bool) -> list[int]:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids

        return fast

    def slow(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    return slow
