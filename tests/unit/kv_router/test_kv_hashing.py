"""Content hashes: one per *full* block, chained, and equal to the documented formula."""

from __future__ import annotations

import hashlib

import pytest

from dynamo.llm.kv_router.hashing import (
    HASH_PERSON,
    compute_block_hashes,
    hash_block,
    num_blocks_spanned,
    num_full_blocks,
)

B = 4


def _spec_hash(parent: int | None, tokens: list[int]) -> int:
    """The formula in the module docstring, written out independently."""
    parent_bytes = bytes(8) if parent is None else parent.to_bytes(8, "little")
    data = parent_bytes + b"".join(t.to_bytes(4, "little") for t in tokens)
    return int.from_bytes(
        hashlib.blake2b(data, digest_size=8, person=HASH_PERSON).digest(), "little"
    )


def test_only_full_blocks_are_hashed() -> None:
    tokens = list(range(10))  # 2 full blocks of 4 + a partial block of 2
    hashes = compute_block_hashes(tokens, B)
    assert len(hashes) == 2
    assert compute_block_hashes(tokens[:3], B) == []
    # Filling the partial block up to (but not including) its last token changes nothing.
    assert compute_block_hashes([*tokens, 10], B) == hashes
    # Completing it adds exactly one hash and keeps the prefix.
    longer = compute_block_hashes([*tokens, 10, 11], B)
    assert longer[:2] == hashes and len(longer) == 3


def test_hashes_follow_the_documented_formula_and_chain() -> None:
    tokens = [7, 1, 2**32 - 1, 0, 5, 6, 7, 8]
    h0, h1 = compute_block_hashes(tokens, B)
    assert h0 == _spec_hash(None, tokens[:4]) == hash_block(None, tokens[:4])
    assert h1 == _spec_hash(h0, tokens[4:]) == hash_block(h0, tokens[4:])


def test_each_hash_identifies_the_whole_prefix() -> None:
    a = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], B)
    b = compute_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], B)
    assert a[0] != b[0]
    assert a[1] != b[1], "same second block under a different prefix must differ"


def test_parent_hash_continues_a_chain() -> None:
    tokens = list(range(100, 116))
    full = compute_block_hashes(tokens, B)
    assert compute_block_hashes(tokens[8:], B, parent_hash=full[1]) == full[2:]


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        compute_block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        compute_block_hashes([-1, 2, 3, 4], B)
    with pytest.raises(ValueError):
        compute_block_hashes([2**32, 2, 3, 4], B)
    with pytest.raises(ValueError):
        hash_block(2**64, [1, 2, 3, 4])


def test_block_counting_helpers() -> None:
    assert num_full_blocks(9, B) == 2
    assert num_blocks_spanned(9, B) == 3
    assert num_blocks_spanned(8, B) == 2
