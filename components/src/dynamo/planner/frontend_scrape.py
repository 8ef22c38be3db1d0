"""The frontends' `/metrics` → one `TrafficWindow` per planner interval.

The frontends already count everything the planner needs (requests, prompt and output
lengths, TTFT and ITL histograms, speculative steps), as cumulative Prometheus series.
`FrontendScraper` reads them over HTTP, so it needs no Prometheus server and no hook in
the frontend, and turns two consecutive scrapes into the window between them.

Rules that keep a window honest:

* Only series whose `model` label is the planned model count; every frontend's are
  summed (frontend replicas, or `--http-workers` processes answering for each other).
* A window is the difference of each series between this scrape and the previous one of
  the same frontend. A series that went down, or whose `_created` time changed, was
  reset (the frontend restarted, an `--http-workers` child was replaced): its new value is
  taken as counted since zero, as Prometheus' `rate()` does, never as a negative delta.
  A histogram resets as a whole (its buckets, sum and count together), so its buckets
  stay cumulative.
* A frontend that does not answer is left out of the window and keeps its previous
  scrape as its baseline: what it served meanwhile shows in the window where it answers
  again (that window then holds more than its `seconds` of that frontend's traffic; the
  alternative, dropping it, would hide traffic). Its outage is logged once.
* A URL whose host name resolves to several addresses is scraped at each of them: a
  Kubernetes headless Service names every frontend pod, where an ordinary Service would
  hand each scrape to one replica of its choosing (half the traffic, a different half
  each time). A name with one address is scraped as given.
* The exposition is parsed by prometheus_client, and samples are looked up by their own
  names (`..._total`, `..._bucket`, `..._sum`, `..._count`, `..._created`): the parser
  names a counter's family without `_total` but its samples with it, and writes
  `_created` as a family of its own, so family names would mislead.

The series' names mirror `dynamo.frontend.http.metrics` (which the planner may not import).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dynamo.planner.observation import TrafficWindow

log = logging.getLogger(__name__)

PREFIX = "dynamo_frontend"
REQUESTS = f"{PREFIX}_requests"
OUTPUT_TOKENS = f"{PREFIX}_output_tokens"
SPEC_DRAFTS = f"{PREFIX}_spec_decode_drafts"
SPEC_ACCEPTED = f"{PREFIX}_spec_decode_accepted_tokens"
COUNTERS = (REQUESTS, OUTPUT_TOKENS, SPEC_DRAFTS, SPEC_ACCEPTED)
"""Counters read, by family name (their samples add `_total`)."""
TTFT = f"{PREFIX}_time_to_first_token_seconds"
ITL = f"{PREFIX}_inter_token_latency_seconds"
ISL = f"{PREFIX}_input_sequence_tokens"
HISTOGRAMS = (TTFT, ITL, ISL)
INFLIGHT = f"{PREFIX}_inflight_requests"
GAUGES = (INFLIGHT,)
"""Gauges read: their change over a window is a plain difference (a level, not a count)."""

DEFAULT_TIMEOUT_S = 5.0
"""Longest one scrape may take: far below any planner interval, so one hung frontend
cannot delay the decision."""
P90 = 0.9

Clock = Callable[[], float]
"""Monotonic seconds; only differences between two readings matter."""

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""A host name and port → the IPv4 addresses to scrape."""


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """Every IPv4 address of `host` (IPv4 only: "localhost" must not count twice)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return sorted({str(info[4][0]) for info in infos})


class Part(enum.Enum):
    """What one sample of a series is."""

    VALUE = enum.auto()  # a counter's value, or a histogram's `_count`
    SUM = enum.auto()
    BUCKET = enum.auto()
    CREATED = enum.auto()


def _sample_parts() -> dict[str, tuple[str, Part]]:
    parts: dict[str, tuple[str, Part]] = {}
    for name in COUNTERS:
        parts[f"{name}_total"] = (name, Part.VALUE)
        parts[f"{name}_created"] = (name, Part.CREATED)
    for name in GAUGES:
        parts[name] = (name, Part.VALUE)
    for name in HISTOGRAMS:
        parts[f"{name}_count"] = (name, Part.VALUE)
        parts[f"{name}_sum"] = (name, Part.SUM)
        parts[f"{name}_bucket"] = (name, Part.BUCKET)
        parts[f"{name}_created"] = (name, Part.CREATED)
    return parts


SAMPLE_PARTS = _sample_parts()
"""Sample name → (series name, part), for every sample the planner reads."""

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class SeriesKey:
    """One series of a frontend: its name and labels (a histogram's without `le`)."""

    name: str
    labels: Labels


@dataclass
class Reading:
    """A series' values in one scrape, or their change over a window: a counter's value,
    or a histogram's count, sum and cumulative bucket counts (by upper bound)."""

    value: float = 0.0
    sum: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    created: float | None = None  # the series' start (absent in multiprocess mode)

    def since(self, before: Reading | None) -> Reading:
        """The change since `before`; all of this reading when there was no `before` or
        the series was reset in between (counted since zero)."""
        if before is None or self.reset_since(before):
            return Reading(self.value, self.sum, dict(self.buckets))
        buckets = {le: count - before.buckets.get(le, 0.0) for le, count in self.buckets.items()}
        return Reading(self.value - before.value, self.sum - before.sum, buckets)

    def reset_since(self, before: Reading) -> bool:
        if None not in (self.created, before.created) and self.created != before.created:
            return True
        if self.value < before.value or self.sum < before.sum:
            return True
        return any(count < before.buckets.get(le, 0.0) for le, count in self.buckets.items())

    def add(self, other: Reading) -> None:
        """Accumulate `other` (another series or frontend) into this reading."""
        self.value += other.value
        self.sum += other.sum
        for le, count in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + count


Scrape = dict[SeriesKey, Reading]
"""One frontend's series of the planned model."""


def parse_exposition(text: str, model: str) -> Scrape:
    """The planner's series of `model` in a Prometheus text exposition. Raises
    `ValueError` when the text is not an exposition."""
    scrape: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            known = SAMPLE_PARTS.get(sample.name)
            if known is None or sample.labels.get("model") != model:
                continue
            name, part = known
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            reading = scrape.setdefault(SeriesKey(name, labels), Reading())
            if part is Part.VALUE:
                reading.value = sample.value
            elif part is Part.SUM:
                reading.sum = sample.value
            elif part is Part.BUCKET:
                reading.buckets[_upper_bound(sample.labels)] = sample.value
            else:
                reading.created = sample.value
    return scrape


def _upper_bound(labels: Mapping[str, str]) -> float:
    le = labels.get("le")
    if le is None:
        raise ValueError("histogram bucket without an `le` label")
    return float(le)


def scrape_delta(now: Scrape, before: Scrape) -> Scrape:
    """Each series' change between two scrapes of one frontend (a new counter counts from
    zero, a reset one too; a gauge changes by its difference, 0 when new)."""
    return {
        key: _gauge_change(reading, before.get(key))
        if key.name in GAUGES
        else reading.since(before.get(key))
        for key, reading in now.items()
    }


def _gauge_change(now: Reading, before: Reading | None) -> Reading:
    return Reading(now.value - before.value) if before is not None else Reading()


def totals(deltas: Iterable[Scrape]) -> dict[str, Reading]:
    """The deltas summed by series name, over labels and frontends."""
    summed: dict[str, Reading] = {}
    for delta in deltas:
        for key, reading in delta.items():
            summed.setdefault(key.name, Reading()).add(reading)
    return summed


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The `q` quantile of a histogram's cumulative buckets (upper bound → count), as
    Prometheus' `histogram_quantile` estimates it: linear inside the bucket where the
    cumulative count reaches `q` of the total; the largest finite bound when that is the
    `+Inf` bucket. None when the histogram is empty or has no `+Inf` bucket."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile {q} outside (0, 1]")
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    # Summed or reset deltas can be slightly out of order: keep the counts cumulative.
    counts: list[float] = []
    for bound in bounds:
        counts.append(max(buckets[bound], counts[-1] if counts else 0.0))
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if index == len(bounds) - 1:
        return bounds[-2] if len(bounds) > 1 else None
    upper = bounds[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[index - 1], counts[index - 1]
    return lower + (upper - lower) * (rank - below) / (counts[index] - below)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def traffic_window(summed: Mapping[str, Reading], seconds: float) -> TrafficWindow:
    """The window described by summed deltas (`totals`)."""
    empty = Reading()
    requests = summed.get(REQUESTS, empty).value
    ttft = summed.get(TTFT, empty)
    itl = summed.get(ITL, empty)
    isl = summed.get(ISL, empty)
    drafts = summed.get(SPEC_DRAFTS, empty).value
    accepted = summed.get(SPEC_ACCEPTED, empty).value
    return TrafficWindow(
        seconds=seconds,
        requests=round(requests),
        mean_isl=_ratio(isl.sum, isl.value),
        mean_osl=_ratio(summed.get(OUTPUT_TOKENS, empty).value, requests),
        ttft_mean_s=_ratio(ttft.sum, ttft.value),
        ttft_p90_s=bucket_quantile(P90, ttft.buckets),
        itl_mean_s=_ratio(itl.sum, itl.value),
        itl_p90_s=bucket_quantile(P90, itl.buckets),
        acceptance_length=_ratio(drafts + accepted, drafts),
        inflight_change=round(summed.get(INFLIGHT, empty).value),
    )


def metrics_url(url: str) -> str:
    """A frontend's `/metrics` address, from its base URL (or the address itself)."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


class FrontendScraper:
    """Scrapes every frontend's `/metrics` once per `window()` call, for one model.

    The first call (and any call where no frontend answers) only records where the
    counters stand and returns None; later calls return the traffic since the previous
    call that got an answer (`seconds` by the monotonic `clock`)."""

    def __init__(
        self,
        urls: list[str],
        model: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Clock = time.monotonic,
        resolve: Resolver = resolve_ipv4,
    ) -> None:
        if not urls:
            raise ValueError("need at least one frontend URL")
        self.urls = list(dict.fromkeys(metrics_url(url) for url in urls))  # each once
        self.model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._resolve = resolve
        self._baselines: dict[str, Scrape] = {}
        self._since: float | None = None  # when the previous answered call scraped
        self._down: set[str] = set()

    async def window(self) -> TrafficWindow | None:
        """The traffic since the previous call; None on the first call or when no
        frontend answered (the planner then has nothing new to go on)."""
        now = self._clock()
        urls = [url for given in self.urls for url in await self._addresses(given)]
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            scrapes = await asyncio.gather(*(self._scrape(session, url) for url in urls))
        deltas: list[Scrape] = []
        for url, scrape in zip(urls, scrapes, strict=True):
            if scrape is None:
                continue
            before = self._baselines.get(url)
            if before is not None:
                deltas.append(scrape_delta(scrape, before))
            self._baselines[url] = scrape
        if all(scrape is None for scrape in scrapes):
            return None
        since, self._since = self._since, now
        if since is None:
            return None
        return traffic_window(totals(deltas), now - since)

    async def _addresses(self, url: str) -> list[str]:
        """`url` once per address of its host when it has several, else `url` itself (an
        IP literal, a name with one address, or one that does not resolve now: its
        scrape then fails and says so)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        try:
            ipaddress.ip_address(host)
            return [url]
        except ValueError:
            pass
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await self._resolve(host, port)
        except OSError:
            return [url]
        if len(addresses) <= 1:
            return [url]
        return [urlunsplit(parts._replace(netloc=f"{a}:{port}")) for a in addresses]

    async def _scrape(self, session: aiohttp.ClientSession, url: str) -> Scrape | None:
        """One frontend's series, or None (logged once per outage) when it did not answer
        with an exposition."""
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                text = await resp.text()
            scrape = parse_exposition(text, self.model)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if url not in self._down:
                self._down.add(url)
                log.warning(
                    "planner: frontend %s not scraped (%s); left out until it answers",
                    url,
                    str(exc) or type(exc).__name__,
                )
            return None
        if url in self._down:
            self._down.discard(url)
            log.info("planner: frontend %s answers again", url)
        return scrape
