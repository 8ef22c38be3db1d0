"""What a test session leaves running on its event loop, finished before the loop closes.

The tests share one event loop per session (pyproject.toml). When it closes, asyncio
cancels every task still pending and waits for all of them, then closes every unfinished
async generator, then joins the default executor's threads, each without a time limit: one
task that ignores its cancellation, one generator whose `finally` waits on a broker that is
gone, or one thread blocked for good turns the session's end into a hang, which
pytest-timeout reports (after its 900 s) against whichever test ran last, with no word on
the cause. `finish_leftovers` does the same work first, bounded, and names what would
have hung, so a leak fails fast and says where it comes from.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from dataclasses import dataclass, field

STACK_FRAMES = 4
"""Innermost frames shown for each leftover: enough to name the code that holds it."""


@dataclass
class Leftovers:
    """What was still running when the session ended, and what did not finish in time."""

    cancelled: int = 0  # pending tasks cancelled (a test leaked them; they ended cleanly)
    stuck: list[str] = field(default_factory=list)  # each: what, and where it waits

    def describe(self) -> str:
        return "\n".join(self.stuck)


def _task_line(task: asyncio.Task[object]) -> str:
    frames = task.get_stack()[-STACK_FRAMES:]
    where = " <- ".join(f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in frames)
    return f"task {task.get_name()} ignores its cancellation, waiting in {where or '?'}"


def _thread_line(thread: threading.Thread) -> str | None:
    """None for an idle pool thread (waiting for work: the pool's shutdown ends it)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return None
    stack = traceback.extract_stack(frame)[-STACK_FRAMES:]
    if any("work_queue.get" in (line.line or "") for line in stack):
        return None
    where = " <- ".join(f"{s.name} ({s.filename}:{s.lineno})" for s in reversed(stack))
    return f"executor thread {thread.name} is busy in {where}"


async def finish_leftovers(timeout: float) -> Leftovers:
    """Cancel the tasks still pending on the running loop (all but the caller), close its
    unfinished async generators, and report what is still running after `timeout`
    seconds: tasks that ignore cancellation and default-executor threads still busy
    (the loop's close would wait for both forever)."""
    loop = asyncio.get_running_loop()
    report = Leftovers()
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    report.cancelled = len(tasks)
    deadline = loop.time() + timeout
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    report.stuck.extend(_task_line(t) for t in tasks if not t.done())
    remaining = max(0.1, deadline - loop.time())
    try:
        await asyncio.wait_for(loop.shutdown_asyncgens(), remaining)
    except TimeoutError:
        report.stuck.append(f"an async generator's aclose() did not end within {timeout:g}s")
    busy = _busy_executor_threads(loop)
    while busy and loop.time() < deadline:
        await asyncio.sleep(0.2)
        busy = _busy_executor_threads(loop)
    report.stuck.extend(busy)
    return report


def _busy_executor_threads(loop: asyncio.AbstractEventLoop) -> list[str]:
    executor = getattr(loop, "_default_executor", None)  # asyncio keeps no public handle
    lines = (_thread_line(thread) for thread in list(getattr(executor, "_threads", ())))
    return [line for line in lines if line is not None]
