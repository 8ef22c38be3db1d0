"""The frontend process wired together: its settings (`FrontendConfig`) and `run_frontend`,
which connects to NATS, keeps the model registry in step with the cards
(`models.card_sync.ModelCardSync`) and serves HTTP until told to stop.

This and `models.card_sync` are the frontend modules that connect to NATS and watch
model cards; everything else is tested without a broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.frontend.engine.client import (
    DEFAULT_ACCEPT_TIMEOUT_S,
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_INTER_TOKEN_TIMEOUT_S,
    StreamDeadlines,
)
from dynamo.frontend.engine.disagg import DEFAULT_PREFILL_TIMEOUT_S
from dynamo.frontend.engine.prefill_policy import DISAGG_GROUP, DisaggSettings
from dynamo.frontend.engine.routing import RouterSettings, make_router_factory
from dynamo.frontend.http.listener import share_port_across_processes
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.server import HttpService
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.http.workers import HttpWorkerSlot
from dynamo.frontend.models.card_sync import ModelCardSync
from dynamo.frontend.models.manager import ModelManager
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.cli import non_negative_float, positive_float
from dynamo.runtime.nats_address import DEFAULT_NATS_URL
from dynamo.runtime.nats_options import NatsConnectOptions
from dynamo.runtime.settings import Flag, nested, setting

log = logging.getLogger(__name__)


def default_tokenizer_cache() -> Path:
    return Path.home() / ".cache" / "dynamo" / "frontend-tokenizers"


DEADLINES_GROUP = "Request deadlines"


@dataclass(frozen=True)
class FrontendConfig:
    """Settings of one frontend process. The fields with a flag (`setting`, and those of
    the nested `HttpSettings` and `RouterSettings`) make `python -m dynamo.frontend`'s
    command line (`__main__.build_parser`); the others are filled from flags that need
    more than a type (a file read, several flags combined)."""

    http: HttpSettings = nested(HttpSettings)
    router: RouterSettings = nested(RouterSettings)
    disagg: DisaggSettings = nested(DisaggSettings)
    namespace: str = setting(
        "dynamo",
        Flag("--namespace", "Dynamo namespace whose model cards (workers) this frontend serves."),
    )
    nats_server: str = DEFAULT_NATS_URL
    nats_options: NatsConnectOptions | None = None  # None: the NATS_* variables
    tokenizer_cache: Path = setting(
        default_tokenizer_cache(),
        Flag(
            "--tokenizer-cache",
            "Directory where tokenizer files fetched from the model cards are kept.",
            type=Path,
        ),
    )
    prefill_timeout_s: float = setting(
        DEFAULT_PREFILL_TIMEOUT_S,
        Flag(
            "--prefill-timeout",
            "Seconds a disaggregated request waits for its prefill worker before the decode "
            "worker prefills it itself (counted in dynamo_frontend_prefill_fallbacks_total).",
            type=positive_float,
            group=DISAGG_GROUP,
        ),
    )
    first_token_timeout_s: float = setting(
        DEFAULT_FIRST_TOKEN_TIMEOUT_S,
        Flag(
            "--first-token-timeout",
            "Seconds a worker may take to send a request's first output (a long prefill "
            "under load) before it counts as lost: the request is cancelled there and "
            "placed on another worker, or fails. 0 disables; $DYN_FIRST_TOKEN_TIMEOUT "
            "overrides the default.",
            type=non_negative_float,
            env="DYN_FIRST_TOKEN_TIMEOUT",
            group=DEADLINES_GROUP,
        ),
    )
    inter_token_timeout_s: float = setting(
        DEFAULT_INTER_TOKEN_TIMEOUT_S,
        Flag(
            "--inter-token-timeout",
            "Seconds a worker may go between two outputs of a request before it counts as "
            "lost (it holds its lease but stopped producing): the request is cancelled "
            "there and migrated (the workers' --migration-limit) or fails with an error "
            "event. 0 disables; $DYN_INTER_TOKEN_TIMEOUT overrides the default.",
            type=non_negative_float,
            env="DYN_INTER_TOKEN_TIMEOUT",
            group=DEADLINES_GROUP,
        ),
    )
    accept_timeout_s: float = setting(
        DEFAULT_ACCEPT_TIMEOUT_S,
        Flag(
            "--accept-timeout",
            "Seconds a worker may take to confirm that a request reached it (it does so "
            "at once, before any compute) before the request counts as lost on its way (a "
            "NATS node failing while routing it) or the worker as frozen: the request is "
            "cancelled there and placed on another worker. 0 disables; $DYN_ACCEPT_TIMEOUT "
            "overrides the default.",
            type=non_negative_float,
            env="DYN_ACCEPT_TIMEOUT",
            group=DEADLINES_GROUP,
        ),
    )
    chat_template: str | None = None  # --chat-template: Jinja source replacing the model's
    chat_parsing: ChatParsingOptions = field(default_factory=ChatParsingOptions)
    # One of `--http-workers` processes (`http/workers.py`): the port is shared
    # (SO_REUSEPORT) and /metrics sums every process's files in `metrics_dir`.
    http_worker: HttpWorkerSlot | None = None
    metrics_dir: Path | None = None

    @property
    def shared_port(self) -> bool:
        return self.http_worker is not None

    @property
    def stream_deadlines(self) -> StreamDeadlines:
        return StreamDeadlines.from_seconds(
            self.first_token_timeout_s, self.inter_token_timeout_s, self.accept_timeout_s
        )


FIRST_CARDS_WAIT_S = 30.0
"""Longest a frontend waits for the cards registered when it starts before it listens.
A process that listened first would answer 404 for models it has not loaded yet: a child
started again under `--http-workers` shares its port with a sibling that serves them, so
the kernel hands it clients at once. Past the bound it listens anyway (and says so)."""


async def run_frontend(config: FrontendConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever): connect, watch cards, serve HTTP."""
    stop = stop or asyncio.Event()
    runtime = await DistributedRuntime.connect(
        config.nats_server, name="frontend", wait_for_server=30, options=config.nats_options
    )
    if config.shared_port:
        share_port_across_processes()
    metrics = FrontendMetrics(multiprocess_dir=config.metrics_dir)
    manager = ModelManager(
        load_preprocessor=functools.partial(
            Preprocessor.from_dir, chat_template=config.chat_template
        ),
        on_prefill_fallback=metrics.prefill_fallback,
        prefill_timeout_s=config.prefill_timeout_s,
        disagg=config.disagg,
        on_prefill_decision=metrics.prefill_decision,
    )
    service = HttpService(
        manager,
        metrics=metrics,
        settings=config.http,
        chat_parsing=config.chat_parsing,
        http_worker=config.http_worker,
    )
    watcher: asyncio.Task[None] | None = None
    try:
        router_factory = make_router_factory(config.router, runtime)
        sync = ModelCardSync(
            runtime,
            manager,
            router_factory,
            config.tokenizer_cache,
            deadlines=config.stream_deadlines,
            on_migration=metrics.migration,
            on_routed=metrics.routed,
            busy_queue=config.router.busy_queue,
            queue_observer=metrics,
        )
        watcher = asyncio.create_task(sync.run(config.namespace))
        await _first_cards(sync, watcher)
        await service.start()
        await _wait_either(stop, watcher)
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
        await service.stop()
        await manager.close()
        await _close_runtime(runtime)


async def _first_cards(sync: ModelCardSync, watcher: asyncio.Task[None]) -> None:
    """Wait (at most FIRST_CARDS_WAIT_S) for the cards registered at start to be applied,
    so that the first request this process answers finds the models that already exist.
    A watcher that fails returns at once: `_wait_either` raises its error."""
    synced = asyncio.create_task(sync.synced.wait())
    try:
        done, _ = await asyncio.wait(
            {synced, watcher}, timeout=FIRST_CARDS_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        synced.cancel()
    if not done:
        log.warning(
            "the models registered at start were not all loaded within %gs; "
            "listening anyway (requests for them get 404 until they are)",
            FIRST_CARDS_WAIT_S,
        )


async def _wait_either(stop: asyncio.Event, watcher: asyncio.Task[None]) -> None:
    """Return when asked to stop; raise if the card watcher died (the frontend would
    silently stop learning about workers otherwise)."""
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({stopper, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
        raise RuntimeError("model card watcher failed") from watcher.exception()


async def _close_runtime(runtime: DistributedRuntime) -> None:
    with contextlib.suppress(Exception):
        await runtime.shutdown(drain_timeout=0)
