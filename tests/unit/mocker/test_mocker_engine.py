"""`MockEngine`: scheduling, prefix caching, speculative slots, cancellation, outputs."""

from __future__ import annotations

import asyncio
import re
import time

import msgspec
import pytest
from mocker_support import (
    EOS,
    VOCAB,
    EventLog,
    collect,
    config,
    prompt,
    request,
    tokens_of,
)

from dynamo.llm.kv_router.hashing import compute_block_hashes, num_blocks_spanned
from dynamo.llm.protocols import (
    FinishReason,
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    OutputOptions,
    SamplingOptions,
)
from dynamo.mocker import AcceptanceModel, InvalidRequest, MockEngine, TimingModel
from dynamo.mocker.acceptance import AcceptanceChange
from dynamo.mocker.backend import MockerBackend


async def started(**overrides: object) -> tuple[MockEngine, EventLog]:
    log = EventLog()
    engine = await MockEngine(config(**overrides), on_kv_events=log).start()
    return engine, log


def _context_len(engine: MockEngine, request_id: str) -> int:
    state = engine.sequences.get(request_id)
    assert state is not None
    return state.context_len


async def test_runs_to_max_tokens_one_token_per_step_without_speculation() -> None:
    engine, _ = await started()
    try:
        outputs = await collect(engine, request("a", prompt(10), max_tokens=7))
    finally:
        await engine.stop()
    assert [len(o.token_ids) for o in outputs] == [1] * 7
    final = outputs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert all(o.finish_reason is None for o in outputs[:-1])
    usage = final.completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 7, 17)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert final.spec_decode_stats is None
    # Generated tokens are words of the prompt: they decode to text.
    assert set(tokens_of(outputs)) <= set(prompt(10))
    assert (engine.pool.active_blocks, engine.num_running, engine.sequences.active_requests) == (
        0,
        0,
        0,
    )


async def test_tokens_are_deterministic_and_independent_of_speculation() -> None:
    plain, _ = await started()
    spec, _ = await started(num_speculative_tokens=3)
    try:
        a = tokens_of(await collect(plain, request("a", prompt(12), max_tokens=20)))
        b = tokens_of(await collect(spec, request("b", prompt(12), max_tokens=20)))
        seeded = tokens_of(await collect(plain, request("c", prompt(12), max_tokens=20, seed=7)))
        seeded_again = tokens_of(await collect(spec, request("d", prompt(12), 20, seed=7)))
    finally:
        await plain.stop()
        await spec.stop()
    assert a == b
    assert seeded == seeded_again != a


async def test_speculative_steps_yield_one_to_k_plus_one_tokens_with_stats() -> None:
    engine, _ = await started(
        num_speculative_tokens=3, acceptance=AcceptanceModel.from_rates([0.6], 3)
    )
    try:
        outputs = await collect(engine, request("a", prompt(9), max_tokens=60))
    finally:
        await engine.stop()
    sizes = [len(o.token_ids) for o in outputs]
    assert sizes[0] == 1  # the prefill step samples one token, drafting starts after it
    assert all(1 <= n <= 4 for n in sizes) and sum(sizes) == 60
    assert any(n > 1 for n in sizes) and any(n < 4 for n in sizes[:-1])
    stats = outputs[-1].spec_decode_stats
    assert stats is not None and stats.acceptance_histogram is not None
    assert stats.num_drafts == len(outputs) - 1 == sum(stats.acceptance_histogram)
    assert stats.num_draft_tokens == 3 * stats.num_drafts
    assert stats.num_accepted_tokens == sum(j * n for j, n in enumerate(stats.acceptance_histogram))
    # Every step but the last (possibly cut by max_tokens) produced accepted + 1 tokens.
    assert sum(sizes[1:-1]) <= stats.num_accepted_tokens + stats.num_drafts
    assert engine.counters.spec_drafts == stats.num_drafts


async def test_an_acceptance_change_in_force_replaces_the_initial_rates() -> None:
    """`--acceptance-rate-after 0:0`: every draft accepted at first, none from 0 s on."""
    engine, _ = await started(
        num_speculative_tokens=3,
        acceptance=AcceptanceModel.from_rates([1.0], 3),
        acceptance_changes=(AcceptanceChange(0.0, AcceptanceModel.from_rates([0.0], 3)),),
    )
    try:
        outputs = await collect(engine, request("a", prompt(9), max_tokens=20))
    finally:
        await engine.stop()
    assert [len(o.token_ids) for o in outputs] == [1] * 20
    stats = outputs[-1].spec_decode_stats
    assert stats is not None and stats.num_drafts == 19 and stats.num_accepted_tokens == 0


async def test_a_request_that_turns_speculation_off_decodes_one_token_a_step() -> None:
    """`"speculative_decoding": false` on a speculating engine: no drafts for that request
    (one token a step, statistics of zero drafts), the same tokens; others speculate."""
    engine, _ = await started(
        num_speculative_tokens=3, acceptance=AcceptanceModel.from_rates([0.9], 3)
    )
    off = request("off", prompt(9), max_tokens=30)
    off.sampling_options = SamplingOptions(speculative_decoding=False)
    try:
        plain = await collect(engine, off)
        speculated = await collect(engine, request("on", prompt(9), max_tokens=30))
    finally:
        await engine.stop()
    assert [len(o.token_ids) for o in plain] == [1] * 30
    stats = plain[-1].spec_decode_stats
    assert stats is not None and (stats.num_drafts, stats.num_draft_tokens) == (0, 0)
    assert len(speculated) < 30 and tokens_of(speculated) == tokens_of(plain)


async def test_rejected_speculative_slots_are_never_stored() -> None:
    """After every step, each block announced as stored is a full block of the accepted
    context (prompt + tokens streamed so far), and the request holds exactly
    ceil((context + K) / B) blocks: K slots ahead, rolled-back drafts included."""
    k, block = 4, 4
    engine, log = await started(
        num_speculative_tokens=k, acceptance=AcceptanceModel.from_rates([0.5], k)
    )
    tokens = prompt(10)
    rolled_back = 0
    try:
        async for output in engine.generate(request("a", tokens, max_tokens=50)):
            tokens = tokens + output.token_ids
            if output.finish_reason is not None:
                break
            accepted_chain = set(compute_block_hashes(tokens, block))
            stored = [h for e in log.events if isinstance(e, KvBlockStored) for h in e.block_hashes]
            assert set(stored) <= accepted_chain
            assert len(stored) == len(tokens) // block  # every full accepted block, no more
            assert engine.pool.active_blocks == num_blocks_spanned(len(tokens) + k, block)
            state = engine.sequences.get("a")
            assert state is not None
            rolled_back = state.rolled_back_slots
    finally:
        await engine.stop()
    assert rolled_back > 0  # the test did see rejected drafts
    assert engine.pool.active_blocks == 0


async def test_shared_prefix_is_a_cache_hit_reported_as_cached_tokens() -> None:
    engine, log = await started()
    system = prompt(16)  # 4 full blocks of 4
    try:
        first = await collect(engine, request("a", [*system, 500, 501], max_tokens=2))
        second = await collect(engine, request("b", [*system, 600, 601, 602], max_tokens=2))
        repeat = await collect(engine, request("c", prompt(16), max_tokens=2))
    finally:
        await engine.stop()
    cached = [
        o[-1].completion_usage.prompt_tokens_details.cached_tokens for o in (first, second, repeat)
    ]  # type: ignore[union-attr]
    # A fully cached prompt still recomputes its last block (the engine needs logits).
    assert cached == [0, 16, 12]
    assert engine.counters.cached_prompt_tokens == 28
    assert not any(isinstance(e, KvBlockRemoved) for e in log.events)


@pytest.mark.parametrize("step_budget", [64, 12])
async def test_a_prefix_scheduled_in_the_same_step_or_the_last_is_already_a_hit(
    step_budget: int,
) -> None:
    """As in vLLM 0.32, a prompt's blocks are cached when a step schedules them, not when
    the prefill ends: two requests of one prompt sent together, the second admitted in
    the first's step (budget 64) or in its second and last prefill step (budget 12: 12
    prompt tokens, then 4 beside the second's), find its blocks cached (all but the last
    block, which is always recomputed)."""
    engine, log = await started(max_num_batched_tokens=step_budget)
    shared = prompt(16)
    try:
        outputs = await asyncio.gather(
            collect(engine, request("a", shared, max_tokens=2)),
            collect(engine, request("b", shared, max_tokens=2)),
        )
    finally:
        await engine.stop()
    cached = [o[-1].completion_usage.prompt_tokens_details.cached_tokens for o in outputs]  # type: ignore[union-attr]
    assert cached == [0, 12]
    stored = [h for e in log.events if isinstance(e, KvBlockStored) for h in e.block_hashes]
    assert stored[:4] == compute_block_hashes(shared, 4), "each block announced once"
    assert len(stored) == len(set(stored))


@pytest.mark.parametrize(("method", "reused_blocks"), [("mocker", 4), ("eagle3", 3)])
async def test_an_eagle_family_worker_recomputes_the_last_block_of_a_hit(
    method: str, reused_blocks: int
) -> None:
    """As vLLM does for drafters reading the target's hidden states: one block less of a
    cached prefix is reused, and the card says so for the router."""
    backend = MockerBackend(config(num_speculative_tokens=2), speculative_method=method)
    description = await backend.start()
    shared = prompt(16)
    try:
        await collect(backend.engine, request("a", [*shared, 500], max_tokens=2))
        again = await collect(backend.engine, request("b", [*shared, 600], max_tokens=2))
    finally:
        await backend.stop()
    usage = again[-1].completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == reused_blocks * 4
    assert description.speculative is not None
    assert description.speculative.drops_last_prefix_block is (method == "eagle3")


async def test_lru_eviction_announces_removals_and_loses_the_hit() -> None:
    # 12 blocks: a 32-token prompt + 4 outputs holds 9; a second one must evict.
    engine, log = await started(num_gpu_blocks=12, max_model_len=40)
    a, b = prompt(32, 100), prompt(32, 300)
    a_hashes = compute_block_hashes(a, 4)
    try:
        await collect(engine, request("a", a, max_tokens=4))
        await collect(engine, request("b", b, max_tokens=4))
        again = await collect(engine, request("a2", a, max_tokens=1))
    finally:
        await engine.stop()
    removed = [h for e in log.events if isinstance(e, KvBlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) & set(a_hashes)
    assert engine.pool.evictions == len(removed)
    usage = again[-1].completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens < 28  # part of a's prefix is gone


async def test_max_num_seqs_bounds_the_running_batch() -> None:
    engine, _ = await started(max_num_seqs=2)
    seen: list[int] = []

    async def run(i: int) -> list[int]:
        tokens: list[int] = []
        async for output in engine.generate(request(f"r{i}", prompt(6, 100 + 10 * i), 5)):
            seen.append(engine.num_running)
            tokens += output.token_ids
        return tokens

    try:
        results = await asyncio.gather(*(run(i) for i in range(5)))
    finally:
        await engine.stop()
    assert [len(r) for r in results] == [5] * 5
    assert max(seen) == 2
    assert engine.counters.finished == {"length": 5}


async def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    engine, _ = await started(max_num_batched_tokens=16)
    try:
        await collect(engine, request("a", prompt(60), max_tokens=1))
    finally:
        await engine.stop()
    assert engine.counters.steps == 4  # 60 prompt tokens, 16 per step
    assert engine.counters.computed_prefill_tokens == 60


async def test_preemption_recomputes_and_keeps_the_output() -> None:
    alone, _ = await started()
    tight, _ = await started(num_gpu_blocks=20, max_model_len=64, num_speculative_tokens=2)
    try:
        expected = [
            tokens_of(await collect(alone, request(f"x{i}", prompt(20, 100 + 50 * i), 40)))
            for i in range(3)
        ]
        got = await asyncio.gather(
            *(collect(tight, request(f"y{i}", prompt(20, 100 + 50 * i), 40)) for i in range(3))
        )
    finally:
        await alone.stop()
        await tight.stop()
    assert [tokens_of(g) for g in got] == expected
    assert tight.counters.preemptions > 0
    assert tight.pool.active_blocks == 0 and tight.pool.private_blocks == 0


async def test_cancelling_a_stream_frees_its_blocks_at_once() -> None:
    engine, _ = await started(timing=TimingModel(decode_ms_per_step=2.0))
    try:
        stream = engine.generate(request("a", prompt(18), max_tokens=100))
        first = await stream.__anext__()
        assert first.token_ids and engine.num_running == 1
        # A loaded test host may consume the first output a step or two late.
        context = _context_len(engine, "a")
        assert context >= 19
        assert engine.pool.active_blocks == num_blocks_spanned(context, 4)
        await stream.aclose()
        assert engine.num_running == 0
        assert engine.pool.active_blocks == 0 and engine.sequences.active_requests == 0
        # Every full block of the accepted context stays cached, the prompt's included.
        assert engine.pool.evictable_blocks == context // 4 >= 4
        assert engine.counters.finished == {"cancelled": 1}
        assert not engine.abort("a")
    finally:
        await engine.stop()


async def test_abort_of_a_waiting_request() -> None:
    engine, _ = await started(max_num_seqs=1, timing=TimingModel(decode_ms_per_step=10.0))
    try:
        busy = engine.generate(request("busy", prompt(8), max_tokens=100))
        await busy.__anext__()
        queued = asyncio.ensure_future(collect(engine, request("queued", prompt(8, 300))))
        await asyncio.sleep(0.01)
        assert engine.num_waiting == 1
        assert engine.abort("queued")
        outputs = await queued
        assert outputs[-1].finish_reason is FinishReason.CANCELLED
        assert engine.num_waiting == 0
        await busy.aclose()
    finally:
        await engine.stop()


async def test_eos_stop_tokens_min_tokens_and_ignore_eos() -> None:
    engine, _ = await started(eos_probability=1.0)
    try:
        eos = await collect(engine, request("eos", prompt(8)))
        late = await collect(engine, request("min", prompt(8), min_tokens=3))
        ignored = await collect(engine, request("ign", prompt(8), max_tokens=5, ignore_eos=True))
        stop = await collect(
            engine, request("stop", [7] * 8, max_tokens=5, ignore_eos=True, stop_token_ids=[7])
        )
        stop_later = await collect(
            engine,
            request("stop2", [7] * 8, 5, ignore_eos=True, stop_token_ids=[7], min_tokens=5),
        )
    finally:
        await engine.stop()
    assert tokens_of(eos) == [EOS] and eos[-1].finish_reason is FinishReason.EOS
    assert len(tokens_of(late)) == 4 and tokens_of(late)[-1] == EOS
    assert len(tokens_of(ignored)) == 5 and ignored[-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(stop) == [7] and stop[-1].finish_reason is FinishReason.STOP
    assert stop[-1].stop_reason == 7
    # With only the stop token to draw from, min_tokens still lets 5 tokens through.
    assert len(tokens_of(stop_later)) == 5


async def test_bad_requests_are_refused_as_invalid_before_any_output() -> None:
    engine, _ = await started(max_logprobs=5)
    bad = {
        "context length": request("a", prompt(128)),
        "out of vocabulary": request("b", [5, 99999]),
        "max_tokens must be at least 1": request("c", prompt(4), max_tokens=0),
        "prompt is empty": request("d", []),
        "top_p must be in (0, 1]": msgspec.structs.replace(
            request("e", prompt(4)), sampling_options=SamplingOptions(top_p=0.0)
        ),
        "greater than max allowed: 5": request("f", prompt(4), logprobs=6),
        "Requested prompt logprobs of 6, which is greater than max allowed: 5": (
            msgspec.structs.replace(
                request("k", prompt(4)), output_options=OutputOptions(prompt_logprobs=6)
            )
        ),
        f"Requested prompt logprobs of {VOCAB}": msgspec.structs.replace(
            request("l", prompt(4)), output_options=OutputOptions(prompt_logprobs=-1)
        ),
        "allowed_token_ids contains out-of-vocab token id!": msgspec.structs.replace(
            request("h", prompt(4)), sampling_options=SamplingOptions(allowed_token_ids=[99999])
        ),
        "`logit_bias` cannot be emulated by the mocker": msgspec.structs.replace(
            request("i", prompt(4)), sampling_options=SamplingOptions(logit_bias={5: 1.0})
        ),
        "`bad_words` cannot be emulated by the mocker": msgspec.structs.replace(
            request("j", prompt(4)), sampling_options=SamplingOptions(bad_words=["x"])
        ),
        "`thinking_token_budget` cannot be emulated by the mocker": msgspec.structs.replace(
            request("m", prompt(4)), sampling_options=SamplingOptions(thinking_token_budget=4)
        ),
    }
    try:
        for reason, req in bad.items():
            with pytest.raises(InvalidRequest, match=re.escape(reason)):
                await collect(engine, req)
        assert engine.counters.requests == 0  # none was admitted
        assert tokens_of(await collect(engine, request("g", prompt(4), logprobs=5)))
    finally:
        await engine.stop()


async def test_allowed_token_ids_are_the_only_tokens_generated() -> None:
    engine, _ = await started()
    allowed = [300, 301, 302]
    try:
        req = msgspec.structs.replace(
            request("a", prompt(6), max_tokens=24),
            sampling_options=SamplingOptions(allowed_token_ids=allowed),
        )
        tokens = tokens_of(await collect(engine, req))
    finally:
        await engine.stop()
    assert tokens and set(tokens) <= set(allowed)


async def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    engine, _ = await started(max_model_len=24)
    try:
        outputs = await collect(engine, request("a", prompt(20), max_tokens=None))
    finally:
        await engine.stop()
    assert len(tokens_of(outputs)) == 4 and outputs[-1].finish_reason is FinishReason.LENGTH


async def test_clear_kv_blocks_is_refused_while_busy_and_announced_when_done() -> None:
    engine, log = await started(timing=TimingModel(decode_ms_per_step=2.0))
    try:
        stream = engine.generate(request("a", prompt(12), max_tokens=50))
        await stream.__anext__()
        assert not engine.clear_kv_blocks()
        context = _context_len(engine, "a")
        await stream.aclose()
        assert engine.pool.cached_blocks == context // 4 >= 3
        assert engine.clear_kv_blocks()
    finally:
        await engine.stop()
    assert log.events[-1] == KvAllCleared()
    assert engine.pool.cached_blocks == 0


async def test_logprobs_when_asked() -> None:
    engine, _ = await started()
    try:
        outputs = await collect(engine, request("a", prompt(6), max_tokens=2, logprobs=2))
    finally:
        await engine.stop()
    entries = [lp for o in outputs for lp in o.log_probs or []]
    assert [e.token_id for e in entries] == tokens_of(outputs)
    assert all(e.top and len(e.top) == 3 and e.top[0].token_id == e.token_id for e in entries)


async def test_prompt_logprobs_have_vllms_shape_on_the_first_output() -> None:
    engine, _ = await started()
    tokens = prompt(6)
    req = msgspec.structs.replace(
        request("a", tokens, max_tokens=3), output_options=OutputOptions(prompt_logprobs=2)
    )
    try:
        outputs = await collect(engine, req)
    finally:
        await engine.stop()
    positions = outputs[0].prompt_logprobs
    assert positions is not None and len(positions) == len(tokens) and positions[0] is None
    for token, position in zip(tokens[1:], positions[1:], strict=True):
        assert position is not None and len(position) == 3
        assert position[0].token_id == token
        assert [entry.rank for entry in position] == [1, 2, 3]
    assert all(o.prompt_logprobs is None for o in outputs[1:])


async def test_logprob_token_ids_are_reported_in_place_of_the_top_ones() -> None:
    engine, _ = await started()
    chosen = [300, 301]
    req = msgspec.structs.replace(
        request("a", prompt(6), max_tokens=3),
        output_options=OutputOptions(logprob_token_ids=chosen),
    )
    bad = msgspec.structs.replace(
        request("b", prompt(6)), output_options=OutputOptions(logprob_token_ids=[VOCAB])
    )
    try:
        outputs = await collect(engine, req)
        with pytest.raises(InvalidRequest, match="contain out-of-vocab token ids"):
            await collect(engine, bad)
    finally:
        await engine.stop()
    entries = [lp for o in outputs for lp in o.log_probs or []]
    assert [e.token_id for e in entries] == tokens_of(outputs)
    for entry in entries:
        assert [t.token_id for t in entry.top or []] == list(
            dict.fromkeys([entry.token_id, *chosen])
        )


async def test_load_metrics_count_speculative_slots() -> None:
    engine, _ = await started(num_speculative_tokens=3, timing=TimingModel(decode_ms_per_step=2.0))
    try:
        stream = engine.generate(request("a", prompt(16), max_tokens=100))
        await stream.__anext__()
        metrics = engine.load_metrics(42)
        context = _context_len(engine, "a")
        assert metrics.worker_id == 42 and metrics.active_requests == 1
        assert metrics.active_blocks == num_blocks_spanned(context + 3, 4)
        assert metrics.total_blocks == 64
        assert abs(metrics.kv_usage - metrics.active_blocks / 64) < 1e-9
        await stream.aclose()
    finally:
        await engine.stop()


async def test_load_watchers_hear_of_every_step_and_abort_and_nothing_when_idle() -> None:
    engine, _ = await started(timing=TimingModel(decode_ms_per_step=2.0))
    calls: list[int] = []
    engine.watch_load(lambda: calls.append(engine.counters.steps))
    try:
        await asyncio.sleep(0.05)
        assert calls == [], "an idle engine has no load to report"
        await collect(engine, request("a", prompt(4), max_tokens=5))
        assert calls == list(range(1, engine.counters.steps + 1)), "after each step"
        stream = engine.generate(request("b", prompt(4), max_tokens=100))
        await stream.__anext__()
        before = len(calls)
        assert engine.abort("b")
        assert len(calls) == before + 1, "an abort frees blocks between steps"
        await stream.aclose()
    finally:
        await engine.stop()


async def test_step_time_follows_the_timing_model() -> None:
    # 10 decode steps of >= 5 ms each (1 prefill + 9 decodes at batch size 1).
    engine, _ = await started(timing=TimingModel(decode_ms_per_step=5.0))
    try:
        begin = time.monotonic()
        await collect(engine, request("a", prompt(4), max_tokens=10))
        elapsed = time.monotonic() - begin
    finally:
        await engine.stop()
    assert elapsed >= 0.045


async def test_stop_cancels_requests_in_flight() -> None:
    engine, _ = await started(timing=TimingModel(decode_ms_per_step=2.0))
    stream = engine.generate(request("a", prompt(8), max_tokens=100))
    await stream.__anext__()
    await engine.stop()
    rest = [o async for o in stream]
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert engine.pool.active_blocks == 0
