"""Waiting for a condition with a deadline, for tests and benchmarks.

Much of what tests check happens eventually rather than at once: an event reaches a
router over NATS, a worker deregisters, a process answers `/health`. Polling a predicate
until it holds or a deadline passes is the one honest way to wait for those without a
hook in the code under test. `wait_until` polls from plain code (it sleeps the thread);
`wait_until_async` polls from a coroutine (it yields to the event loop, so a server
running on the same loop keeps serving) and accepts coroutine predicates as well.

Both check the predicate before each sleep and once more after the deadline has passed,
return the seconds the wait took, and on timeout raise `WaitTimeout`, an
`AssertionError` whose message names what was awaited, so a test fails with a reason
instead of a bare "condition not reached".
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

DEFAULT_INTERVAL_S = 0.02
"""Between two checks, unless the caller says otherwise: short, since the predicates of
in-process waits are cheap; waits that poll over HTTP pass a longer interval."""

Description = str | Callable[[], str]
"""What is awaited: a phrase, or a function giving one when the wait fails (to report
the state that was found, e.g. a directory listing or a process's log)."""


class WaitTimeout(AssertionError):
    """A condition did not hold before its deadline."""

    def __init__(self, what: Description, timeout: float) -> None:
        described = what() if callable(what) else what
        super().__init__(f"timed out after {timeout:g}s waiting for {described}")
        self.timeout = timeout


def wait_until(
    predicate: Callable[[], object],
    *,
    timeout: float,
    what: Description,
    interval: float = DEFAULT_INTERVAL_S,
    retry_on: tuple[type[Exception], ...] = (),
) -> float:
    """Call `predicate` every `interval` seconds until it returns something true; returns
    the seconds that took. An exception in `retry_on` raised by the predicate counts as
    "not yet" (e.g. a connection refused while a server starts); any other propagates.
    Raises `WaitTimeout` naming `what` when `timeout` seconds pass first."""
    start = time.monotonic()
    while not _holds(predicate, retry_on):
        if time.monotonic() - start > timeout:
            raise WaitTimeout(what, timeout)
        time.sleep(interval)
    return time.monotonic() - start


async def wait_until_async(
    predicate: Callable[[], object | Awaitable[object]],
    *,
    timeout: float,
    what: Description,
    interval: float = DEFAULT_INTERVAL_S,
    retry_on: tuple[type[Exception], ...] = (),
) -> float:
    """`wait_until` for coroutines: sleeps with `asyncio.sleep`, and awaits the predicate's
    result when it is awaitable (a coroutine function or a plain one both work)."""
    start = time.monotonic()
    while not await _holds_async(predicate, retry_on):
        if time.monotonic() - start > timeout:
            raise WaitTimeout(what, timeout)
        await asyncio.sleep(interval)
    return time.monotonic() - start


def _holds(predicate: Callable[[], object], retry_on: tuple[type[Exception], ...]) -> bool:
    try:
        return bool(predicate())
    except retry_on:
        return False


async def _holds_async(
    predicate: Callable[[], object | Awaitable[object]], retry_on: tuple[type[Exception], ...]
) -> bool:
    try:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        return bool(result)
    except retry_on:
        return False
