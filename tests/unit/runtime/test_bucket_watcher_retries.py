"""A bucket watch that cannot be placed says so and tries again on a schedule; a reconnect
cuts the wait short.

A frontend whose watch of the model registry keeps failing never learns of a model, and
that used to be a debug line: a CI run waited 60 s for a model with nothing in the log to
say why. Each failure is now a warning with its attempt number, the next try follows the
backoff (0.5 s, 1 s, then every 2 s), and `restart()` (called on every reconnect) starts
the next try at once instead of after the remaining delay.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

import dynamo.runtime.watch as watch
from dynamo.runtime.backoff import Backoff
from dynamo.runtime.watch import BucketWatcher

pytestmark = pytest.mark.unit

HANG_GUARD_S = 10.0  # tells "tried again" from "never tried again", not fast from slow


class DownJetStream:
    """Every bucket call fails as a broker that is not there would; each try is counted."""

    def __init__(self) -> None:
        self.tries = 0
        self.tried = asyncio.Event()

    async def create_key_value(self, config: object) -> None:
        self.tries += 1
        self.tried.set()
        raise ConnectionError("broker down")


async def next_try(js: DownJetStream) -> None:
    js.tried.clear()
    await asyncio.wait_for(js.tried.wait(), HANG_GUARD_S)


async def test_each_failed_watch_is_a_warning_and_a_reconnect_retries_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A backoff far longer than the guard: a second try within it can only come from
    # the reconnect.
    monkeypatch.setattr(watch, "WATCH_RETRY", Backoff(initial_s=600.0, maximum_s=600.0))
    caplog.set_level(logging.WARNING, logger="dynamo.runtime.watch")
    js = DownJetStream()
    watcher = BucketWatcher(js, "dyn_models")  # type: ignore[arg-type]
    try:
        with pytest.raises(TimeoutError):
            await watcher.start(timeout=0.2)  # no snapshot while the broker is down
        assert js.tries == 1
        watcher.restart()
        await next_try(js)
        assert js.tries == 2
    finally:
        await watcher.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines[0].startswith("watch of dyn_models/> failed (attempt 1): broker down")
    assert "retrying in 600.0s" in lines[0]
    assert "(attempt 2)" in lines[1]


def test_the_retry_schedule_is_quick_first_and_bounded() -> None:
    assert [watch.WATCH_RETRY.delay(n) for n in (1, 2, 3, 10)] == [0.5, 1.0, 2.0, 2.0]
