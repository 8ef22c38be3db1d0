"""A request with `n` > 1 is one placement: the KV router books it once, its prompt blocks
counted once (the n sequences share them on the worker, as vLLM's parallel sampling
shares the prompt's KV through its prefix cache)."""

from __future__ import annotations

from kv_cards import worker_card

from dynamo.llm.kv_router.router import build_kv_router
from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest, SamplingOptions

PROMPT = list(range(1000, 1064))  # exactly 4 blocks of 16


async def test_n3_is_booked_once_with_its_prompt_counted_once() -> None:
    router = build_kv_router(worker_card(1, k=2))
    single = PreprocessedRequest(request_id="one", model="m", token_ids=PROMPT)
    parallel = PreprocessedRequest(
        request_id="three", model="m", token_ids=PROMPT, sampling_options=SamplingOptions(n=3)
    )
    await router.select(single, [1])
    seqs = router.scheduler.sequences.get(1)
    assert seqs is not None
    one = (seqs.active_requests, seqs.active_blocks, seqs.prefill_tokens)
    router.on_finished("one")
    assert await router.select(parallel, [1]) == 1
    assert (seqs.active_requests, seqs.active_blocks, seqs.prefill_tokens) == one == (1, 5, 64)
    # Outputs of the three sequences interleave on one stream: one booking to release.
    router.on_first_output("three", LLMEngineOutput(token_ids=[7], index=2))
    router.on_finished("three")
    assert (seqs.active_requests, seqs.active_blocks) == (0, 0)
    await router.close()
