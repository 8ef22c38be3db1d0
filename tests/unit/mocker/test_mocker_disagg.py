"""Disaggregated serving in the mocker: a prefill worker's handoff, a decode worker that
loads the prompt's KV by (simulated) transfer instead of computing it, and the fallbacks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
from mocker_support import FAST, EventLog, collect, config, prompt, request, tokens_of

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.protocols import (
    FinishReason,
    KvBlockStored,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    WorkerType,
)
from dynamo.llm.worker import DEFAULT_MIGRATION_LIMIT
from dynamo.mocker import MockEngine, TimingModel
from dynamo.mocker.args import build_parser, parse_args
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.handoff import SCHEMA, KvHandoff
from dynamo.runtime import Context
from dynamo.runtime.cli import ConfigError

BLOCK = 4  # mocker_support's block size


def with_handoff(req: PreprocessedRequest, **overrides: object) -> PreprocessedRequest:
    """`req` as the frontend sends its decode leg after a mocker prefill worker's answer."""
    params = KvHandoff("prefill-engine", len(req.token_ids), BLOCK).to_params()
    params.update(overrides)
    return msgspec.structs.replace(req, prefill_result=PrefillResult(disaggregated_params=params))


async def started(**overrides: object) -> tuple[MockEngine, EventLog]:
    log = EventLog()
    engine = await MockEngine(config(**overrides), on_kv_events=log).start()
    return engine, log


def stored_hashes(log: EventLog) -> list[int]:
    return [h for e in log.events if isinstance(e, KvBlockStored) for h in e.block_hashes]


async def test_a_transferred_prompt_is_not_computed_but_cached_and_announced() -> None:
    engine, log = await started()
    tokens = prompt(18)  # 4 full blocks and a partial one
    try:
        outputs = await collect(engine, with_handoff(request("d", tokens, max_tokens=5)))
    finally:
        await engine.stop()
    c = engine.counters
    assert (c.computed_prefill_tokens, c.transferred_prompt_tokens, c.kv_transfers) == (0, 18, 1)
    assert c.cached_prompt_tokens == 18 and c.kv_transfers_refused == 0
    # It decodes as usual: every token from a decode step, the first one included.
    assert len(tokens_of(outputs)) == 5 and outputs[-1].finish_reason is FinishReason.LENGTH
    usage = outputs[-1].completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 18  # served without computing
    # The prompt's full blocks are cached here and announced, as a computed prefill's.
    assert stored_hashes(log)[:4] == compute_block_hashes(tokens, BLOCK)
    assert engine.pool.active_blocks == 0


async def test_same_tokens_as_an_aggregated_engine() -> None:
    engine, _ = await started()
    try:
        local = tokens_of(await collect(engine, request("a", prompt(10), max_tokens=6)))
        engine.clear_kv_blocks()
        loaded = await collect(engine, with_handoff(request("d", prompt(10), max_tokens=6)))
    finally:
        await engine.stop()
    assert tokens_of(loaded) == local


async def test_ttft_includes_the_transfer_and_no_prefill_time() -> None:
    # Prefill would cost 50 ms per token (1 s for this prompt): not paid. The transfer
    # costs 60 ms + 1 ms per token (80 ms), then one 1 ms decode step.
    timing = TimingModel(
        prefill_ms_per_token=50.0,
        decode_ms_per_step=1.0,
        decode_ms_per_token=0.0,
        kv_transfer_overhead_ms=60.0,
        kv_transfer_ms_per_token=1.0,
        quantum_ms=0,
    )
    assert timing.transfer_seconds(20) == pytest.approx(0.080)
    engine, _ = await started(timing=timing)
    try:
        began = time.monotonic()
        stream = engine.generate(with_handoff(request("d", prompt(20), max_tokens=2)))
        first = await anext(stream)
        ttft = time.monotonic() - began
        assert engine.num_waiting == 0 and engine.num_running == 1
        async for _ in stream:
            pass
    finally:
        await engine.stop()
    assert first.token_ids
    assert 0.080 <= ttft < 0.800, ttft
    assert engine.counters.computed_prefill_tokens == 0


async def test_a_cached_prefix_is_not_transferred_again() -> None:
    engine, log = await started()
    shared = prompt(12)  # 3 blocks
    try:
        await collect(engine, request("warm", shared, max_tokens=1))
        computed_before = engine.counters.computed_prefill_tokens
        log.events.clear()
        tokens = shared + prompt(9, offset=300)
        outputs = await collect(engine, with_handoff(request("d", tokens, max_tokens=3)))
    finally:
        await engine.stop()
    c = engine.counters
    assert c.computed_prefill_tokens == computed_before == 12
    assert c.transferred_prompt_tokens == 9  # the uncached rest only
    usage = outputs[-1].completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 21  # 12 local hits + 9 transferred
    # Only the transferred blocks are announced now: the shared ones were already.
    new = stored_hashes(log)
    assert new[:2] == compute_block_hashes(tokens, BLOCK)[3:5]


async def test_without_prefill_result_a_decode_engine_prefills_itself() -> None:
    engine, log = await started()
    try:
        outputs = await collect(engine, request("d", prompt(10), max_tokens=3))
    finally:
        await engine.stop()
    c = engine.counters
    assert (c.computed_prefill_tokens, c.transferred_prompt_tokens, c.kv_transfers) == (10, 0, 0)
    assert len(tokens_of(outputs)) == 3 and stored_hashes(log)


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt_tokens": 99},  # about another prompt
        {"block_size": 16},  # blocks laid out unlike this engine's
        {"kv_transfer": "nixl"},  # not a mocker's
    ],
)
async def test_a_handoff_the_engine_cannot_take_is_prefilled_locally(
    overrides: dict[str, object],
) -> None:
    engine, _ = await started()
    try:
        outputs = await collect(engine, with_handoff(request("d", prompt(10), 3), **overrides))
    finally:
        await engine.stop()
    c = engine.counters
    assert (c.computed_prefill_tokens, c.transferred_prompt_tokens) == (10, 0)
    assert (c.kv_transfers, c.kv_transfers_refused) == (0, 1)
    assert outputs[-1].finish_reason is FinishReason.LENGTH


async def test_aborting_during_the_transfer_frees_its_blocks() -> None:
    slow = TimingModel(kv_transfer_overhead_ms=10_000.0, quantum_ms=0)
    engine, _ = await started(timing=slow)
    try:
        stream = engine.generate(with_handoff(request("d", prompt(10), max_tokens=3)))
        pending = asyncio.ensure_future(anext(stream))
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.num_waiting == 1 and engine.pool.active_blocks > 0
        assert engine.load_metrics(1).waiting_requests == 1
        assert engine.abort("d")
        final = await pending
        await stream.aclose()
    finally:
        await engine.stop()
    assert final.finish_reason is FinishReason.CANCELLED
    assert engine.pool.active_blocks == 0 and engine.num_waiting == 0
    assert engine.counters.kv_transfers == 0


def context(request_id: str) -> Context:
    return Context(request_id, 1)


async def served(backend: MockerBackend, req: PreprocessedRequest) -> list[LLMEngineOutput]:
    await backend.start()
    try:
        return [o async for o in backend.generate(req, context(req.request_id))]
    finally:
        await backend.stop()


async def test_a_prefill_worker_answers_with_its_handoff() -> None:
    backend = MockerBackend(config(), speculative_method="mocker", worker_type=WorkerType.PREFILL)
    leg = msgspec.structs.replace(
        request("p", prompt(10), max_tokens=50), kv_transfer_params={"do_remote_decode": True}
    )
    outputs = await served(backend, leg)
    final = outputs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert final.token_ids == []  # the decode worker produces the first token
    assert final.disaggregated_params == {
        "kv_transfer": SCHEMA,
        "engine_id": backend.engine_id,
        "prompt_tokens": 10,
        "block_size": BLOCK,
        "do_remote_prefill": True,
    }
    assert KvHandoff.from_params(final.disaggregated_params) == KvHandoff(
        backend.engine_id, 10, BLOCK
    )
    usage = final.completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (10, 1)  # forced to one token
    c = backend.engine.counters
    assert (c.computed_prefill_tokens, c.generated_tokens) == (10, 1)


async def test_prefill_then_decode_backends_hand_the_prompt_over() -> None:
    prefill = MockerBackend(config(), speculative_method="mocker", worker_type=WorkerType.PREFILL)
    decode = MockerBackend(config(), speculative_method="mocker", worker_type=WorkerType.DECODE)
    req = request("r", prompt(14), max_tokens=4)
    params = (await served(prefill, req))[-1].disaggregated_params
    assert params
    result = PrefillResult(disaggregated_params=params)
    outputs = await served(decode, msgspec.structs.replace(req, prefill_result=result))
    assert len(tokens_of(outputs)) == 4
    c = decode.engine.counters
    assert (c.computed_prefill_tokens, c.transferred_prompt_tokens) == (0, 14)


async def test_an_aggregated_worker_ignores_a_prefill_result() -> None:
    """It has no KV connector: it computes the prompt, as a vLLM worker without one."""
    backend = MockerBackend(config(), speculative_method="mocker")
    outputs = await served(backend, with_handoff(request("a", prompt(10), max_tokens=2)))
    assert outputs[-1].disaggregated_params is None and len(tokens_of(outputs)) == 2
    c = backend.engine.counters
    assert (c.computed_prefill_tokens, c.kv_transfers, c.kv_transfers_refused) == (10, 0, 0)


def test_transfer_knobs_refuse_negative_times() -> None:
    with pytest.raises(ValueError, match="kv_transfer_overhead_ms"):
        TimingModel(kv_transfer_overhead_ms=-1)
    assert FAST.transfer_seconds(1000) < 1e-6


# ---------------------------------------------------------------------- command line


def test_roles_on_the_command_line_register_as_vllm_workers_do(tmp_path: Path) -> None:
    prefill = parse_args(["--is-prefill-worker"]).worker
    assert (prefill.disaggregation_mode, prefill.component, prefill.migration_limit) == (
        "prefill",
        "prefill",
        0,
    )
    decode = parse_args(["--disaggregation-mode", "decode"]).worker
    assert (decode.disaggregation_mode, decode.component, decode.migration_limit) == (
        "decode",
        "backend",
        DEFAULT_MIGRATION_LIMIT,
    )
    assert parse_args(["--is-decode-worker"]).worker.disaggregation_mode == "decode"
    assert parse_args([]).worker.disaggregation_mode == "agg"
    given = parse_args(["--is-prefill-worker", "--component", "pf", "--migration-limit", "2"])
    assert (given.worker.component, given.worker.migration_limit) == ("pf", 2)
    worker = mocker_worker(prefill, config(), model_path=tmp_path, served_model_name="m")
    assert worker.registration.worker_type is WorkerType.PREFILL
    assert worker.registration.component == "prefill"
    assert worker.backend.worker_type is WorkerType.PREFILL


@pytest.mark.parametrize(
    "argv",
    [
        ["--is-prefill-worker", "--is-decode-worker"],
        ["--is-prefill-worker", "--disaggregation-mode", "decode"],
    ],
)
def test_contradicting_roles_are_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_args(argv)


def test_transfer_knobs_reach_the_timing_model_and_are_explained() -> None:
    args = parse_args(["--kv-transfer-overhead-ms", "2", "--kv-transfer-ms-per-token", "0.5"])
    timing = args.engine.timing
    assert (timing.kv_transfer_overhead_ms, timing.kv_transfer_ms_per_token) == (2.0, 0.5)
    assert TimingModel().transfer_seconds(100) == pytest.approx(0.006)  # defaults: 5 + 1 ms
    text = " ".join(build_parser().format_help().split())
    for flag in ("--disaggregation-mode", "--is-prefill-worker", "--is-decode-worker"):
        assert flag in text
    assert "disk connector" in text
