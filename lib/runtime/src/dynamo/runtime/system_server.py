"""A worker process's system HTTP server (`--system-port`): `/metrics`, `/health`, `/live`.

Shared by every kind of worker (vLLM, mocker). The worker supplies the Prometheus registry
to expose and a health callback evaluated per request:

* `/health` → 200 `{"status": "healthy", ...}` when the callback says ready, else 503 with
  the same body shape, so an orchestrator's readiness probe and a human read the same thing;
* `/live` → 200 while the process answers at all (liveness, not readiness);
* `/metrics` → the registry in Prometheus text format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
"""Returns (ready, extra fields for the JSON body)."""

_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(eq=False)
class SystemServer:
    """Small aiohttp app; port 0 picks a free port (read `.port` after `start()`)."""

    host: str
    port: int
    health: HealthCheck
    registry: CollectorRegistry = REGISTRY
    _runner: web.AppRunner | None = field(init=False, default=None)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": _PROMETHEUS_TEXT}
        )

    async def _health(self, _: web.Request) -> web.Response:
        ok, fields = self.health()
        body = {"status": "healthy" if ok else "unhealthy", **fields}
        return web.json_response(body, status=200 if ok else 503)

    async def _live(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/live", self._live)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        for address in self._runner.addresses:
            self.port = address[1]
            break
        log.info("system server on http://%s:%d (/metrics /health /live)", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
