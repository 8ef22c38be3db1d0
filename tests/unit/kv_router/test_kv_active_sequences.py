"""Slot accounting with speculative slots: allocate K ahead, accept 0..K, never leak."""

from __future__ import annotations

import random

import pytest

from dynamo.llm.kv_router.active_sequences import ActiveSequences, speculative_depth
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.multi_worker_sequences import MultiWorkerSequences
from dynamo.llm.protocols import SpeculativeInfo


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def test_allocation_reserves_k_slots_ahead() -> None:
    seqs = ActiveSequences(block_size=16, num_speculative_tokens=3)
    seqs.add_request("a", 64, token_ids=list(range(64)))
    # 64 prompt tokens fill 4 blocks exactly; 3 draft slots need a fifth.
    assert seqs.active_blocks == 5
    plain = ActiveSequences(block_size=16)
    plain.add_request("a", 64, token_ids=list(range(64)))
    assert plain.active_blocks == 4


def test_hand_checked_speculative_steps() -> None:
    """B=4, K=3, 4-token prompt, steps accepting 0, 3, 1 drafts."""
    seqs = ActiveSequences(block_size=4, num_speculative_tokens=3)
    state = seqs.add_request("r", 4, token_ids=[1, 2, 3, 4])
    assert (state.allocated_blocks, state.stored_blocks) == (2, 0)  # ceil(7/4)

    first = seqs.step("r", 0, token_ids=[5])  # all 3 drafts rejected, bonus kept
    assert state.context_len == 5
    assert first.rolled_back_slots == 3
    assert first.allocated_blocks == 2  # ceil(8/4): the rejected slots stay allocated
    assert first.newly_stored_blocks == 1  # only the prompt block is full of accepted tokens
    assert first.newly_stored_hashes == compute_block_hashes([1, 2, 3, 4], 4)

    second = seqs.step("r", 3, token_ids=[6, 7, 8, 9])
    assert state.context_len == 9
    assert second.rolled_back_slots == 0
    assert second.allocated_blocks == 3  # ceil(12/4)
    assert second.newly_stored_blocks == 1  # block [5,6,7,8]; block 3 holds only token 9
    assert second.newly_stored_hashes == compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1:]

    third = seqs.step("r", 1, token_ids=[10, 11])
    assert (state.context_len, third.allocated_blocks, third.newly_stored_blocks) == (11, 4, 0)
    assert state.rolled_back_slots == 3 + 0 + 2
    assert seqs.active_blocks == 4

    assert seqs.free("r")
    assert seqs.active_blocks == 0 and seqs.active_requests == 0


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("block_size", [4, 16])
def test_scripted_speculative_sequence_never_leaks_or_stores_rejected_slots(
    k: int, block_size: int
) -> None:
    rng = random.Random(k * 100 + block_size)
    seqs = ActiveSequences(block_size, num_speculative_tokens=k)
    prompts = {
        f"r{i}": [rng.randrange(1000) for _ in range(rng.randrange(1, 50))] for i in range(4)
    }
    accepted_tokens = {rid: list(p) for rid, p in prompts.items()}
    stored: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        seqs.add_request(rid, len(prompt), token_ids=prompt)
        stored[rid] += seqs.mark_prefill_completed(rid) or []

    for _ in range(40):
        for rid in prompts:
            j = rng.randint(0, k)
            new = [rng.randrange(1000) for _ in range(j + 1)]
            result = seqs.step(rid, j, token_ids=new)
            accepted_tokens[rid] += new
            ctx = len(accepted_tokens[rid])
            state = seqs.get(rid)
            assert state is not None and state.context_len == ctx
            assert result.allocated_blocks == ceil_div(ctx + k, block_size)
            assert result.rolled_back_slots == k - j
            # Stored blocks are exactly those full of accepted tokens, nothing speculative.
            assert state.stored_blocks == ctx // block_size
            stored[rid] += result.newly_stored_hashes or []
            assert stored[rid] == compute_block_hashes(accepted_tokens[rid], block_size)
        expected = sum(
            ceil_div(len(accepted_tokens[r]) + k, block_size) for r in prompts
        )  # random prompts share no block
        assert seqs.active_blocks == expected

    for rid in prompts:
        assert seqs.free(rid)
    assert (seqs.active_blocks, seqs.active_requests, seqs.prefill_tokens) == (0, 0, 0)
    assert seqs.shared_block_count() == 0
    assert not seqs.free("r0"), "freeing twice must not double-release"


def test_accepting_more_than_k_is_rejected() -> None:
    seqs = ActiveSequences(block_size=4, num_speculative_tokens=2)
    seqs.add_request("r", 3, token_ids=[1, 2, 3])
    with pytest.raises(ValueError):
        seqs.step("r", 3)
    with pytest.raises(ValueError):
        seqs.step("r", 1, token_ids=[1])  # two tokens expected


def test_shared_prompt_blocks_count_once_per_worker() -> None:
    seqs = ActiveSequences(block_size=4, num_speculative_tokens=2)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    seqs.add_request("a", 10, token_ids=prompt)
    assert seqs.active_blocks == 3  # ceil(12/4)
    seqs.add_request("b", 10, token_ids=prompt)
    # The two full prompt blocks are shared; each request has its own tail block.
    assert seqs.active_blocks == 4
    assert seqs.potential_blocks(compute_block_hashes(prompt, 4), 10, 2) == 5
    # Sharing only the first block: one pinned block is reused, the second is new.
    diverging = [*prompt[:4], 99, 98, 97, 96, 95, 94]
    assert seqs.potential_blocks(compute_block_hashes(diverging, 4), 10, 2) == 4 + 3 - 1
    seqs.free("a")
    assert seqs.active_blocks == 3
    seqs.free("b")
    assert seqs.active_blocks == 0


def test_prefill_tokens_in_flight() -> None:
    seqs = ActiveSequences(block_size=4)
    seqs.add_request("a", 10, token_ids=list(range(10)), overlap_blocks=2)
    assert seqs.prefill_tokens == 2  # 8 of 10 tokens cached
    seqs.add_request("b", 8, token_ids=list(range(8)), overlap_blocks=2)
    assert seqs.prefill_tokens == 2 + 1  # a fully cached prompt still computes its last token
    new_blocks = seqs.mark_prefill_completed("a")
    assert new_blocks == []  # both full blocks were already cached
    assert seqs.prefill_tokens == 1
    assert seqs.mark_prefill_completed("a") is None  # idempotent
    seqs.free("b")
    assert seqs.prefill_tokens == 0
    assert seqs.load().active_requests == 1


def test_append_tokens_grows_allocation_without_token_ids() -> None:
    seqs = ActiveSequences(block_size=4, num_speculative_tokens=1)
    seqs.add_request("a", 4, block_hashes=compute_block_hashes([1, 2, 3, 4], 4))
    assert seqs.active_blocks == 2
    seqs.mark_prefill_completed("a")
    seqs.append_tokens("a", 4)
    assert seqs.active_blocks == 3  # ceil((8 + 1) / 4)
    result = seqs.step("a", 1)  # content of generated blocks is unknown
    assert result.newly_stored_blocks == 0 and result.newly_stored_hashes == []
    seqs.append_tokens("a", 2)
    assert seqs.get("a").stored_blocks == 3  # type: ignore[union-attr]
    assert seqs.step("a", 0).newly_stored_hashes == []
    seqs.free("a")
    assert seqs.active_blocks == 0


def test_multi_worker_books() -> None:
    books = MultiWorkerSequences()
    books.ensure_worker(1, 4, 0)
    books.ensure_worker(2, 4, 3)
    books.add_request(1, "a", 8, token_ids=list(range(8)))
    books.add_request(2, "b", 8, token_ids=list(range(8)), num_speculative_tokens=3)
    loads = books.loads()
    assert (loads[1].active_blocks, loads[2].active_blocks) == (2, 3)
    assert books.worker_of("b") == 2
    with pytest.raises(ValueError):
        books.add_request(1, "b", 4, token_ids=[1, 2, 3, 4])
    assert books.free("a") and not books.free("a")
    assert books.remove_worker(2) == ["b"]
    assert books.worker_of("b") is None
    assert books.loads()[1].active_blocks == 0


def test_speculative_depth_follows_the_dynamic_schedule() -> None:
    info = SpeculativeInfo(
        method="eagle3", num_speculative_tokens=4, schedule=[[1, 4, 4], [5, 16, 2]]
    )
    assert speculative_depth(info, 1) == 4
    assert speculative_depth(info, 8) == 2
    assert speculative_depth(info, 64) == 2  # beyond the last range: its K carries on
    gappy = SpeculativeInfo(
        method="ngram", num_speculative_tokens=3, schedule=[[1, 2, 5], [9, 9, 0]]
    )
    assert [speculative_depth(gappy, b) for b in (1, 4, 9, 20)] == [3, 3, 0, 0]  # capped at 3
    assert speculative_depth(None, 3) == 0


def test_an_adaptive_workers_reported_k_overrides_its_schedule() -> None:
    info = SpeculativeInfo(
        method="ngram", num_speculative_tokens=3, schedule=[[1, 4, 3], [5, 64, 1]], adaptive=True
    )
    assert speculative_depth(info, 8) == 1  # no report yet: the schedule's
    assert speculative_depth(info, 8, reported=2) == 2
    assert speculative_depth(info, 1, reported=0) == 0
    assert speculative_depth(info, 1, reported=5) == 3  # capped at the static K
    fixed = SpeculativeInfo(method="ngram", num_speculative_tokens=3)
    assert speculative_depth(fixed, 1, reported=0) == 3  # only an adaptive card follows reports


def test_setting_the_speculative_depth_rebooks_every_request_in_flight() -> None:
    seqs = ActiveSequences(block_size=16, num_speculative_tokens=3)
    seqs.add_request("a", 30, token_ids=list(range(30)))  # 30 + 3 tokens: 3 blocks
    seqs.add_request("b", 14, token_ids=list(range(100, 114)), num_speculative_tokens=1)
    assert seqs.active_blocks == 4
    seqs.set_speculative_depth(0)
    assert [seqs.get(r).num_speculative_tokens for r in ("a", "b")] == [0, 0]
    assert seqs.active_blocks == 3  # 30 tokens: 2 blocks; 14: 1
    seqs.set_speculative_depth(4)
    assert seqs.active_blocks == 5  # 34: 3 blocks; 18: 2
    seqs.add_request("c", 12, token_ids=list(range(200, 212)))
    assert seqs.get("c").num_speculative_tokens == 4
    seqs.free("a"), seqs.free("b"), seqs.free("c")
    assert seqs.active_blocks == 0
    with pytest.raises(ValueError):
        seqs.set_speculative_depth(-1)
