"""A vLLM stat logger that keeps the latest scheduler snapshot and cumulative speculative
decoding counters for the worker.

vLLM calls `record()` once per engine step in the worker's own process. We keep plain
numbers here (no NATS, no HTTP): the load publisher and `/metrics` read them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from dynamo.llm.acceptance import acceptance_length, acceptance_rate, per_position_rates


@dataclass
class SpecDecodeTotals:
    """Cumulative speculative-decoding counters over the worker's lifetime."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted_tokens, self.num_drafts)

    def per_position_rate(self) -> list[float]:
        """Fraction of drafts whose token at position i was accepted."""
        return per_position_rates(self.accepted_per_pos, self.num_drafts)

    def add(self, stats: Any) -> None:
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = list(stats.num_accepted_tokens_per_pos)
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
        for i, n in enumerate(per_pos):
            self.accepted_per_pos[i] += n


@dataclass
class EngineSnapshot:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0


class EngineStats:
    """Shared, thread-safe holder updated by `WorkerStatLogger` instances."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.snapshot = EngineSnapshot()
        self.spec = SpecDecodeTotals()
        self._watchers: list[Callable[[], None]] = []

    def watch(self, recorded: Callable[[], None]) -> None:
        """Call `recorded` after every step's stats are in. vLLM records them in its
        output handler, a task on the engine's event loop, so watchers run there."""
        self._watchers.append(recorded)

    def record(self, scheduler_stats: Any) -> None:
        with self._lock:
            snap = self.snapshot
            snap.steps += 1
            snap.running = scheduler_stats.num_running_reqs
            snap.waiting = scheduler_stats.num_waiting_reqs
            snap.kv_usage = float(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                snap.prefix_queries += int(getattr(prefix, "queries", 0))
                snap.prefix_hits += int(getattr(prefix, "hits", 0))
            if scheduler_stats.spec_decoding_stats is not None:
                self.spec.add(scheduler_stats.spec_decoding_stats)
        for recorded in self._watchers:
            recorded()


def make_stat_logger_factory(stats: EngineStats) -> type[StatLoggerBase]:
    """vLLM instantiates stat loggers itself from a class; bind our holder into one."""

    class WorkerStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                stats.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return WorkerStatLogger
