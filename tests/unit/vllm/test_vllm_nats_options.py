"""The vLLM worker's NATS authentication and TLS flags: they are worker flags (never engine
keys), they reach `VllmWorkerConfig.nats_options`, contradictions are ConfigErrors (exit
2), and neither the start-up lines nor the `--dry-run` YAML show a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.runtime.nats_options import NatsConnectOptions
from dynamo.vllm.config.args import (
    ConfigError,
    build_parser,
    parse_worker_args,
)
from dynamo.vllm.config.report import resolved_config_lines, resolved_config_yaml
from dynamo.vllm.main import main

SECRET = "hunter2-Secret"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NATS_SERVER", "NATS_USER", "NATS_PASSWORD", "NATS_TOKEN", "DYN_SYSTEM_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_flags_and_variables_reach_the_config(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_PASSWORD", SECRET)
    cfg = parse_worker_args(["--model", str(tiny_model), "--dry-run", "--nats-user", "alice"])
    assert cfg.nats_options == NatsConnectOptions(user="alice", password=SECRET)
    assert "nats_user" not in cfg.sources  # a worker flag, not an engine key


def test_contradictions_are_config_errors(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="different authentication methods"):
        parse_worker_args(
            ["--model", str(tiny_model), "--dry-run", "--nats-token", "t", "--nats-user", "u"]
        )
    assert main(["--model", str(tiny_model), "--dry-run", "--nats-tls-cert", "/nope"]) == 2


def test_dry_run_and_start_up_lines_show_no_secret(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_SERVER", f"nats://alice:{SECRET}@nats.example:4222")
    cfg = parse_worker_args(["--model", str(tiny_model), "--dry-run"])
    assert cfg.nats_server.endswith("@nats.example:4222")  # still used as given
    text = resolved_config_yaml(cfg) + "\n".join(resolved_config_lines(cfg))
    assert SECRET not in text
    assert "nats://alice:***@nats.example:4222" in text


def test_help_lists_the_flags_in_the_worker_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_TOKEN", SECRET)
    text = build_parser().format_help()
    assert "--nats-token" in text and "--nats-tls-ca" in text and SECRET not in text
