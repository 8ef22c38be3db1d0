"""The dashboard's frontend and mocker metrics are what a running frontend and mocker
export: `python -m dynamo.frontend --router-mode kv` and `python -m dynamo.mocker` with
speculation and a system port, over a real nats-server, after one chat request (some
series appear only once a request was served). A name in deploy/grafana/dashboards/
dynamo.json that neither exports fails here; the vLLM worker's names are checked in
tests/e2e/test_worker_speculative.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.runtime.ports import free_port
from dynamo.testing.dashboard import FRONTEND, MOCKER, exported_names, names_from
from dynamo.testing.http import http_get, http_post_json
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, stop_all, wait_healthy

MODEL = "dash-mock"


@pytest.fixture(scope="module")
def stack(
    nats_url: str, embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FrontendProcess, str]]:
    """A frontend and a two-worker mocker in a namespace of their own; yields the frontend
    and the mocker's `/metrics` URL."""
    logs = tmp_path_factory.mktemp("dashboard-logs")
    namespace = "dash" + uuid.uuid4().hex[:8]
    port = free_port()
    mocker = ManagedProcess(
        "mocker",
        mocker_argv(
            embedded_model, nats_url, namespace,
            "--num-workers", "2",
            "--num-speculative-tokens", "2",
            "--speed-up", "50",
            "--system-port", str(port),
            served_model_name=MODEL,
        ),
        logs,
    )  # fmt: skip
    frontend = FrontendProcess(
        "frontend", nats_url, logs, namespace=namespace, extra=["--router-mode", "kv"]
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [mocker], timeout=60)
        frontend.wait_for_model(MODEL)
        status, body = http_post_json(
            f"{frontend.base_url}/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "What is the capital of Japan?"}],
                "max_tokens": 8,
            },
        )
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 8
        yield frontend, f"http://127.0.0.1:{port}/metrics"
    finally:
        stop_all([frontend, mocker])


def test_the_frontend_exports_every_frontend_metric_of_the_dashboard(
    stack: tuple[FrontendProcess, str],
) -> None:
    frontend, _ = stack
    status, text = http_get(f"{frontend.base_url}/metrics")
    assert status == 200
    wanted = names_from(FRONTEND)
    assert "dynamo_frontend_router_decisions_total" in wanted
    assert sorted(wanted - exported_names(text)) == []
    # The request above went through the KV router: a decision with an overlap estimate.
    assert 'dynamo_frontend_router_decisions_total{component="backend"' in text
    assert "dynamo_frontend_router_overlap_blocks_total{" in text


def test_the_mocker_exports_every_mocker_metric_of_the_dashboard(
    stack: tuple[FrontendProcess, str],
) -> None:
    _, metrics_url = stack
    status, text = http_get(metrics_url)
    assert status == 200
    wanted = names_from(MOCKER)
    assert wanted
    assert sorted(wanted - exported_names(text)) == []
