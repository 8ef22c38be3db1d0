"""The HTTP hardening flags: defaults, `DYN_*` variables, flags over variables, refusal of
values that would disable a bound by accident."""

from __future__ import annotations

import pytest

from dynamo.frontend.__main__ import build_parser, config_from_args
from dynamo.frontend.http.admission import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_WAITING
from dynamo.frontend.http.listener import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S
from dynamo.frontend.http.settings import DEFAULT_WRITE_TIMEOUT_S
from dynamo.testing.environment import unset_variables_fixture

VARIABLES = (
    "DYN_API_KEY",
    "DYN_MAX_INFLIGHT_REQUESTS",
    "DYN_MAX_WAITING_REQUESTS",
    "DYN_HTTP_KEEP_ALIVE_TIMEOUT",
    "DYN_HTTP_HEADER_TIMEOUT",
    "DYN_HTTP_WRITE_TIMEOUT",
)

clean_environment = unset_variables_fixture(*VARIABLES)


def test_defaults() -> None:
    config = config_from_args(build_parser().parse_args([]))
    assert config.http.api_key is None
    assert (config.http.admission.max_inflight, config.http.admission.max_waiting) == (
        DEFAULT_MAX_INFLIGHT,
        DEFAULT_MAX_WAITING,
    )
    assert (
        config.http.timeouts.keep_alive_s,
        config.http.timeouts.header_s,
        config.http.write_timeout_s,
    ) == (
        DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        DEFAULT_HEADER_TIMEOUT_S,
        DEFAULT_WRITE_TIMEOUT_S,
    )


def test_variables_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_MAX_INFLIGHT_REQUESTS", "64")
    monkeypatch.setenv("DYN_MAX_WAITING_REQUESTS", "0")
    monkeypatch.setenv("DYN_HTTP_KEEP_ALIVE_TIMEOUT", "5")
    monkeypatch.setenv("DYN_HTTP_HEADER_TIMEOUT", "2.5")
    monkeypatch.setenv("DYN_HTTP_WRITE_TIMEOUT", "0")
    config = config_from_args(build_parser().parse_args([]))
    assert (config.http.admission.max_inflight, config.http.admission.max_waiting) == (64, 0)
    assert (config.http.timeouts.keep_alive_s, config.http.timeouts.header_s) == (5.0, 2.5)
    assert config.http.write_timeout_s == 0.0
    flags = "--max-inflight-requests 8 --header-timeout 1 --write-timeout 3".split()
    config = config_from_args(build_parser().parse_args(flags))
    assert (config.http.admission.max_inflight, config.http.timeouts.header_s) == (8, 1.0)
    assert config.http.write_timeout_s == 3.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-inflight-requests", "0"],
        ["--max-waiting-requests", "-1"],
        ["--keep-alive-timeout", "0"],
        ["--header-timeout", "0"],
        ["--write-timeout", "-1"],
        ["--header-timeout", "soon"],
    ],
)
def test_values_that_would_disable_a_bound_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
