"""`--max-inflight-requests` (`dynamo.llm.worker.inflight`, shared by the vLLM worker and
the mocker) and the mocker's `--max-logprobs`. (The vLLM worker's flag:
tests/unit/vllm/test_vllm_max_inflight.py.)

Claims: the bound defaults to 4 x the engine's `max_num_seqs`, 0 turns it off, a value is
taken as is; `$DYN_MAX_INFLIGHT_REQUESTS` is the flag's default and a bad value is refused
naming the variable; the mocker's flags reach its worker settings and engine config.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.llm.worker.inflight import (
    ENV_MAX_INFLIGHT_REQUESTS,
    inflight_bound,
    max_inflight_or_env,
)
from dynamo.mocker.args import parse_args
from dynamo.mocker.model_info import ModelInfo
from dynamo.runtime.cli import ConfigError


@pytest.mark.parametrize(
    ("configured", "max_num_seqs", "bound"),
    [(None, 256, 1024), (None, 16, 64), (0, 256, None), (5, 256, 5)],
)
def test_the_bound_follows_the_engine_unless_given(
    configured: int | None, max_num_seqs: int, bound: int | None
) -> None:
    assert inflight_bound(configured, max_num_seqs) == bound


def test_the_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_MAX_INFLIGHT_REQUESTS, raising=False)
    assert max_inflight_or_env(None) is None
    monkeypatch.setenv(ENV_MAX_INFLIGHT_REQUESTS, "7")
    assert max_inflight_or_env(None) == 7
    assert max_inflight_or_env(3) == 3  # the flag wins


@pytest.mark.parametrize("value", ["-1", "lots", "1.5"])
def test_a_bad_variable_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_MAX_INFLIGHT_REQUESTS, value)
    with pytest.raises(ConfigError, match=ENV_MAX_INFLIGHT_REQUESTS):
        max_inflight_or_env(None)


def test_the_mocker_flags_reach_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_MAX_INFLIGHT_REQUESTS, raising=False)
    assert parse_args([]).worker.max_inflight_requests is None
    args = parse_args(["--max-inflight-requests", "12", "--max-logprobs", "3"])
    assert args.worker.max_inflight_requests == 12
    model = ModelInfo(Path("."), 500, (2,), frozenset({0, 1, 2}), 8192)
    assert args.engine.engine_config(model).max_logprobs == 3
    assert parse_args([]).engine.engine_config(model).max_logprobs == 20  # vLLM's default
    with pytest.raises(SystemExit):
        parse_args(["--max-inflight-requests", "-1"])
    monkeypatch.setenv(ENV_MAX_INFLIGHT_REQUESTS, "9")
    assert parse_args([]).worker.max_inflight_requests == 9
