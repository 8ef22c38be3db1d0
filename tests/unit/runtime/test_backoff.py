"""The retry schedule used after a broker restart, and the loop applying it, with the
sleep replaced by a recorder: no real waiting."""

from __future__ import annotations

import pytest

from dynamo.runtime.backoff import Backoff, retry_until_done


def test_the_default_schedule_doubles_from_half_a_second_to_ten() -> None:
    backoff = Backoff()
    assert [backoff.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 10, 10, 10]
    assert backoff.delay(10_000) == 10  # a long outage never builds a huge number


@pytest.mark.parametrize(
    "kwargs",
    [{"initial_s": 0}, {"initial_s": 2, "maximum_s": 1}, {"factor": 0.5}],
)
def test_a_schedule_that_could_not_back_off_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_attempts_count_from_one() -> None:
    with pytest.raises(ValueError):
        Backoff().delay(0)


async def test_the_action_is_retried_on_the_schedule_until_it_succeeds() -> None:
    slept: list[float] = []
    calls = 0

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise ConnectionError("broker away")
        return "done"

    result = await retry_until_done(
        flaky, what="test", backoff=Backoff(initial_s=1, maximum_s=3), sleep=sleep
    )
    assert (result, calls, slept) == ("done", 4, [1, 2, 3])
