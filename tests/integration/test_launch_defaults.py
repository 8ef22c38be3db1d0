"""What the `launch/` scripts serve by default, through a real script run.

Claims: the stack a launch script starts for the embedded model serves a first request
with `tools` (the frontend gets the repository's tools-capable chat template and the
`hermes` tool parser; the model's own template has no tools section, and the request used
to be a 400 telling the user to pass `--chat-template`); `FRONTEND_ARGS=""` keeps the
model's own template, and then the same request is that clear 400; a worker that dies
(SIGKILL, as when its engine dies) is started again by its supervisor and serves again,
where the script used to stop everything.

`launch/mocker.sh` stands in for the vLLM scripts (they share `launch/common.sh`, where
the frontend's flags are chosen): simulated workers, so no engine starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from dynamo.runtime.ports import free_port
from dynamo.testing.http import http_get, http_post_json
from dynamo.testing.processes import start_launch_script, wait_serving
from dynamo.testing.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "launch-defaults"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class Launched:
    base: str  # the frontend's URL
    script: psutil.Process


def launched(tmp_path: Path, embedded_model: Path, extra_env: dict[str, str]) -> Iterator[Launched]:
    """`launch/mocker.sh` running with `extra_env`."""
    http_port = free_port()
    env = {
        "HTTP_PORT": str(http_port),
        "MODEL": str(embedded_model),
        "SERVED_MODEL_NAME": MODEL,
        "NUM_WORKERS": "1",
        "ROUTER_MODE": "round-robin",
        "LOG_DIR": str(tmp_path),
        "PYTHON": sys.executable,
        "MOCKER_ARGS": "--speed-up 50",
        **extra_env,
    }
    script = start_launch_script(ROOT / "launch" / "mocker.sh", env, tmp_path / "script.log")
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_serving(base, MODEL, [], timeout=90)
        yield Launched(base, psutil.Process(script.pid))
    finally:
        script.terminate()  # the script's trap stops what it started
        try:
            script.wait(40)
        except subprocess.TimeoutExpired:
            script.kill()
            script.wait(5)


def tools_request(base: str) -> tuple[int, dict]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "max_tokens": 8,
    }
    status, text = http_post_json(f"{base}/v1/chat/completions", body)
    return status, json.loads(text)


@pytest.fixture
def default_stack(tmp_path: Path, embedded_model: Path) -> Iterator[Launched]:
    yield from launched(tmp_path, embedded_model, {})


@pytest.fixture
def own_template_stack(tmp_path: Path, embedded_model: Path) -> Iterator[Launched]:
    yield from launched(tmp_path, embedded_model, {"FRONTEND_ARGS": ""})


def test_the_default_stack_serves_a_first_tools_request(default_stack: Launched) -> None:
    status, body = tools_request(default_stack.base)
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_frontend_args_empty_keeps_the_models_template_and_its_clear_400(
    own_template_stack: Launched,
) -> None:
    status, body = tools_request(own_template_stack.base)
    assert status == 400, body
    assert body["error"]["param"] == "tools" and "--chat-template" in body["error"]["message"]


def instance_ids(base: str) -> set[str]:
    status, body = http_get(f"{base}/health")
    if status != 200:
        return set()
    models = json.loads(body)["models"]
    return {str(i) for m in models.values() for i in m["instances"]}


def test_a_worker_that_dies_is_started_again(default_stack: Launched, tmp_path: Path) -> None:
    base = default_stack.base
    wait_until(lambda: len(instance_ids(base)) == 1, timeout=60, what="one instance")
    first = instance_ids(base)
    (mocker,) = [
        p
        for p in default_stack.script.children(recursive=True)
        if "dynamo.mocker" in " ".join(p.cmdline())
        and "dynamo.runtime" not in " ".join(p.cmdline())  # not its wrappers
    ]
    os.kill(mocker.pid, signal.SIGKILL)  # what a dead engine's worker amounts to
    wait_until(
        lambda: bool(instance_ids(base) - first),
        timeout=90,
        what="the restarted worker to register a new instance",
    )
    status, body = tools_request(base)
    assert status == 200, body
    log = (tmp_path / "mocker.log").read_text(errors="replace")
    assert "restarting in" in log and "restart 1" in log, log[-2000:]
