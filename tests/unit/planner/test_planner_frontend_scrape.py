"""The planner's frontend scraper against frontends' `/metrics` as prometheus_client writes it.

Each fake frontend is a registry with the frontend's series (names, labels and buckets of
`dynamo.frontend.http.metrics`), rendered by `generate_latest` and served by a small aiohttp
server on 127.0.0.1. Claims: the first scrape is a baseline only; a window holds each
series' change since the previous scrape (counters' `_total` samples, histograms' buckets,
sums and counts), of the planned model only, summed over frontends; p90 is interpolated in
its bucket as Prometheus does (the largest finite bound when it falls in `+Inf`); a reset
frontend counts from zero, never negative; a frontend that does not answer is left out,
logged once per outage, and its traffic shows when it answers again; an idle window has
no means.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dynamo.planner.frontend_scrape import FrontendScraper, Reading, bucket_quantile
from dynamo.planner.observation import TrafficWindow
from dynamo.runtime.ports import free_port
from dynamo.testing.clocks import FakeClock

pytestmark = pytest.mark.unit

MODEL = "planned-model"
OTHER = "other-model"
INTERVAL_S = 30.0

# The frontend's buckets (dynamo.frontend.http.metrics).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class FrontendSeries:
    """The frontend's series the planner reads, in a registry of their own (one frontend
    process; a new instance is that frontend restarted)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dynamo_frontend_requests",
            "Requests",
            ["model", "endpoint", "request_type", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "dynamo_frontend_time_to_first_token_seconds",
            "TTFT",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "dynamo_frontend_inter_token_latency_seconds",
            "ITL",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.isl = Histogram(
            "dynamo_frontend_input_sequence_tokens",
            "Prompt tokens",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter("dynamo_frontend_output_tokens", "Out", ["model"], registry=r)
        self.spec_drafts = Counter(
            "dynamo_frontend_spec_decode_drafts", "Drafts", ["model"], registry=r
        )
        self.spec_accepted = Counter(
            "dynamo_frontend_spec_decode_accepted_tokens", "Accepted", ["model"], registry=r
        )
        self.inflight = Gauge(
            "dynamo_frontend_inflight_requests", "In flight", ["model"], registry=r
        )

    def served(
        self,
        model: str = MODEL,
        *,
        prompt: int = 100,
        output: int = 10,
        ttft: float = 0.05,
        itl: float = 0.01,
        status: str = "200",
        endpoint: str = "chat_completions",
    ) -> None:
        """One finished request, recorded as the frontend records it."""
        self.isl.labels(model).observe(prompt)
        self.ttft.labels(model).observe(ttft)
        self.itl.labels(model).observe(itl)
        self.output_tokens.labels(model).inc(output)
        self.requests.labels(model, endpoint, "stream", status).inc()

    def speculated(self, drafts: int, accepted: int, model: str = MODEL) -> None:
        self.spec_drafts.labels(model).inc(drafts)
        self.spec_accepted.labels(model).inc(accepted)


class FakeFrontend:
    """Serves its `series` on `/metrics`; 503 while `up` is false."""

    def __init__(self) -> None:
        self.series = FrontendSeries()
        self.up = True
        self.url = ""

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.up:
            return web.Response(status=503, text="unavailable")
        body = generate_latest(self.series.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@asynccontextmanager
async def serving(count: int) -> AsyncIterator[list[FakeFrontend]]:
    """`count` fake frontends, each on its own ephemeral port of 127.0.0.1."""
    frontends: list[FakeFrontend] = []
    runners: list[web.AppRunner] = []
    try:
        for _ in range(count):
            frontend = FakeFrontend()
            app = web.Application()
            app.router.add_get("/metrics", frontend.metrics)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            host, port = runner.addresses[0][:2]
            frontend.url = f"http://{host}:{port}"
            frontends.append(frontend)
        yield frontends
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def scraper_for(frontends: list[FakeFrontend], clock: FakeClock) -> FrontendScraper:
    return FrontendScraper([f.url for f in frontends], MODEL, clock=clock)


async def next_window(scraper: FrontendScraper, clock: FakeClock) -> TrafficWindow:
    clock.now += INTERVAL_S
    window = await scraper.window()
    assert window is not None
    return window


async def test_first_call_is_a_baseline_then_deltas(clock: FakeClock) -> None:
    async with serving(1) as (frontend,):
        series = frontend.series
        for _ in range(4):  # before the baseline: never in a window
            series.served(prompt=5000, output=500, ttft=2.0, itl=0.5)
        scraper = scraper_for([frontend], clock)
        assert await scraper.window() is None

        series.served(prompt=100, output=20, ttft=0.03, itl=0.004)
        series.served(prompt=300, output=30, ttft=0.2, itl=0.02, status="500")
        series.speculated(drafts=4, accepted=6)
        window = await next_window(scraper, clock)

    assert window.seconds == INTERVAL_S
    assert window.requests == 2  # any status
    assert window.request_rate == pytest.approx(2 / INTERVAL_S)
    assert window.mean_isl == pytest.approx(200)
    assert window.mean_osl == pytest.approx(25)
    assert window.ttft_mean_s == pytest.approx(0.115)
    assert window.itl_mean_s == pytest.approx(0.012)
    assert window.acceptance_length == pytest.approx((4 + 6) / 4)


async def test_requests_piling_up_in_flight_count_as_arrivals(clock: FakeClock) -> None:
    """Under overload completions are capped by the fleet; the in-flight gauge's growth
    is the rest of the demand (`TrafficWindow.arrival_rate`)."""
    async with serving(2) as frontends:
        frontends[0].series.inflight.labels(MODEL).set(3)
        scraper = scraper_for(frontends, clock)
        assert await scraper.window() is None
        frontends[0].series.inflight.labels(MODEL).set(10)  # +7
        frontends[1].series.inflight.labels(MODEL).set(2)  # new: a level, not a change
        frontends[0].series.served()
        window = await next_window(scraper, clock)
        assert window.inflight_change == 7
        assert window.arrival_rate == pytest.approx(8 / INTERVAL_S)
        frontends[0].series.inflight.labels(MODEL).set(0)  # -10: they ended
        frontends[1].series.inflight.labels(MODEL).set(1)  # -1
        window = await next_window(scraper, clock)
    assert window.inflight_change == -11
    assert window.arrival_rate == 0.0  # never negative


async def test_p90_interpolated_inside_a_middle_bucket(clock: FakeClock) -> None:
    async with serving(1) as (frontend,):
        series = frontend.series
        series.served(ttft=20.0)  # baseline only: its bucket must not move the p90
        scraper = scraper_for([frontend], clock)
        await scraper.window()
        for _ in range(5):
            series.served(ttft=0.03)  # bucket (0.025, 0.05]
        for _ in range(5):
            series.served(ttft=0.2)  # bucket (0.1, 0.25]
        window = await next_window(scraper, clock)

    # Rank 0.9 * 10 = 9; 5 requests lie at or below 0.1, all 10 at or below 0.25: the
    # p90 is 4/5 of the way through (0.1, 0.25].
    assert window.ttft_p90_s == pytest.approx(0.1 + (0.25 - 0.1) * (9 - 5) / 5)
    assert window.ttft_p90_s == pytest.approx(0.22)


async def test_p90_beyond_the_last_bound_is_that_bound(clock: FakeClock) -> None:
    async with serving(1) as (frontend,):
        scraper = scraper_for([frontend], clock)
        await scraper.window()
        for _ in range(3):
            frontend.series.served(itl=7.0)  # above ITL's largest bound, 2.5
        window = await next_window(scraper, clock)
    assert window.itl_p90_s == ITL_BUCKETS[-1]


async def test_two_frontends_summed_and_other_models_ignored(clock: FakeClock) -> None:
    async with serving(2) as frontends:
        first, second = (f.series for f in frontends)
        scraper = scraper_for(frontends, clock)
        assert await scraper.window() is None
        first.served(prompt=100, output=10, ttft=0.03)
        first.served(prompt=100, output=10, ttft=0.03, endpoint="completions")
        second.served(prompt=400, output=40, ttft=0.2)
        for _ in range(5):
            second.served(OTHER, prompt=9000, output=900, ttft=50.0)
        first.speculated(drafts=2, accepted=2)
        second.speculated(drafts=2, accepted=4)
        second.speculated(drafts=100, accepted=0, model=OTHER)
        window = await next_window(scraper, clock)

    assert window.requests == 3
    assert window.mean_isl == pytest.approx(200)
    assert window.mean_osl == pytest.approx(20)
    assert window.ttft_mean_s == pytest.approx((0.03 + 0.03 + 0.2) / 3)
    assert window.acceptance_length == pytest.approx((4 + 6) / 4)


async def test_every_address_of_a_host_name_is_scraped(clock: FakeClock) -> None:
    """A headless Service's name resolves to each frontend pod: all are scraped (an
    ordinary Service would hand each scrape to one replica)."""
    port = free_port()
    frontends, runners = [FakeFrontend(), FakeFrontend()], []
    try:
        for frontend, host in zip(frontends, ("127.0.0.1", "127.0.0.2"), strict=True):
            app = web.Application()
            app.router.add_get("/metrics", frontend.metrics)
            runners.append(web.AppRunner(app))
            await runners[-1].setup()
            await web.TCPSite(runners[-1], host, port).start()

        async def resolve(host: str, _port: int) -> list[str]:
            return ["127.0.0.1", "127.0.0.2"] if host == "frontends" else []

        scraper = FrontendScraper([f"http://frontends:{port}"], MODEL, clock=clock, resolve=resolve)
        assert await scraper.window() is None
        frontends[0].series.served()
        frontends[1].series.served()
        frontends[1].series.served()
        window = await next_window(scraper, clock)
    finally:
        for runner in runners:
            await runner.cleanup()
    assert window.requests == 3


async def test_a_restarted_frontend_counts_from_zero(clock: FakeClock) -> None:
    async with serving(2) as frontends:
        steady, restarted = frontends
        for _ in range(10):
            restarted.series.served(prompt=1000, ttft=5.0)
        scraper = scraper_for(frontends, clock)
        await scraper.window()
        steady.series.served(prompt=100, ttft=0.03)
        restarted.series = FrontendSeries()  # the process was replaced: counters from zero
        for _ in range(3):
            restarted.series.served(prompt=100, ttft=0.03)
        window = await next_window(scraper, clock)

    assert window.requests == 4
    assert window.mean_isl == pytest.approx(100)
    assert window.ttft_mean_s == pytest.approx(0.03)
    assert window.ttft_p90_s is not None and 0.025 < window.ttft_p90_s <= 0.05


async def test_a_frontend_down_is_skipped_and_logged_once(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dynamo.planner.frontend_scrape")
    async with serving(2) as frontends:
        up, flaky = frontends
        scraper = scraper_for(frontends, clock)
        await scraper.window()

        flaky.up = False
        flaky.series.served()  # served, but its /metrics does not answer
        up.series.served()
        first = await next_window(scraper, clock)
        up.series.served()
        second = await next_window(scraper, clock)
        warnings = [r for r in caplog.records if flaky.url in r.getMessage()]

        flaky.up = True
        flaky.series.served()
        back = await next_window(scraper, clock)

    assert (first.requests, second.requests) == (1, 1)
    assert len(warnings) == 1  # once per outage, not once per window
    assert back.requests == 2  # its baseline stayed: what it served while away counts


async def test_a_frontend_that_refuses_connections(clock: FakeClock) -> None:
    async with serving(1) as (gone,):
        closed_url = gone.url
    async with serving(1) as (frontend,):
        scraper = FrontendScraper([closed_url, frontend.url], MODEL, clock=clock)
        await scraper.window()
        frontend.series.served()
        window = await next_window(scraper, clock)
    assert window.requests == 1


async def test_no_window_while_no_frontend_answers(clock: FakeClock) -> None:
    async with serving(1) as (frontend,):
        scraper = scraper_for([frontend], clock)
        await scraper.window()
        frontend.up = False
        clock.now += INTERVAL_S
        assert await scraper.window() is None
        frontend.up = True
        frontend.series.served()
        window = await next_window(scraper, clock)
    # The window runs from the last scrape that saw the frontend, like its counters.
    assert window.seconds == 2 * INTERVAL_S
    assert window.requests == 1


async def test_an_idle_window_has_no_means(clock: FakeClock) -> None:
    async with serving(1) as (frontend,):
        frontend.series.served()
        frontend.series.speculated(drafts=3, accepted=3)
        scraper = scraper_for([frontend], clock)
        await scraper.window()
        window = await next_window(scraper, clock)
    assert window == TrafficWindow(seconds=INTERVAL_S)
    assert window.request_rate == 0.0


def test_quantile_as_prometheus_estimates_it() -> None:
    inf = float("inf")
    assert bucket_quantile(0.9, {1.0: 0, 2.0: 10, inf: 10}) == pytest.approx(1.9)
    assert bucket_quantile(0.5, {1.0: 2, 2.0: 2, inf: 8}) == 2.0  # in +Inf: the last bound
    assert bucket_quantile(0.5, {1.0: 10, inf: 10}) == pytest.approx(0.5)  # first from 0
    assert bucket_quantile(0.9, {1.0: 0, inf: 0}) is None
    assert bucket_quantile(0.9, {1.0: 3}) is None  # no +Inf bucket: not a histogram


def resets() -> Iterator[tuple[Reading, Reading, float]]:
    """(before, now, the change counted)."""
    yield Reading(value=10), Reading(value=14), 4
    yield Reading(value=10), Reading(value=3), 3  # went down: since zero
    yield Reading(value=2, created=1.0), Reading(value=5, created=2.0), 5  # recreated


@pytest.mark.parametrize(("before", "now", "change"), list(resets()))
def test_a_reset_counts_since_zero(before: Reading, now: Reading, change: float) -> None:
    assert now.since(before).value == change
