"""Real `dynamo.vllm` workers, frontends and other servers as child processes.

The end-to-end tests and the serving benchmarks start the same programs and need the same
care around them:

* `ManagedProcess`: a child in its own process group (vLLM's engine core and its helpers
  join it), its output in `<log_dir>/<name>.log`; `stop()` asks it to exit (SIGTERM), kills
  the whole group when it does not within the timeout, and always kills what is left of
  the group, so no engine process outlives a test run or a benchmark;
* `WorkerProcess`, `FrontendProcess` and `VllmServerProcess` put a command line of
  `dynamo.testing.command_lines` together with a free port; `stop_all` and `running` stop
  several processes;
* readiness: `wait_while_alive` polls a condition while failing fast, with the log tail,
  when a process it depends on has died; `wait_healthy`, `wait_serving`,
  `wait_for_instances` and `FrontendProcess.wait_kv_router_workers` are the usual
  conditions;
* `child_env`: the environment every child gets (small KV cache, no hub access).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

from dynamo.runtime.ports import free_port
from dynamo.testing.command_lines import (
    cpu_engine_flags,
    frontend_argv,
    vllm_server_argv,
    worker_argv,
)
from dynamo.testing.http import (
    http_get,
    kv_router_view,
    listed_instances,
    metric_total,
    metric_values,
)
from dynamo.testing.waiting import wait_until

ENGINE_START_TIMEOUT_S = 240.0
"""How long a vLLM engine may take to start on a small, busy CPU machine."""

NOT_READY_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, KeyError)
"""What a readiness check may raise while a server is still starting: connection refused,
a body that is not (yet) the expected JSON, a key not there yet."""

PROBE_TIMEOUT_S = 3.0
"""Timeout of one readiness request."""


class ProcessExited(RuntimeError):
    """A process that should be running has exited; the message has its log tail."""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child, plus `extra`: a small CPU KV cache and
    quiet tokenizers unless set, and never any hub access (every model is local)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.update(extra or {})
    return env


def spare_core_env() -> dict[str, str]:
    """The environment that binds a CPU engine's compute threads to this machine's last
    core. vLLM's automatic binding puts every engine's threads on the first core and
    keeps the last for its server processes, so an engine that must compute beside
    another (a differential test's anchor) goes to the last one; nothing on a 1-core
    machine."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[-1])} if len(cpus) > 1 else {}


def start_launch_script(
    script: Path, env: Mapping[str, str], log_path: Path, *, new_session: bool = False
) -> subprocess.Popen[bytes]:
    """`bash script` (one of `launch/`) with `env` over the test environment, its output in
    `log_path`. `NATS_*` variables are dropped: the script starts a server of its own.
    `new_session`: its own process group, for a test that must find every descendant."""
    environment = {k: v for k, v in child_env(env).items() if not k.startswith("NATS_")}
    with log_path.open("wb") as out:
        return subprocess.Popen(
            ["bash", str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=new_session,
        )


# --------------------------------------------------------------------------- processes


class ManagedProcess:
    """A child process in its own process group, logging to `<log_dir>/<name>.log`.

    `env` is added to `child_env()`. `stop()` is SIGTERM to the process (a worker then
    drains and shuts its engine down), SIGKILL to the group after `timeout`; `kill()` is
    SIGKILL to the group at once.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # closed in stop() / kill()
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(env),
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        """The last `lines` lines of the log ('' when it cannot be read)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise `ProcessExited` with the log tail when the process has exited."""
        if not self.alive():
            raise ProcessExited(
                f"{self.name} exited with {self.popen.returncode} "
                f"(log: {self.log_path}):\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM, SIGKILL to the group after `timeout` seconds; idempotent. Returns the
        exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        # Engine children can outlive a parent that exited on its own.
        _signal_group(self.popen.pid, signal.SIGKILL)
        self._log.close()
        return self.popen.returncode

    def terminate(self) -> None:
        """SIGTERM without waiting (see `stop_all`)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole group (an abrupt death, as in a crash); idempotent."""
        _signal_group(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        self._log.close()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


@contextmanager
def running(procs: list[ManagedProcess]) -> Iterator[list[ManagedProcess]]:
    """Stop every process in `procs` on exit, the last started first (frontends before
    workers, so workers drain). Append to the list inside the block."""
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def stop_all(processes: Iterable[ManagedProcess]) -> None:
    """Stop several processes side by side: SIGTERM to each first (a worker drains and
    stops its engine in seconds), then wait for each as `stop` does."""
    procs = list(processes)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop()


class VllmServerProcess(ManagedProcess):
    """vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on a free
    port, serving `model` as `served`: the anchor a differential test compares with."""

    def __init__(
        self,
        name: str,
        model: str | Path,
        served: str,
        log_dir: Path,
        *,
        engine_flags: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.served = served
        flags = cpu_engine_flags() if engine_flags is None else engine_flags
        argv = vllm_server_argv(model, served, self.port, flags)
        super().__init__(name, argv, log_dir, env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> float:
        """Seconds until it serves its model (see `wait_serving`)."""
        return wait_serving(self.base_url, self.served, [self], timeout=timeout)


class WorkerProcess(ManagedProcess):
    """`python -m dynamo.vllm` with a system server on a free port (`/health`,
    `/metrics`); ready when `/health` answers 200. `engine_flags` defaults to
    `cpu_engine_flags()`; `component` None leaves the worker's own default."""

    def __init__(
        self,
        name: str,
        model: str | Path,
        nats_url: str,
        log_dir: Path,
        *,
        namespace: str,
        component: str | None = None,
        engine_flags: Sequence[str] | None = None,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.namespace = namespace
        self.component = component
        self.system_port = free_port()
        flags = cpu_engine_flags() if engine_flags is None else engine_flags
        own = ["--system-port", str(self.system_port)]
        if component is not None:
            own += ["--component", component]
        argv = worker_argv(model, nats_url, namespace, flags, *own, *extra)
        super().__init__(name, argv, log_dir, env, cwd)

    @property
    def system_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}"

    @property
    def health_url(self) -> str:
        return f"{self.system_url}/health"

    @property
    def metrics_url(self) -> str:
        return f"{self.system_url}/metrics"

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> float:
        """Seconds until `/health` answers 200 (the engine is loaded and registered)."""
        return wait_healthy(self.health_url, [self], timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of series `name` on the worker's `/metrics` whose labels
        include `labels`; `KeyError` when the worker exports no such sample."""
        _, text = http_get(self.metrics_url)
        values = metric_values(text, name, labels)
        if not values:
            raise KeyError(f"{name}{labels or ''} not in {self.metrics_url}")
        return sum(values)


def serving_pids(frontend_pid: int) -> list[int]:
    """The processes of the frontend `frontend_pid` that serve HTTP and hold NATS
    connections: the frontend itself, or, when it runs with `--http-workers N`
    (`$DYN_HTTP_WORKERS`), its N children."""
    children = psutil.Process(frontend_pid).children()
    return [child.pid for child in children] or [frontend_pid]


class FrontendProcess(ManagedProcess):
    """`python -m dynamo.frontend` on 127.0.0.1 and a free port."""

    def __init__(
        self,
        name: str,
        nats_url: str,
        log_dir: Path,
        *,
        namespace: str,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.port = free_port()
        argv = frontend_argv(self.port, nats_url, namespace, *extra)
        super().__init__(name, argv, log_dir, env, cwd)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serving_pids(self) -> list[int]:
        """The processes that serve HTTP and hold NATS connections: the frontend itself,
        or, when it runs with `--http-workers N` (`$DYN_HTTP_WORKERS`), its N children."""
        return serving_pids(self.pid)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of series `name` on the frontend's `/metrics` whose labels
        include `labels` (0 when there are none: a counter not incremented yet)."""
        return metric_total(f"{self.base_url}/metrics", name, labels)

    def wait_for_model(self, model: str, timeout: float = 60.0) -> float:
        """Seconds until the frontend serves `model` (see `wait_serving`)."""
        return wait_serving(self.base_url, model, [self], timeout=timeout, interval=0.3)

    def wait_kv_router_workers(
        self, model: str, endpoint_path: str, count: int, timeout: float = 30.0
    ) -> float:
        """Seconds until the frontend's KV router for `model` on `endpoint_path` counts
        `count` live workers: only then does it route by every worker's cache."""

        def enough() -> bool:
            view = kv_router_view(self.base_url, model, endpoint_path)
            return len(view["feed"]["live_workers"]) == count

        what = f"the kv router of {model} on {endpoint_path} to see {count} workers"
        return wait_while_alive(enough, [self], timeout=timeout, interval=0.25, what=what)


# --------------------------------------------------------------------------- readiness


def wait_while_alive(
    predicate: Callable[[], object],
    procs: Sequence[ManagedProcess],
    *,
    timeout: float,
    what: str,
    interval: float = 0.5,
    retry_on: tuple[type[Exception], ...] = NOT_READY_ERRORS,
) -> float:
    """`wait_until(predicate)` that fails fast, with `ProcessExited` and its log tail, when
    one of `procs` exits first; on timeout the `WaitTimeout` carries every process's log
    tail. Exceptions in `retry_on` (default: `NOT_READY_ERRORS`) count as "not yet"."""

    def alive_and_holds() -> object:
        for proc in procs:
            proc.check_alive()
        return predicate()

    def described() -> str:
        tails = (f"--- {p.name} ({p.log_path})\n{p.log_tail(15)}" for p in procs)
        return "\n".join([what, *tails])

    return wait_until(
        alive_and_holds, timeout=timeout, what=described, interval=interval, retry_on=retry_on
    )


def wait_healthy(
    url: str, procs: Sequence[ManagedProcess], *, timeout: float, interval: float = 0.5
) -> float:
    """Seconds until GET `url` answers 200."""

    def healthy() -> bool:
        status, _ = http_get(url, timeout=PROBE_TIMEOUT_S)
        return status == 200

    return wait_while_alive(healthy, procs, timeout=timeout, interval=interval, what=f"{url} 200")


def wait_serving(
    base_url: str,
    model: str,
    procs: Sequence[ManagedProcess],
    *,
    timeout: float,
    interval: float = 0.5,
) -> float:
    """Seconds until an OpenAI server at `base_url` (the frontend, or vLLM's own) answers
    `/health` with 200 and lists `model` in `/v1/models`."""

    def serving() -> bool:
        health, _ = http_get(f"{base_url}/health", timeout=PROBE_TIMEOUT_S)
        status, body = http_get(f"{base_url}/v1/models", timeout=PROBE_TIMEOUT_S)
        listed = any(m.get("id") == model for m in json.loads(body).get("data", []))
        return health == 200 and status == 200 and listed

    what = f"{base_url} to serve {model}"
    return wait_while_alive(serving, procs, timeout=timeout, interval=interval, what=what)


def wait_for_instances(
    base_url: str,
    model: str,
    count: int,
    procs: Sequence[ManagedProcess],
    *,
    timeout: float,
    interval: float = 0.5,
) -> float:
    """Seconds until the frontend at `base_url` lists `count` instances serving `model` in
    its `/health`."""

    def enough() -> bool:
        _, body = http_get(f"{base_url}/health", timeout=PROBE_TIMEOUT_S)
        return len(listed_instances(json.loads(body), model)) >= count

    what = f"{count} instances of {model} at {base_url}"
    return wait_while_alive(enough, procs, timeout=timeout, interval=interval, what=what)
