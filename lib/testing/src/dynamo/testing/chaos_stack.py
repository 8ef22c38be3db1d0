"""The processes of a chaos soak: a three-node NATS cluster, a frontend of two HTTP worker
processes in kv mode, two mocker workers and, unless `SoakConfig.vllm` is off, a vLLM
worker, each worker under the launch scripts' supervisor.

Separate from the faults and the traffic because it is what both act on: `SoakStack`
starts and stops the processes and answers what they are doing now (whole or not, the
instances listed, the routers' bookings, the frontend's memory); `process_alive` tells a
running process from a zombie, for the stack and for the faults that kill its processes.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import psutil

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.nats_server import NatsCluster
from dynamo.testing.chaos_records import SoakConfig
from dynamo.testing.command_lines import cpu_engine_flags, worker_argv
from dynamo.testing.http import http_get, kv_router_views, listed_instances
from dynamo.testing.processes import FrontendProcess, ManagedProcess, stop_all
from dynamo.testing.waiting import wait_until

MOCK_MODEL = "mock-chaos"
TOOLS_TEMPLATE = Path(__file__).parents[5] / "examples" / "chat_templates" / "smollm2_tools.jinja"
"""The launch scripts' template for the embedded model: tool calls work out of the box."""


def _supervised(argv: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "dynamo.runtime.supervise",
        "--backoff-initial", "0.5", "--backoff-max", "2", "--", *argv,
    ]  # fmt: skip


class SoakStack:
    """The processes of the soak; `close()` stops them all."""

    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.namespace = "chaos" + uuid.uuid4().hex[:8]
        self.cluster = NatsCluster(3, store_root=config.log_dir / "nats").start()
        self.workers: list[ManagedProcess] = []
        self.frontend: FrontendProcess | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg, url = self.config, self.cluster.url
        for i in range(2):
            argv = [
                sys.executable, "-m", "dynamo.mocker",
                "--model", str(cfg.model_dir), "--served-model-name", MOCK_MODEL,
                "--namespace", self.namespace, "--component", "mocker",
                "--nats-server", url, "--nats-replicas", "3", "--decode-ms-per-step", "40",
                "--decode-ms-per-token", "0", "--prefill-ms-per-token", "0",
            ]  # fmt: skip
            self.workers.append(ManagedProcess(f"mocker-{i}", _supervised(argv), cfg.log_dir))
        if cfg.vllm:
            argv = worker_argv(
                cfg.model_dir, url, self.namespace, cpu_engine_flags(), "--nats-replicas", "3",
            )  # fmt: skip
            self.workers.append(ManagedProcess("vllm", _supervised(argv), cfg.log_dir))
        self.frontend = FrontendProcess(
            "frontend", url, cfg.log_dir, namespace=self.namespace,
            extra=[
                "--http-workers", "2", "--router-mode", "kv", "--nats-replicas", "3",
                "--chat-template", str(TOOLS_TEMPLATE), "--tool-call-parser", "hermes",
            ],
        )  # fmt: skip
        self.wait_whole(timeout=300)

    @property
    def base_url(self) -> str:
        assert self.frontend is not None
        return self.frontend.base_url

    def expected_instances(self) -> dict[str, int]:
        return {MOCK_MODEL: 2, **({DEFAULT_MODEL: 1} if self.config.vllm else {})}

    def is_whole(self) -> bool:
        """Every node, worker and frontend child is up: both children listen, and every
        worker is routable."""
        if not all(node.running for node in self.cluster.nodes):
            return False
        children = self.frontend_children()
        if len(children) != 2 or not all(_listens(child) for child in children):
            return False
        return all(
            len(ids) >= count
            for ids, count in zip(
                self.instances().values(), self.expected_instances().values(), strict=True
            )
        )

    def instances(self) -> dict[str, set[int]]:
        """The instances the frontend lists, per model of `expected_instances`."""
        _, body = http_get(f"{self.base_url}/health", timeout=2)
        health = json.loads(body)
        return {model: set(listed_instances(health, model)) for model in self.expected_instances()}

    def wait_whole(self, timeout: float) -> None:
        wait_until(
            self.is_whole,
            timeout=timeout,
            interval=0.5,
            what="the stack to be whole (nodes, frontend children, worker instances)",
            retry_on=(OSError, ValueError, KeyError, psutil.Error),
        )

    def frontend_children(self) -> list[psutil.Process]:
        """The frontend's HTTP worker processes that run (a killed one stays listed as a
        zombie until the supervisor reaps it)."""
        assert self.frontend is not None
        return [
            child for child in psutil.Process(self.frontend.pid).children() if process_alive(child)
        ]

    def frontend_rss_mib(self) -> float:
        assert self.frontend is not None
        parent = psutil.Process(self.frontend.pid)
        total = 0
        for proc in [parent, *parent.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:  # a child that just died
                pass
        return total / 2**20

    def bookings(self) -> dict[str, int]:
        """Requests the KV routers still count as in flight, per model (all children)."""
        paths = {MOCK_MODEL: f"{self.namespace}/mocker/generate"}
        if self.config.vllm:
            paths[DEFAULT_MODEL] = f"{self.namespace}/backend/generate"
        return {
            model: sum(
                sum(w["active_requests"] for w in view["workers"].values())
                for view in kv_router_views(self.base_url, model, path)
            )
            for model, path in paths.items()
        }

    def close(self) -> None:
        procs: list[ManagedProcess] = [*([self.frontend] if self.frontend else []), *self.workers]
        stop_all(procs)
        self.cluster.close()


def process_alive(proc: psutil.Process) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listens(proc: psutil.Process) -> bool:
    """Whether `proc` has a listening TCP socket (a frontend child that started serving)."""
    try:
        return any(c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp"))
    except psutil.Error:
        return False
