"""`dynamo.vllm.serving.engine_stats.EngineStats`, fed vLLM's own `SchedulerStats` as its stat
logger is.

Claims: a step's stats become the snapshot the load reports read, and every watcher hears
of each step after the snapshot holds it (what drives the worker's load reports).
"""

from __future__ import annotations

from vllm.v1.metrics.stats import SchedulerStats

from dynamo.llm.protocols import LoadMetrics
from dynamo.vllm.serving.engine_stats import EngineStats
from dynamo.vllm.serving.publishers import engine_load


def test_watchers_hear_of_each_step_after_the_snapshot_holds_it() -> None:
    stats = EngineStats()
    seen: list[LoadMetrics] = []
    stats.watch(lambda: seen.append(engine_load(7, stats, num_gpu_blocks=101)))
    stats.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25))
    stats.record(SchedulerStats(num_running_reqs=0, kv_cache_usage=0.0))
    assert [(m.active_requests, m.waiting_requests, m.active_blocks) for m in seen] == [
        (3, 1, 25),
        (0, 0, 0),
    ]
    assert stats.snapshot.steps == 2
