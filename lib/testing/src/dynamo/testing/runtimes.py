"""A test's own connection to the runtime: `DistributedRuntime.connect`, shut down when
the block (or the fixture built on it) ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from dynamo.runtime import DistributedRuntime


@asynccontextmanager
async def connected_runtime(
    nats_url: str, *, drain_timeout: float = 10.0, **connect: Any
) -> AsyncIterator[DistributedRuntime]:
    """A runtime connected to `nats_url` (`connect` are `DistributedRuntime.connect`'s
    options: `lease_ttl`, `name`, ...) until the block exits, then shut down, draining
    for `drain_timeout` seconds at most."""
    runtime = await DistributedRuntime.connect(nats_url, **connect)
    try:
        yield runtime
    finally:
        await runtime.shutdown(drain_timeout=drain_timeout)
