"""The vLLM worker exports `dynamo_worker_prompt_tokens_total` beside
`dynamo_worker_cached_prompt_tokens_total`, as the mocker does, so the dashboard's prefix
hit rate per worker (cached / prompt) is one query for both kinds of worker."""

from __future__ import annotations

from dynamo.vllm.serving.engine_stats import EngineStats
from dynamo.vllm.serving.handlers import RequestCounters
from dynamo.vllm.serving.metrics import VllmWorkerCollector


def test_prompt_and_cached_prompt_tokens_are_both_exported() -> None:
    counters = RequestCounters()
    counters.prompt_tokens, counters.cached_prompt_tokens = 120, 96
    collector = VllmWorkerCollector(EngineStats(), counters, {"model": "m", "worker_type": "agg"})
    values = {
        sample.name: (sample.labels, sample.value)
        for family in collector.collect()
        for sample in family.samples
    }
    labels = {"model": "m", "worker_type": "agg"}
    assert values["dynamo_worker_prompt_tokens_total"] == (labels, 120)
    assert values["dynamo_worker_cached_prompt_tokens_total"] == (labels, 96)
