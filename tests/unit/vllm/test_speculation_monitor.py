"""`dynamo.vllm.speculative.monitor.SpeculationMonitor`, on a fake clock and fake counters.

Claims: K in force follows the schedule for the running batch (capped at the static K as
vLLM caps it; the static K without a schedule, 0 without speculation); acceptance length is
measured per window from the cumulative counters; the profile's expectation is at the K in
force; drift warns once per window, and not when acceptance is close or drafts are few; the
worker's collector exports the monitor's series.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from dynamo.llm.protocols import SpeculativeInfo
from dynamo.llm.speculation_profile import SpeculationProfile, StepTimes
from dynamo.vllm.speculative.k_in_force import SpeculationSnapshot
from dynamo.vllm.speculative.monitor import SpeculationMonitor

SCHEDULE = [[1, 2, 3], [3, 6, 2], [7, 8, 0]]
ACCEPTANCE = [0.6, 0.4, 0.2]


def profile(acceptance: list[float] = ACCEPTANCE) -> SpeculationProfile:
    """A profile with synthetic numbers; only its acceptance matters to the monitor."""
    return SpeculationProfile(
        model="m",
        method="ngram",
        speculative_config={"method": "ngram"},
        batch_sizes=[1, 8],
        acceptance_per_position=acceptance,
        step_times=[StepTimes(k=k, step_ms=[10.0, 20.0]) for k in range(4)],
        schedule=SCHEDULE,
        max_batch_size=8,
        prompts="synthetic",
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Counters:
    """Cumulative counters shaped like `engine_stats.SpecDecodeTotals`."""

    num_drafts: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafts: int, per_pos: list[int]) -> None:
        self.num_drafts += drafts
        self.num_accepted_tokens += sum(per_pos)
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for i, n in enumerate(per_pos):
            self.accepted_per_pos[i] += n


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def monitor(clock: FakeClock, **kwargs) -> SpeculationMonitor:
    return SpeculationMonitor(profile(), SCHEDULE, 60.0, clock, static_k=3, **kwargs)


def drift_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dynamo.vllm" and r.levelno == logging.WARNING
    ]


# --------------------------------------------------------------------------- K in force


def test_k_follows_the_schedule_for_the_running_batch(clock: FakeClock) -> None:
    mon = monitor(clock)
    counters = Counters()
    expected = {0: 3, 1: 3, 2: 3, 3: 2, 6: 2, 7: 0, 8: 0, 50: 0}  # idle: a batch of one
    for running, k in expected.items():
        mon.observe(running, counters)
        assert mon.k_in_force == k, running
    mon.observe(4, counters)
    assert mon.profile_acceptance_length == pytest.approx(1.0 + 0.6 + 0.4)
    mon.observe(1, counters)
    assert mon.profile_acceptance_length == pytest.approx(1.0 + 0.6 + 0.4 + 0.2)
    mon.observe(8, counters)
    assert mon.profile_acceptance_length == pytest.approx(1.0)


def test_k_without_a_schedule_or_speculation(clock: FakeClock) -> None:
    assert SpeculationMonitor(None, None, clock=clock, static_k=4).k_for_running(9) == 4
    capped = SpeculationMonitor(None, SCHEDULE, clock=clock, static_k=2)
    assert capped.k_for_running(1) == 2  # vLLM caps the schedule at num_speculative_tokens
    off = SpeculationMonitor.for_engine(None, None, clock=clock)
    off.observe(5, Counters())
    assert off.k_in_force == 0
    assert off.profile_acceptance_length is None  # no profile, no expectation
    info = SpeculativeInfo(method="ngram", num_speculative_tokens=3, schedule=SCHEDULE)
    on = SpeculationMonitor.for_engine(profile(), info, clock=clock)
    on.observe(4, Counters())
    assert (on.k_in_force, on.static_k) == (2, 3)


def test_an_adaptive_engines_k_is_the_one_its_scheduler_chose_last(clock: FakeClock) -> None:
    chosen: list[SpeculationSnapshot | None] = [None]
    info = SpeculativeInfo("ngram", 3, schedule=SCHEDULE, adaptive=True)
    mon = SpeculationMonitor.for_engine(profile(), info, clock=clock, adapted=lambda: chosen[0])
    mon.observe(4, Counters())
    assert mon.k_in_force == 2  # nothing chosen yet: the schedule's
    assert mon.steps_at_k == ()
    for steps, k in enumerate((0, 3, 1), start=1):
        chosen[0] = SpeculationSnapshot(k, steps, (1, 1, 0, 1))
        mon.observe(4, Counters())
        assert mon.k_in_force == k
    assert mon.steps_at_k == (1, 1, 0, 1)
    fixed = SpeculationMonitor.for_engine(
        profile(),
        SpeculativeInfo("ngram", 3, schedule=SCHEDULE),
        clock=clock,
        adapted=lambda: SpeculationSnapshot(0, 1, (1,)),
    )
    fixed.observe(4, Counters())
    assert fixed.k_in_force == 2  # a card that does not adapt keeps its schedule


# --------------------------------------------------------------------------- windows


def test_acceptance_length_is_measured_per_window(clock: FakeClock) -> None:
    mon = monitor(clock)
    counters = Counters()
    mon.observe(1, counters)
    assert mon.window_acceptance_length is None  # no drafts yet
    counters.add(10, [6, 4, 2])  # 12 accepted in 10 drafts
    clock.now += 30
    mon.observe(1, counters)
    assert mon.window_acceptance_length == pytest.approx(2.2)  # the current window
    assert mon.last_window is None
    clock.now += 30  # the window ends at this observation
    mon.observe(1, counters)
    assert mon.last_window is not None and mon.last_window.drafts == 10
    counters.add(10, [2, 0, 0])  # the next window accepts far less...
    clock.now += 10
    mon.observe(1, counters)
    assert mon.current_window.acceptance_length == pytest.approx(1.2)
    assert mon.window_acceptance_length == pytest.approx(2.2)  # ...the last complete one shows
    clock.now += 50
    mon.observe(1, counters)
    assert mon.window_acceptance_length == pytest.approx(1.2)
    assert mon.current_window.drafts == 0


# --------------------------------------------------------------------------- drift


def test_drift_warns_once_per_window(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    mon = monitor(clock)
    counters = Counters()
    with caplog.at_level(logging.WARNING, logger="dynamo.vllm"):
        for _ in range(5):  # one window: first position accepted 0.2, profiled 0.6
            counters.add(50, [10, 5, 0])
            clock.now += 12
            mon.observe(2, counters)
        assert mon.drift_warnings == 1
        assert len(drift_warnings(caplog)) == 1
        message = drift_warnings(caplog)[0]
        assert "0.20" in message and "0.60" in message and "250 drafts" in message
        assert "python -m dynamo.vllm.profile_spec" in message
        for _ in range(5):  # the next window drifts too: one more warning, not five
            counters.add(50, [10, 5, 0])
            clock.now += 12
            mon.observe(2, counters)
    assert mon.drift_warnings == 2
    assert len(drift_warnings(caplog)) == 2


def test_no_warning_when_close_or_too_few_drafts(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    mon = monitor(clock)
    counters = Counters()
    with caplog.at_level(logging.WARNING, logger="dynamo.vllm"):
        counters.add(200, [100, 60, 20])  # 0.5 vs 0.6 profiled: within 30%
        clock.now += 60
        mon.observe(1, counters)
        counters.add(99, [0, 0, 0])  # far off, but 99 drafts say too little
        clock.now += 60
        mon.observe(1, counters)
        counters.add(100, [0, 0, 0])  # far off with 100 drafts: warns
        clock.now += 60
        mon.observe(1, counters)
    assert mon.drift_warnings == 1
    assert len(drift_warnings(caplog)) == 1
    unprofiled = SpeculationMonitor(None, SCHEDULE, 60.0, clock, static_k=3)
    counters.add(500, [0, 0, 0])
    clock.now += 60
    unprofiled.observe(1, counters)
    assert unprofiled.drift_warnings == 0  # nothing to drift from


# --------------------------------------------------------------------------- /metrics


def test_collector_exports_the_monitor(clock: FakeClock) -> None:
    from dynamo.vllm.serving.engine_stats import EngineStats
    from dynamo.vllm.serving.handlers import RequestCounters
    from dynamo.vllm.serving.metrics import VllmWorkerCollector

    stats = EngineStats()
    mon = monitor(clock)

    def observed() -> SpeculationMonitor:
        mon.observe(stats.snapshot.running, stats.spec)
        return mon

    collector = VllmWorkerCollector(stats, RequestCounters(), {"model": "m"}, monitor=observed)
    stats.snapshot.running = 4
    stats.spec.num_drafts, stats.spec.num_accepted_tokens = 10, 5
    stats.spec.accepted_per_pos = [4, 1, 0]
    values = {
        sample.name: sample.value for family in collector.collect() for sample in family.samples
    }
    assert values["dynamo_worker_spec_decode_k"] == 2  # observed at scrape time
    assert values["dynamo_worker_spec_decode_window_acceptance_length"] == pytest.approx(1.5)
    assert values["dynamo_worker_spec_decode_profile_acceptance_length"] == pytest.approx(2.0)
    assert values["dynamo_worker_spec_decode_profile_drift_warnings_total"] == 0
    before_engine = VllmWorkerCollector(stats, RequestCounters(), {}, monitor=lambda: None)
    names = {family.name for family in before_engine.collect()}
    assert "dynamo_worker_spec_decode_k" not in names
    assert "dynamo_worker_spec_decode_k_steps" not in {f.name for f in collector.collect()}


def test_collector_exports_an_adaptive_engines_steps_at_each_k(clock: FakeClock) -> None:
    from dynamo.vllm.serving.engine_stats import EngineStats
    from dynamo.vllm.serving.handlers import RequestCounters
    from dynamo.vllm.serving.metrics import VllmWorkerCollector

    stats = EngineStats()
    info = SpeculativeInfo("ngram", 3, schedule=SCHEDULE, adaptive=True)
    mon = SpeculationMonitor.for_engine(
        profile(), info, clock=clock, adapted=lambda: SpeculationSnapshot(1, 9, (5, 3, 0, 1))
    )

    def observed() -> SpeculationMonitor:
        mon.observe(stats.snapshot.running, stats.spec)
        return mon

    collector = VllmWorkerCollector(stats, RequestCounters(), {"model": "m"}, monitor=observed)
    steps = {
        sample.labels["k"]: sample.value
        for family in collector.collect()
        if family.name == "dynamo_worker_spec_decode_k_steps"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert steps == {"0": 5, "1": 3, "2": 0, "3": 1}


def test_backend_observes_at_every_load_report(clock: FakeClock, tiny_model) -> None:
    from dynamo.vllm.config.args import parse_worker_args
    from dynamo.vllm.serving.backend import VllmBackend

    backend = VllmBackend(parse_worker_args(["--model", str(tiny_model), "--dry-run"]))
    assert backend.observe_speculation() is None  # before the engine runs
    backend.spec_monitor = monitor(clock)
    backend.engine.stats.snapshot.running = 7
    backend.load_metrics(worker_id=1)
    assert backend.spec_monitor.k_in_force == 0
