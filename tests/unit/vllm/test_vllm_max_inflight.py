"""`python -m dynamo.vllm --max-inflight-requests`: the flag and its variable reach the
worker's configuration (the bound itself: tests/unit/mocker/test_worker_inflight_bound.py,
tests/integration/frontend/test_worker_refusals.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.llm.worker.inflight import ENV_MAX_INFLIGHT_REQUESTS
from dynamo.vllm.config.args import ConfigError, parse_worker_args


def test_the_flag_and_its_variable_reach_the_config(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_MAX_INFLIGHT_REQUESTS, raising=False)
    base = ["--model", str(tiny_model), "--dry-run"]
    assert parse_worker_args(base).max_inflight_requests is None  # 4 x max_num_seqs
    assert parse_worker_args([*base, "--max-inflight-requests", "0"]).max_inflight_requests == 0
    monkeypatch.setenv(ENV_MAX_INFLIGHT_REQUESTS, "64")
    assert parse_worker_args(base).max_inflight_requests == 64
    assert parse_worker_args([*base, "--max-inflight-requests", "8"]).max_inflight_requests == 8
    monkeypatch.setenv(ENV_MAX_INFLIGHT_REQUESTS, "many")
    with pytest.raises(ConfigError, match=ENV_MAX_INFLIGHT_REQUESTS):
        parse_worker_args(base)
