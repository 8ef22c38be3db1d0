"""The next interval's load: a Kalman filter over each observed series.

Why a Kalman filter with a local linear trend: production load ramps (the filter's slope
follows a ramp and anticipates the next interval, where a moving average lags it) and
spikes (a measurement far from the prediction moves the level at once when the filter's
uncertainty is high, and a noisy measurement of few requests moves it little, because
its noise is set per interval from how many requests it counted: a Poisson count of n
requests in T seconds measures the rate with variance n / T²). A seasonal model would
need days of history before it helps; a planner starting cold has minutes.

Why numpy and not a library: the filter is two states and four lines of algebra; the
maintained libraries that offer one (statsmodels' state-space models) would bring scipy,
pandas and patsy into every worker image for it. The measured error against the naive
forecasts is in docs/planner.md ("Forecast").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# State transition of a local linear trend: level += slope each interval.
_F = np.array([[1.0, 1.0], [0.0, 1.0]])
_H = np.array([1.0, 0.0])


@dataclass(eq=False)
class TrendFilter:
    """A local-linear-trend Kalman filter of one non-negative series.

    `level_noise` and `slope_noise` are the process noise as fractions of the level per
    interval (how far the true load may move between intervals on its own): the defaults
    let a level double within about three intervals, and a trend build over a few."""

    level_noise: float = 0.3
    slope_noise: float = 0.1
    trend: bool = True  # False: a local level only (lengths, which do not ramp)
    _x: np.ndarray | None = field(init=False, default=None)  # [level, slope]
    _p: np.ndarray = field(init=False, default_factory=lambda: np.eye(2))
    _last: float = field(init=False, default=0.0)  # the latest measurement

    @property
    def started(self) -> bool:
        return self._x is not None

    def update(self, value: float, variance: float) -> None:
        """Fold in one measurement of the series with its measurement variance."""
        self._last = value
        if self._x is None:
            self._x = np.array([value, 0.0])
            self._p = np.diag([max(variance, 1e-9), (0.5 * max(value, 1.0)) ** 2])
            return
        x, p = self._predict()
        innovation = value - _H @ x
        s = _H @ p @ _H + max(variance, 1e-9)
        gain = p @ _H / s
        self._x = x + gain * innovation
        self._p = (np.eye(2) - np.outer(gain, _H)) @ p
        if not self.trend:
            self._x[1] = 0.0

    def forecast(self) -> float:
        """The value expected one interval ahead (never below 0)."""
        if self._x is None:
            return 0.0
        x, _ = self._predict()
        return max(0.0, float(x[0]))

    def _predict(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._x is not None
        # The process noise scales with the load, the larger of the estimate and the
        # latest measurement: from a level near 0, a spike must still be able to move it.
        scale = max(float(self._x[0]), self._last, 1e-3)
        q = np.diag(
            [(self.level_noise * scale) ** 2, (self.slope_noise * scale if self.trend else 0) ** 2]
        )
        return _F @ self._x, _F @ self._p @ _F.T + q


@dataclass(frozen=True)
class LoadForecast:
    """What the next interval is expected to bring."""

    request_rate: float  # requests/s
    mean_isl: float  # prompt tokens per request
    mean_osl: float  # generated tokens per request


@dataclass(eq=False)
class LoadForecaster:
    """Forecasts of the request rate (with trend) and of the mean lengths (level only).

    The rate is measured as requests per second over the interval; its variance is that
    of a Poisson count, `max(n, 1) / T²`. The lengths' variance is their square over the
    number of requests (a mean of n draws whose spread is of the order of the mean)."""

    rate: TrendFilter = field(default_factory=TrendFilter)
    isl: TrendFilter = field(default_factory=lambda: TrendFilter(level_noise=0.2, trend=False))
    osl: TrendFilter = field(default_factory=lambda: TrendFilter(level_noise=0.2, trend=False))

    def observe(
        self, rate: float, seconds: float, requests: int, isl: float | None, osl: float | None
    ) -> None:
        """One interval's measurements (`isl`/`osl` None when no request ended)."""
        if seconds <= 0:
            return
        self.rate.update(rate, max(requests, 1) / seconds**2)
        n = max(requests, 1)
        if isl is not None:
            self.isl.update(isl, isl**2 / n)
        if osl is not None:
            self.osl.update(osl, osl**2 / n)

    def forecast(self, default_isl: float, default_osl: float) -> LoadForecast:
        """The next interval's load; the defaults stand in for lengths never measured."""
        return LoadForecast(
            request_rate=self.rate.forecast(),
            mean_isl=self.isl.forecast() if self.isl.started else default_isl,
            mean_osl=self.osl.forecast() if self.osl.started else default_osl,
        )
