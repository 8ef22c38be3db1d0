"""Start real `python -m dynamo.vllm` / `python -m dynamo.frontend` processes for e2e tests.

Each process logs to a file under the test session's temp dir; on a start failure the tail
of that log is put into the assertion message so a broken engine is diagnosable from CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ENGINE_START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


class ManagedProcess:
    """A child process with a log file; `stop()` sends SIGTERM, then SIGKILL."""

    def __init__(
        self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env or engine_env(),
            start_new_session=True,
        )

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 40.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class WorkerProcess(ManagedProcess):
    """`python -m dynamo.vllm` with a system port, ready when `/health` answers 200."""

    def __init__(
        self,
        name: str,
        model: Path,
        nats_url: str,
        log_dir: Path,
        *,
        extra: list[str] | None = None,
        namespace: str = "e2e",
        component: str = "backend",
        max_model_len: int = 2048,
    ) -> None:
        self.system_port = free_port()
        argv = [
            sys.executable,
            "-m",
            "dynamo.vllm",
            "--model",
            str(model),
            "--namespace",
            namespace,
            "--component",
            component,
            "--nats-server",
            nats_url,
            "--system-port",
            str(self.system_port),
            "--enforce-eager",
            "--block-size",
            "32",
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            "16",
            "--seed",
            "0",
            *(extra or []),
        ]
        super().__init__(name, argv, log_dir)
        self.namespace = namespace
        self.component = component

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}/metrics"

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                status, _ = http_get(f"http://127.0.0.1:{self.system_port}/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.name} not healthy after {timeout}s:\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        """Sum of all samples of one Prometheus series (any labels)."""
        _, text = http_get(self.metrics_url)
        total, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        if not seen:
            raise KeyError(f"{name} not in {self.metrics_url}")
        return total


class FrontendProcess(ManagedProcess):
    """`python -m dynamo.frontend`, ready when `/v1/models` lists `model`."""

    def __init__(
        self,
        name: str,
        nats_url: str,
        log_dir: Path,
        *,
        namespace: str = "e2e",
        extra: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        argv = [
            sys.executable,
            "-m",
            "dynamo.frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.port),
            "--namespace",
            namespace,
            "--nats-server",
            nats_url,
            *(extra or []),
        ]
        super().__init__(name, argv, log_dir)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for_model(self, model: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                status, body = http_get(f"{self.base_url}/v1/models", timeout=2)
                if status == 200 and any(m["id"] == model for m in json.loads(body)["data"]):
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(
            f"{self.name}: model {model} not listed after {timeout}s:\n{self.log_tail()}"
        )
