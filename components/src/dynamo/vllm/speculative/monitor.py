"""Watches a running worker's speculation against its `--speculation-profile`.

The profile's schedule was chosen from acceptance measured on the prompts it was profiled
with; when live traffic accepts drafts much more or less often, another K would be faster,
and nothing in vLLM says so. The monitor is fed the engine's cumulative counters (whenever
load is published or `/metrics` is scraped) and keeps:

* the K in force for the current running batch (on an adaptive worker, the K its scheduler
  chose last; otherwise the schedule's, capped at the static K as vLLM caps it; the static
  K without a schedule; 0 without speculation);
* the acceptance length (`1 + accepted / drafts`) over fixed windows of `window_s`;
* the profile's expected acceptance length at the K in force;
* a drift check: at the end of each window with enough drafts, a first-position acceptance
  rate more than `tolerance` (relative) away from the profile's logs one warning.

The first position is compared because its rate does not depend on K (every draft has a
first token), so windows under different K stay comparable with one profiled number.
Pure arithmetic on plain numbers: no vLLM import, so it is unit-tested with a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dynamo.llm.acceptance import acceptance_length
from dynamo.llm.protocols import SpeculativeInfo
from dynamo.llm.speculation_profile import (
    Schedule,
    SpeculationProfile,
    k_for_batch,
    tokens_per_step,
)
from dynamo.vllm.speculative.k_in_force import SpeculationSnapshot

log = logging.getLogger("dynamo.vllm")

DEFAULT_WINDOW_S = 60.0
MIN_DRAFTS = 100
"""Fewer drafts in a window than this say too little about acceptance to warn on."""
DRIFT_TOLERANCE = 0.3
"""Relative difference of the first-position acceptance rate that counts as drift."""


class SpecCounters(Protocol):
    """The cumulative counters the monitor reads (`engine_stats.SpecDecodeTotals`)."""

    num_drafts: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]


@dataclass(frozen=True)
class SpecWindow:
    """Speculation over one window: the differences of the cumulative counters."""

    start: float
    end: float
    drafts: int = 0
    accepted: int = 0
    first_accepted: int = 0

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verification step (bonus token included); None without drafts."""
        return acceptance_length(self.accepted, self.drafts) if self.drafts else None

    @property
    def first_position_rate(self) -> float | None:
        """Fraction of drafts whose first token was accepted; None without drafts."""
        return self.first_accepted / self.drafts if self.drafts else None


@dataclass(frozen=True)
class _Totals:
    """A copy of the cumulative counters at a window's start."""

    drafts: int = 0
    accepted: int = 0
    first_accepted: int = 0

    @classmethod
    def of(cls, spec: SpecCounters) -> _Totals:
        per_pos = spec.accepted_per_pos
        return cls(
            int(spec.num_drafts), int(spec.num_accepted_tokens), int(per_pos[0]) if per_pos else 0
        )


class SpeculationMonitor:
    """K in force, windowed acceptance and profile drift for one worker (thread-safe:
    observed from the event loop and from the metrics scrape)."""

    def __init__(
        self,
        profile: SpeculationProfile | None,
        schedule: Schedule | None,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        *,
        static_k: int = 0,
        min_drafts: int = MIN_DRAFTS,
        tolerance: float = DRIFT_TOLERANCE,
        adapted: Callable[[], SpeculationSnapshot | None] | None = None,
    ) -> None:
        """`adapted`: what an adaptive scheduler chose (None until it chose a K); without
        it, or while it has none, K is the schedule's."""
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.profile = profile
        self.schedule = [list(entry) for entry in schedule] if schedule else None
        self.static_k = max(0, int(static_k))
        self.window_s = float(window_s)
        self.min_drafts = min_drafts
        self.tolerance = tolerance
        self._clock = clock
        self._adapted = adapted
        self.steps_at_k: tuple[int, ...] = ()
        """An adaptive engine's decoding steps at each K so far (empty otherwise)."""
        self._lock = threading.Lock()
        self._window_start = clock()
        # The engine's counters start at zero with the engine, before the monitor exists.
        self._base = _Totals()
        self._current = SpecWindow(self._window_start, self._window_start)
        self.last_window: SpecWindow | None = None
        """The last complete window (None until one ends)."""
        self.k_in_force = self.k_for_running(0)
        self.drift_warnings = 0

    @classmethod
    def for_engine(
        cls,
        profile: SpeculationProfile | None,
        info: SpeculativeInfo | None,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        *,
        adapted: Callable[[], SpeculationSnapshot | None] | None = None,
    ) -> SpeculationMonitor:
        """A monitor for what the engine actually runs (vLLM's resolved config, as the
        model card advertises it), so K is the engine's, not the command line's."""
        if info is None:
            return cls(profile, None, window_s, clock)
        return cls(
            profile,
            info.schedule,
            window_s,
            clock,
            static_k=info.num_speculative_tokens,
            adapted=adapted if info.adaptive else None,
        )

    def k_for_running(self, running: int) -> int:
        """The K vLLM runs with `running` scheduled sequences (an idle engine's next step
        has one); vLLM caps every scheduled K at `num_speculative_tokens`."""
        if not self.schedule:
            return self.static_k
        k = k_for_batch(self.schedule, max(running, 1))
        return min(k, self.static_k) if self.static_k else k

    def _k_now(self, running: int) -> int:
        """The adaptive scheduler's last K where there is one, else the schedule's."""
        snapshot = self._adapted() if self._adapted is not None else None
        if snapshot is None:
            return self.k_for_running(running)
        self.steps_at_k = snapshot.steps_at_k
        return snapshot.k

    def observe(self, running: int, spec: SpecCounters) -> None:
        """Take the engine's current batch size and cumulative counters; closes the window
        (and checks drift) once `window_s` has passed since it started."""
        with self._lock:
            now = self._clock()
            self.k_in_force = self._k_now(running)
            totals = _Totals.of(spec)
            if totals.drafts < self._base.drafts:  # counters from another source: restart
                self._base = totals
            self._current = SpecWindow(
                self._window_start,
                now,
                totals.drafts - self._base.drafts,
                totals.accepted - self._base.accepted,
                totals.first_accepted - self._base.first_accepted,
            )
            if now - self._window_start >= self.window_s:
                self._close_window(now, totals)

    def _close_window(self, now: float, totals: _Totals) -> None:
        """End the current window: keep it as the last one, warn on drift, start anew."""
        self.last_window = self._current
        self._check_drift(self._current)
        self._window_start, self._base = now, totals
        self._current = SpecWindow(now, now)

    def _check_drift(self, window: SpecWindow) -> None:
        """One warning per window whose first-position acceptance strays from the profile's."""
        expected = self.profiled_first_position_rate
        measured = window.first_position_rate
        if expected is None or measured is None or window.drafts < self.min_drafts:
            return
        if abs(measured - expected) <= self.tolerance * expected:
            return
        self.drift_warnings += 1
        log.warning(
            "speculation drifted from --speculation-profile: first draft token accepted "
            "%.2f of the time over the last %.0fs (%d drafts), the profile measured %.2f "
            "(method %s, prompts %s, %s); its schedule may no longer be the fastest: "
            "re-run `python -m dynamo.vllm.profile_spec` on current traffic",
            measured,
            window.end - window.start,
            window.drafts,
            expected,
            self.profile.method if self.profile else "?",
            (self.profile.prompts if self.profile else "") or "unknown",
            (self.profile.measured_at if self.profile else "") or "undated",
        )

    @property
    def profiled_first_position_rate(self) -> float | None:
        """The profile's acceptance rate of the first draft position (None: no profile)."""
        if self.profile is None or not self.profile.acceptance_per_position:
            return None
        return float(self.profile.acceptance_per_position[0])

    @property
    def current_window(self) -> SpecWindow:
        """The window in progress, as of the last `observe`."""
        return self._current

    @property
    def window_acceptance_length(self) -> float | None:
        """The last complete window's acceptance length, or the current window's before
        one has ended; None while that window saw no drafts."""
        window = self.last_window or self._current
        return window.acceptance_length

    @property
    def profile_acceptance_length(self) -> float | None:
        """What the profile expects per step at the K in force (None: no profile, or a K
        beyond the positions it measured)."""
        if self.profile is None or self.k_in_force > len(self.profile.acceptance_per_position):
            return None
        return tokens_per_step(self.profile.acceptance_per_position, self.k_in_force)
