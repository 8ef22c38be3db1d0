"""Optional API key on the HTTP API (`--api-key` / `$DYN_API_KEY`).

With a key set, every request must carry `Authorization: Bearer <key>` (what OpenAI
clients send from their `api_key`), except the probes an orchestrator and Prometheus
call without credentials: `/health`, `/live` and `/metrics`. Anything else gets 401 in
OpenAI's error shape with `WWW-Authenticate: Bearer`.

The key is compared with `hmac.compare_digest`, in time independent of where the first
difference is, so response times do not reveal it byte by byte. It is never logged and
never echoed; the check is one header lookup and one comparison per request.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from dynamo.frontend.openai.errors import unauthorized

# Probes: orchestrators and Prometheus call them without credentials, and they reveal
# nothing a request could use.
EXEMPT_PATHS = frozenset({"/health", "/live", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
OnRejected = Callable[[], None]


def _as_bytes(text: str) -> bytes:
    # aiohttp decodes header values as UTF-8 with surrogateescape; this gives the bytes the
    # client sent back (compare_digest takes str only when it is ASCII).
    return text.encode("utf-8", "surrogateescape")


class ApiKeyCheck:
    """Whether a request carries the expected bearer token."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would accept every request")
        self._expected = _as_bytes(api_key)

    def allows(self, request: web.Request) -> bool:
        if request.path in EXEMPT_PATHS:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 9110)
            return False
        return hmac.compare_digest(_as_bytes(token.strip()), self._expected)


def api_key_middleware(api_key: str, on_rejected: OnRejected | None = None) -> Middleware:
    """aiohttp middleware refusing requests without the bearer `api_key` (401);
    `on_rejected()` is called for each (a metric)."""
    check = ApiKeyCheck(api_key)

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not check.allows(request):
            if on_rejected is not None:
                on_rejected()
            raise unauthorized()
        return await handler(request)

    return require_api_key
