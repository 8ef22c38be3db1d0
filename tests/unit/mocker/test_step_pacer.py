"""`StepPacer`: simulated step times shorter than the event loop can time are slept off
in quanta, simulated time stays right on average, and the loop is never held for long."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from mocker_support import config, prompt, request

from dynamo.mocker import MockEngine, TimingModel
from dynamo.mocker.timing import StepPacer

QUANTUM_S = 0.001


class SleepLog:
    """Every `asyncio.sleep` delay asked for, by task. The event loop is shared by the
    session, so tasks other tests left running sleep too: `mine()` is the calling task's
    own delays, in order."""

    def __init__(self) -> None:
        self.asked: list[tuple[asyncio.Task[Any] | None, float]] = []

    def mine(self) -> list[float]:
        me = asyncio.current_task()
        return [delay for task, delay in self.asked if task is me]


@pytest.fixture
def sleep_log(monkeypatch: pytest.MonkeyPatch) -> SleepLog:
    log = SleepLog()
    real_sleep = asyncio.sleep

    async def counting_sleep(delay: float, *args: Any) -> Any:
        log.asked.append((asyncio.current_task(), delay))
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", counting_sleep)
    return log


async def test_short_steps_are_slept_off_in_quanta_and_add_up(sleep_log: SleepLog) -> None:
    """2000 steps of 10 us: 20 ms of simulated time in about 20 sleeps, not 2000, and at
    least the simulated 20 ms pass."""
    pacer = StepPacer(QUANTUM_S)
    began = time.monotonic()
    for _ in range(2000):
        await pacer.wait(10e-6)
    assert time.monotonic() - began >= 0.020 - QUANTUM_S  # one quantum of credit at most
    sleeps = sleep_log.mine()
    timed = [delay for delay in sleeps if delay > 0]
    assert 10 <= len(timed) <= 21, timed  # each owes a quantum (less what overran before)
    assert all(delay >= QUANTUM_S - 1e-9 for delay in timed[:1])
    # Yields for wall-clock time spent stepping come on top only on a slow machine.
    assert len(sleeps) - len(timed) < 40


async def test_steps_of_a_quantum_or_more_sleep_every_time(sleep_log: SleepLog) -> None:
    pacer = StepPacer(QUANTUM_S)
    for _ in range(5):
        await pacer.wait(0.002)
    sleeps = sleep_log.mine()
    assert len(sleeps) == 5
    assert all(delay >= 0.002 - QUANTUM_S for delay in sleeps), sleeps


async def test_a_burst_of_tiny_steps_still_yields_every_quantum_of_wall_time(
    sleep_log: SleepLog,
) -> None:
    """Steps of a nanosecond (speed-up 1e6) would take 1e6 steps to owe one quantum: the
    pacer yields once per quantum of wall-clock time instead of holding the loop."""
    pacer = StepPacer(QUANTUM_S)
    began = time.monotonic()
    while time.monotonic() - began < 0.05:
        await pacer.wait(1e-9)
    sleeps = sleep_log.mine()
    assert 10 <= sleeps.count(0) <= 60, len(sleeps)  # about one yield per millisecond


async def test_quantum_zero_is_lockstep(sleep_log: SleepLog) -> None:
    pacer = StepPacer(0.0)
    for _ in range(20):
        await pacer.wait(1e-6)
    sleeps = sleep_log.mine()
    assert len(sleeps) == 20


async def test_engine_paces_fast_steps_and_keeps_simulated_time() -> None:
    """A mock engine at speed-up 1000 (20 us steps) serves 400 tokens in at least their
    simulated 8 ms, with every token delivered and the engine's steps counted."""
    timing = TimingModel(decode_ms_per_step=20.0, decode_ms_per_token=0.0, speed_up=1000)
    engine = await MockEngine(config(timing=timing, max_model_len=512, num_gpu_blocks=256)).start()
    try:
        began = time.monotonic()
        outputs = [o async for o in engine.generate(request("a", prompt(8), max_tokens=400))]
        elapsed = time.monotonic() - began
    finally:
        await engine.stop()
    assert sum(len(o.token_ids) for o in outputs) == 400
    assert engine.counters.steps == 400  # the prefill step's token, then 399 decode steps
    assert elapsed >= 400 * 20e-6 - QUANTUM_S
