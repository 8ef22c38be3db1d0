"""Per-model admission control: how many requests the frontend takes on at once.

Without a bound, a burst the workers cannot absorb piles up inside the frontend: every
request holds its prompt, a task, a NATS stream and later a router booking, latency grows
for everyone, and memory with it. So each model has two counters, checked before any
work is done for a request (right after its body is decoded and its model looked up,
before templating and tokenization):

* requests in flight (admitted and not finished, streaming included), at most
  `max_inflight`;
* of those, requests waiting for a ready worker (the model momentarily has none: a
  restart, a late heartbeat), at most `max_waiting`.

A request over either bound is refused at once (`AdmissionRejected`; the HTTP layer
answers 503 with `Retry-After`); nothing queues without bound. The counters are plain
integers on the event loop: checking one costs a dict lookup.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

from dynamo.runtime.cli import non_negative_int, positive_int
from dynamo.runtime.settings import Flag, setting

# One frontend process streams at most a few hundred requests at full speed before its
# event loop is the bottleneck; beyond ~1000 per model, admitting more only adds latency
# for every stream. A deployment with more worker capacity per model raises it.
DEFAULT_MAX_INFLIGHT = 1024
# Requests waiting for a worker wait up to --worker-wait-timeout each; more than a few
# hundred of them means the outage is not momentary, and failing fast with Retry-After
# lets clients back off instead of piling up.
DEFAULT_MAX_WAITING = 256
# Seconds a refused client is told to wait before retrying (`Retry-After`).
RETRY_AFTER_S = 1


class RejectReason(StrEnum):
    """Which bound refused a request: the `reason` label of the rejection metric."""

    INFLIGHT_LIMIT = "inflight_limit"
    WORKER_WAIT_LIMIT = "worker_wait_limit"


@dataclass(frozen=True)
class AdmissionLimits:
    """The per-model bounds (`--max-inflight-requests`, `--max-waiting-requests`)."""

    max_inflight: int = setting(
        DEFAULT_MAX_INFLIGHT,
        Flag(
            "--max-inflight-requests",
            "Per model, the most requests admitted at once (streams included); more get "
            "503 with Retry-After at once. $DYN_MAX_INFLIGHT_REQUESTS overrides the default.",
            type=positive_int,
            env="DYN_MAX_INFLIGHT_REQUESTS",
        ),
    )
    max_waiting: int = setting(
        DEFAULT_MAX_WAITING,
        Flag(
            "--max-waiting-requests",
            "Per model, the most requests waiting for a ready worker (see "
            "--worker-wait-timeout); more get 503 with Retry-After at once. "
            "$DYN_MAX_WAITING_REQUESTS overrides the default.",
            type=non_negative_int,
            env="DYN_MAX_WAITING_REQUESTS",
        ),
    )

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_waiting < 0:
            raise ValueError(
                f"admission limits need max_inflight >= 1 and max_waiting >= 0, got {self}"
            )


class AdmissionRejected(Exception):
    """A request refused because a bound of its model is reached."""

    def __init__(self, model: str, reason: RejectReason, limit: int) -> None:
        super().__init__(f"{model}: {reason} ({limit}) reached")
        self.model = model
        self.reason = reason
        self.limit = limit


@dataclass
class _Places:
    """One bounded counter of a model's places: how many are held."""

    held: int = 0

    @contextmanager
    def hold(self, model: str, limit: int, reason: RejectReason) -> Iterator[None]:
        """Hold one place for the block; `AdmissionRejected` at once when `limit` are."""
        if self.held >= limit:
            raise AdmissionRejected(model, reason, limit)
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1


@dataclass
class _Counts:
    inflight: _Places = field(default_factory=_Places)
    waiting: _Places = field(default_factory=_Places)


class AdmissionControl:
    """The counters of every model with requests in flight (a model's entry goes away
    with its last request, so models that come and go leave nothing behind)."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self._counts: dict[str, _Counts] = {}

    def inflight(self, model: str) -> int:
        counts = self._counts.get(model)
        return counts.inflight.held if counts is not None else 0

    def waiting(self, model: str) -> int:
        counts = self._counts.get(model)
        return counts.waiting.held if counts is not None else 0

    @contextmanager
    def admit(self, model: str) -> Iterator[None]:
        """Hold one of `model`'s in-flight places for the block; `AdmissionRejected` at
        once when none is free."""
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = _Counts()
        try:
            with counts.inflight.hold(model, self.limits.max_inflight, RejectReason.INFLIGHT_LIMIT):
                yield
        finally:
            if counts.inflight.held == 0:
                del self._counts[model]

    @contextmanager
    def waiting_for_worker(self, model: str) -> Iterator[None]:
        """Hold one of `model`'s places for waiting on a worker (inside `admit`);
        `AdmissionRejected` at once when none is free."""
        counts = self._counts.get(model)
        if counts is None:
            raise RuntimeError(f"waiting_for_worker({model!r}) outside admit({model!r})")
        with counts.waiting.hold(model, self.limits.max_waiting, RejectReason.WORKER_WAIT_LIMIT):
            yield
