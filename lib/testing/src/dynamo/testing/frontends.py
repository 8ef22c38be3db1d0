"""The frontend's serving loop on the test's own event loop.

Integration tests drive the real frontend (`run_frontend`: card discovery over NATS,
routing, the HTTP server) against workers served from the same test, and look at its
router and counters directly. Running it as a task on the test's event loop, rather than
as a process, keeps it inspectable and lets the test's scripted workers and the frontend
share one loop. `InLoopFrontend.start` starts it on a free local port; `stop()` must be
awaited (in a `finally`), and fails the test when the frontend does not stop in time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from dynamo.frontend.engine.prefill_policy import DisaggSettings
from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.service import FrontendConfig, run_frontend
from dynamo.runtime.ports import free_port

STOP_TIMEOUT_S = 15.0
"""How long the frontend may take to drain and close once asked to stop."""


class InLoopFrontend:
    """`run_frontend(config)` as a task of the running event loop."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(run_frontend(config, self._stop))

    @classmethod
    def start(
        cls,
        nats_url: str,
        namespace: str,
        tokenizer_cache: Path,
        *,
        router_mode: RouterMode,
        disagg: DisaggSettings | None = None,
    ) -> InLoopFrontend:
        """A frontend for `namespace` on 127.0.0.1 and a free port; `disagg`: how it
        places the prompts of models with prefill workers (default: the flags' defaults)."""
        config = FrontendConfig(
            http=HttpSettings(host="127.0.0.1", port=free_port()),
            router=RouterSettings(mode=router_mode),
            disagg=disagg if disagg is not None else DisaggSettings(),
            namespace=namespace,
            nats_server=nats_url,
            tokenizer_cache=tokenizer_cache,
        )
        return cls(config)

    @property
    def base_url(self) -> str:
        return f"http://{self.config.http.host}:{self.config.http.port}"

    async def stop(self) -> None:
        """Ask the frontend to stop and wait for it (`TimeoutError` after
        `STOP_TIMEOUT_S`)."""
        self._stop.set()
        await asyncio.wait_for(self._task, STOP_TIMEOUT_S)
