"""Small HTTP and Prometheus helpers for tests and benchmarks.

Tests and benchmarks look at the servers they start from the outside: `/health`,
`/v1/models`, `/debug/kv`, `/metrics`. The blocking helpers (`http_get`,
`http_post_json`, `metric_total`) use only the standard library, for code that drives
separate processes; `fetch_json` and `wait_for_instances_async` use aiohttp, for tests
whose server runs on their own event loop (a blocking call there would stall the server
it waits for).

HTTP error statuses are returned, not raised: a 503 from a server that is still starting
is an answer a caller wants to look at. Connection errors raise `OSError`
(`urllib.error.URLError` is one), which readiness waits treat as "not yet".
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from dynamo.testing.waiting import wait_until, wait_until_async

# One sample of the Prometheus text format: name, optional {labels}, value.
_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """`(status, body)` of a GET; HTTP errors are returned, connection errors raise."""
    return _send(urllib.request.Request(url), timeout)


def http_post_json(url: str, body: Mapping[str, Any], timeout: float = 60.0) -> tuple[int, str]:
    """`(status, body)` of a JSON POST; HTTP errors are returned, connection errors raise."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return _send(request, timeout)


def _send(request: urllib.request.Request, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def fetch_json(url: str) -> Any:
    """The JSON body of a GET, whatever the status (a 503 `/health` still says why);
    connection errors raise `aiohttp.ClientError`."""
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.json(content_type=None)


async def fetch_text(url: str) -> str:
    """The text body of a GET (a `/metrics` scrape), whatever the status."""
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


def listed_instances(health: Mapping[str, Any], model: str) -> list[Any]:
    """The instances a frontend's `/health` body lists for `model` (none when absent)."""
    return list(health["models"].get(model, {}).get("instances", []))


def kv_router_view(base_url: str, model: str, endpoint_path: str) -> dict[str, Any]:
    """What the frontend at `base_url` shows of its KV router for `model` on the workers'
    `endpoint_path` (`namespace/component/endpoint`) in `GET /debug/kv`: its feed, its
    routing totals and one entry per worker. `AssertionError` unless the answer is 200;
    `KeyError` while the frontend has no such router."""
    status, body = http_get(f"{base_url}/debug/kv")
    if status != 200:
        raise AssertionError(f"GET {base_url}/debug/kv: {status} {body[:500]}")
    return json.loads(body)["models"][model][endpoint_path]


def debug_kv_views(base_url: str, *, attempts: int = 400) -> list[dict[str, Any]]:
    """`GET /debug/kv` of every process of the frontend at `base_url`, in process order.

    A frontend run with `--http-workers N` is N processes sharing one port, each with its
    own routers: the kernel hands each new connection to one of them, and the answer says
    which (`http_worker: {index, count}`). New connections are made until all N have
    answered; a single-process frontend answers once. `AssertionError` unless every
    answer is 200 and every process answered within `attempts` connections."""
    views: dict[int, dict[str, Any]] = {}
    count = 1
    for _ in range(attempts):
        status, body = http_get(f"{base_url}/debug/kv")
        if status != 200:
            raise AssertionError(f"GET {base_url}/debug/kv: {status} {body[:500]}")
        view = json.loads(body)
        slot = view.get("http_worker")
        if slot is None:
            return [view]
        views[slot["index"]] = view
        count = slot["count"]
        if len(views) == count:
            return [views[index] for index in range(count)]
    raise AssertionError(
        f"{base_url}: only processes {sorted(views)} of {count} answered GET /debug/kv "
        f"in {attempts} connections"
    )


def kv_router_views(base_url: str, model: str, endpoint_path: str) -> list[dict[str, Any]]:
    """`kv_router_view` of every process of the frontend at `base_url` (one per
    `--http-workers` process)."""
    return [view["models"][model][endpoint_path] for view in debug_kv_views(base_url)]


def routed_requests(router_view: Mapping[str, Any]) -> dict[str, int]:
    """Requests a KV router sent to each worker so far (by instance hex), from its
    `kv_router_view`."""
    return {hex_id: view["routed"]["requests"] for hex_id, view in router_view["workers"].items()}


def routed_totals(views: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Requests placed on each worker (by instance hex) by all of a frontend's
    processes together, from their `kv_router_views`."""
    totals: dict[str, int] = {}
    for view in views:
        for worker, count in routed_requests(view).items():
            totals[worker] = totals.get(worker, 0) + count
    return totals


def routed_one_more(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    """The one worker whose count of routed requests grew from `before` to `after` (two
    `routed_totals`-like snapshots around one request): where the router sent it."""
    grown = [worker for worker, count in after.items() if count > before.get(worker, 0)]
    assert len(grown) == 1, (before, after)
    return grown[0]


def wait_prefix_indexed(
    indexed: Callable[[], int], prompt_tokens: int, block_size: int, *, interval: float = 0.25
) -> int:
    """The blocks of a prompt of `prompt_tokens` tokens, a long prefix (10 blocks at least)
    that later requests share, once `indexed()` (the blocks of the worker that served it, as
    a KV router holds them) reaches that count, 10 s at most: a worker's stored blocks must
    reach the index before the next routing decision can follow them."""
    blocks = prompt_tokens // block_size
    assert blocks >= 10, "the shared prefix spans many blocks"
    wait_until(
        lambda: indexed() >= blocks,
        timeout=10,
        interval=interval,
        what=f"the router to index the {blocks} blocks of the shared prefix",
    )
    return blocks


def predicted_hit_rate(views: Sequence[Mapping[str, Any]]) -> float:
    """The routers' predicted prefix-cache hit rate over every process's decisions
    (overlapping blocks over prompt blocks)."""
    blocks = sum(view["routing"]["request_blocks"] for view in views)
    overlap = sum(view["routing"]["overlap_blocks"] for view in views)
    return overlap / blocks if blocks else 0.0


def metric_values(text: str, name: str, labels: Mapping[str, str] | None = None) -> list[float]:
    """The values of every sample of series `name` (exactly that name) in Prometheus text
    format whose labels include `labels`."""
    wanted = labels or {}
    values = []
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or sample["name"] != name:
            continue
        found = dict(_LABEL.findall(sample["labels"] or ""))
        if all(found.get(key) == value for key, value in wanted.items()):
            values.append(float(sample["value"]))
    return values


def metric_total(metrics_url: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of series `name` at `metrics_url` whose labels include `labels`
    (0 when there are none)."""
    _, text = http_get(metrics_url)
    return sum(metric_values(text, name, labels))


async def wait_for_instances_async(
    base_url: str, model: str, count: int, *, timeout: float, interval: float = 0.05
) -> float:
    """Seconds until a frontend running on this event loop lists at least `count`
    instances serving `model` in its `/health` (connection errors count as "not yet")."""

    async def enough() -> bool:
        return len(listed_instances(await fetch_json(f"{base_url}/health"), model)) >= count

    return await wait_until_async(
        enough,
        timeout=timeout,
        interval=interval,
        what=f"{count} instances of {model} at {base_url}",
        retry_on=(aiohttp.ClientError,),
    )
