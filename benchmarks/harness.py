"""Shared machinery of the serving benchmarks (overhead, kv routing, disaggregation).

Processes, command lines, readiness waits and HTTP probes are shared with the end-to-end
tests and live in `dynamo.testing` (`processes`, `waiting`, `http`). What is here is what
only the benchmarks need, in small pieces:

* stacks: `nats_server`, `dynamo_stack`, `vllm_direct_stack` and `launch_stack` (a launch
  script as a user runs it) start what a benchmark measures (as
  `dynamo.testing.processes.ManagedProcess`es, each in its own process group with a log
  file) and always tear it down;
* vLLM's serving benchmark: `run_bench_serve` runs `vllm bench serve` in a subprocess and
  reads its result JSON into a `RunResult`;
* CPU accounting: `Stack.cpu_seconds` sums user + system CPU of every process of a stack;
* a run: `serving_parser` (the common options), `guarded` (failures, a server that
  died or never became ready among them, become exit codes; SIGTERM cleans up like
  Ctrl-C), `measure_in_turn` (setups one after the other, never at the same time, in one
  log directory);
* reporting: `percentile`, `format_table`, `save_report`.

The scripts import it as `harness` (they run as `python benchmarks/<name>.py`, which puts
this directory first on `sys.path`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import aiohttp
import psutil

from dynamo.llm.models import DEFAULT_MODEL, resolve_model
from dynamo.nats_server import NatsServer
from dynamo.runtime.ports import free_port
from dynamo.testing.command_lines import (
    cpu_engine_flags,
    vllm_bench_serve_argv,
    vllm_server_argv,
    worker_argv,
)
from dynamo.testing.processes import (
    FrontendProcess,
    ManagedProcess,
    ProcessExited,
    child_env,
    running,
    wait_serving,
)
from dynamo.testing.sse import sse_data
from dynamo.testing.waiting import WaitTimeout

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"

T = TypeVar("T")

# Engine flags of the benchmarks that compare two setups of the same engine (overhead,
# disaggregation): small and CPU-friendly, as everywhere in this repository.
CPU_ENGINE_FLAGS = cpu_engine_flags()


class BenchError(RuntimeError):
    """A benchmark run failed; the message says where to look."""


# What ends a benchmark with exit status 2 and a message: its own errors, a process of a
# stack that died, a server that was not ready in time.
FAILURES = (BenchError, ProcessExited, WaitTimeout)


# --------------------------------------------------------------------------- command line


def add_serving_args(parser: argparse.ArgumentParser, results_file: str) -> None:
    """The options every vLLM-serving benchmark has: --quick, --model, --start-timeout,
    --json (default `benchmarks/results/<results_file>`), --keep-logs."""
    parser.add_argument("--quick", action="store_true", help="few prompts: a smoke run")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="embedded model name or a local model directory"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds a server may take to start"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"write the numbers here (default: benchmarks/results/{results_file}; "
        "quick runs write only when given)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the log directory")


def serving_parser(doc: str | None, results_file: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's parser: described by the first paragraph of `doc` (its module
    docstring), with `add_serving_args`; `kwargs` go to `argparse.ArgumentParser`."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], **kwargs)
    add_serving_args(parser, results_file)
    return parser


def add_order_arg(parser: argparse.ArgumentParser, setups: Sequence[str]) -> None:
    """`--<last setup>-first`: measure `setups` in the reverse order, to check that the order
    does not matter; `in_order` reads it back."""
    parser.add_argument(
        f"--{setups[-1]}-first",
        dest="reverse_order",
        action="store_true",
        help=f"measure {setups[-1]} before {setups[0]} (to check that the order does not matter)",
    )


def in_order(args: argparse.Namespace, setups: Sequence[T]) -> list[T]:
    """`setups` in the order to measure them (see `add_order_arg`)."""
    return list(reversed(setups) if args.reverse_order else setups)


def results_path(args: argparse.Namespace, results_file: str) -> Path | None:
    """Where to write the JSON: `--json`, else the default for full runs, else nowhere."""
    if args.json is not None:
        return Path(args.json)
    return None if args.quick else RESULTS_DIR / results_file


def guarded(body: Callable[[], int]) -> int:
    """Run a benchmark's body with SIGTERM unwinding like Ctrl-C; `FAILURES` become exit
    status 2 with their message, Ctrl-C 130."""
    exit_on_sigterm()
    try:
        return body()
    except FAILURES as exc:
        print(f"\nERROR: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------- environment


def resolve_model_arg(model: str) -> tuple[Path, str]:
    """`(model directory, served name)` for an embedded model name or a local directory."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve(), path.name
    return Path(resolve_model(model)), model


def levels_arg(text: str, known: Collection[int]) -> list[int]:
    """A `--concurrency` value: comma-separated levels, each one of `known`, sorted."""
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    unknown = [c for c in levels if c not in known]
    if not levels or unknown:
        raise argparse.ArgumentTypeError(f"choose among {sorted(known)}, not {unknown or text!r}")
    return levels


def levels_type(known: Collection[int]) -> Callable[[str], list[int]]:
    """The `type=` of a `--concurrency` option whose levels are among `known`
    (`levels_arg`)."""

    def levels(text: str) -> list[int]:
        return levels_arg(text, known)

    return levels


def warn_if_busy(threshold: float = 0.5) -> float:
    """Print a warning when the 1-minute load average says other work is running;
    returns the load average."""
    load = os.getloadavg()[0]
    if load > threshold:
        print(
            f"WARNING: load average {load:.1f} before starting: other work is running, "
            "the numbers will be noisy",
            flush=True,
        )
    return load


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C does, so `finally` blocks stop every child."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def announce(served: str, model_dir: Path, runs: Sequence[Scenario], logs: Path) -> None:
    """Print what is about to be measured, and warn when the machine is busy."""
    first = runs[0]
    print(
        f"model {served} ({model_dir}); {first.input_len} in / {first.output_len} out; "
        + ", ".join(f"{s.name}: {s.num_prompts} prompts" for s in runs)
        + f"; logs in {logs}",
        flush=True,
    )
    warn_if_busy()


class Workload(NamedTuple):
    """What a benchmark serves and sends: the model (directory and served name) and the
    scenarios; in the order the `measure_*` functions of the benchmarks take them."""

    model_dir: Path
    served: str
    runs: list[Scenario]


def workload(args: argparse.Namespace, scenarios: Callable[[bool], list[Scenario]]) -> Workload:
    """The workload of a run: `--model` resolved, `scenarios(--quick)`."""
    model_dir, served = resolve_model_arg(args.model)
    return Workload(model_dir, served, scenarios(args.quick))


def measure_in_turn(
    work: Workload,
    setups: Mapping[str, Callable[[Path], T]],
    *,
    log_prefix: str,
    keep_logs: bool,
) -> dict[str, T]:
    """Measure each setup (label → function of the log directory), one after the other so
    they never compete for cores, in one log directory; returns the results by label."""
    with log_dir(log_prefix, keep=keep_logs) as logs:
        announce(work.served, work.model_dir, work.runs, logs)
        return {label: measure(logs) for label, measure in setups.items()}


@contextmanager
def log_dir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A temporary directory for logs and raw results, removed after a successful run
    unless `keep`; kept (and its path printed) when the run fails."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep:
            shutil.rmtree(path, ignore_errors=True)
        else:
            print(f"logs kept in {path}", file=sys.stderr)


# --------------------------------------------------------------------------- nats-server


@contextmanager
def nats_server(log_dir: Path) -> Iterator[NatsServer]:
    """A private nats-server logging to `<log_dir>/nats.log`, closed on exit."""
    nats = NatsServer(log_file=log_dir / "nats.log").start()
    try:
        yield nats
    finally:
        nats.close()


def nats_server_pid(nats: NatsServer) -> int:
    """The nats-server child of this process that listens on `nats.port`."""
    for child in psutil.Process().children():
        try:
            if child.name() == "nats-server" and str(nats.port) in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise BenchError(f"nats-server on port {nats.port} is not a child of this process")


# --------------------------------------------------------------------------- command lines


# --------------------------------------------------------------------------- streamed requests


@dataclass
class Streamed:
    """One streamed OpenAI response as a benchmark measures it."""

    ttft_s: float  # to the first chunk `first` accepted (the whole latency if none did)
    latency_s: float
    usage: dict[str, Any]  # the usage chunk's (empty without one)
    chunks: list[dict[str, Any]]

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    first: Callable[[dict[str, Any]], bool] = lambda chunk: bool(chunk.get("choices")),
) -> Streamed:
    """POST `body` (a streaming request) to `url` and read its SSE stream to the end;
    `BenchError` on a status other than 200 or an error event in the stream."""
    start = time.perf_counter()
    ttft = None
    chunks: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise BenchError(f"POST {url}: {resp.status} {(await resp.text())[:300]}")
        async for data in sse_data(resp.content):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"{url}: error in the stream: {str(chunk['error'])[:300]}")
            if ttft is None and first(chunk):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
            chunks.append(chunk)
    latency = time.perf_counter() - start
    return Streamed(ttft if ttft is not None else latency, latency, usage, chunks)


# --------------------------------------------------------------------------- stacks

# vLLM's CPU engine binds its OpenMP threads to these cores (default: all of them).
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def split_cores() -> dict[str, dict[str, str]]:
    """Worker env that binds the prefill engine to the first half of this process's cores
    and the decode engine to the second half."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise BenchError("--split-cores needs at least two cores")
    half = len(cores) // 2
    return {
        "prefill": {OMP_BIND: ",".join(map(str, cores[:half]))},
        "decode": {OMP_BIND: ",".join(map(str, cores[half:]))},
    }


@dataclass(frozen=True)
class Stack:
    """A serving stack that is up: its URL, the root process id of each part, and the
    processes this script started for it (to check they are still alive)."""

    base_url: str
    pids: dict[str, int]
    procs: tuple[ManagedProcess, ...] = field(default=(), repr=False)

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    def check_alive(self) -> None:
        """Raise `ProcessExited` with the log tail of a process of the stack that exited."""
        for proc in self.procs:
            proc.check_alive()

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds so far, per part and per process name inside it:
        `worker` is the part's root process, `worker/VLLM::EngineCore` its engine core."""
        seconds: dict[str, float] = {}
        for part, pid in self.pids.items():
            for name, value in tree_cpu_seconds(pid).items():
                key = part if name is None else f"{part}/{name}"
                seconds[key] = seconds.get(key, 0.0) + value
        return seconds


def tree_cpu_seconds(pid: int) -> dict[str | None, float]:
    """CPU seconds of `pid` (key None) and of its descendants, by process name."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    seconds: dict[str | None, float] = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            name = None if proc is root else proc.name()
        except psutil.NoSuchProcess:
            continue
        seconds[name] = seconds.get(name, 0.0) + times.user + times.system
    return seconds


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds spent between two `Stack.cpu_seconds()` readings, per key."""
    return {key: round(value - before.get(key, 0.0), 2) for key, value in after.items()}


@contextmanager
def vllm_direct_stack(
    model_dir: Path, served: str, engine_flags: Sequence[str], log_dir: Path, timeout: float
) -> Iterator[Stack]:
    """vLLM's own API server on a free port, until serving; part `api_server`."""
    port = free_port()
    argv = vllm_server_argv(model_dir, served, port, engine_flags)
    with running([ManagedProcess("vllm-direct", argv, log_dir, cwd=ROOT)]) as procs:
        base_url = f"http://127.0.0.1:{port}"
        took = wait_serving(base_url, served, procs, timeout=timeout)
        print(f"  vLLM api_server ready in {took:.0f}s", flush=True)
        yield Stack(base_url, {"api_server": procs[0].pid}, tuple(procs))


@contextmanager
def dynamo_stack(
    model_dir: Path,
    served: str,
    workers: Mapping[str, Sequence[str]],
    *,
    engine_flags: Sequence[str],
    namespace: str,
    log_dir: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    worker_env: Mapping[str, Mapping[str, str]] | None = None,
    frontend_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """A private nats-server, one `dynamo.vllm` worker per entry of `workers` (part name →
    extra worker flags, started in that order) and a frontend, until the frontend serves
    `served`. `env` is added to every process's environment, `worker_env[part]` to that
    worker's only. Parts of the `Stack`: the worker names, `frontend` and `nats`. Process
    logs are `dynamo-<part>.log`; everything is stopped on exit, the frontend first."""
    with nats_server(log_dir) as nats, running([]) as procs:
        for part, extra in workers.items():
            argv = worker_argv(model_dir, nats.url, namespace, engine_flags, *extra)
            own_env = {**(env or {}), **(worker_env or {}).get(part, {})}
            procs.append(ManagedProcess(f"dynamo-{part}", argv, log_dir, own_env, cwd=ROOT))
        frontend = FrontendProcess(
            "dynamo-frontend",
            nats.url,
            log_dir,
            namespace=namespace,
            extra=frontend_args,
            env=env,
            cwd=ROOT,
        )
        procs.append(frontend)
        took = wait_serving(frontend.base_url, served, procs, timeout=timeout)
        print(f"  dynamo frontend + {' + '.join(workers)} ready in {took:.0f}s", flush=True)
        pids = {"frontend": frontend.pid}
        pids.update({part: p.pid for part, p in zip(workers, procs[: len(workers)], strict=True)})
        pids["nats"] = nats_server_pid(nats)
        yield Stack(frontend.base_url, pids, tuple(procs))


@contextmanager
def launch_stack(
    script: str,
    served: str,
    *,
    env: Mapping[str, str],
    log_dir: Path,
    timeout: float,
) -> Iterator[Stack]:
    """One of the launch scripts (`launch/<script>`) as a user runs it, on a free HTTP port
    with its own nats-server and namespace, until its frontend serves `served`; `env` adds
    the script's variables (SPEC, WORKER_ARGS, ...). Its processes log under `log_dir`;
    stopping the script stops them. Part of the `Stack`: `launch` (the script's tree)."""
    port = free_port()
    own_env = {
        "HTTP_PORT": str(port),
        "NATS_SERVER": "",  # never reuse another stack's server
        "NAMESPACE": f"launch{port}",
        "LOG_DIR": str(log_dir),
        **env,
    }
    argv = ["bash", str(ROOT / "launch" / script)]
    with running([ManagedProcess("launch", argv, log_dir, own_env, cwd=ROOT)]) as procs:
        base_url = f"http://127.0.0.1:{port}"
        took = wait_serving(base_url, served, procs, timeout=timeout)
        print(f"  launch/{script} ready in {took:.0f}s", flush=True)
        yield Stack(base_url, {"launch": procs[0].pid}, tuple(procs))


# --------------------------------------------------------------------------- vLLM bench serve


@dataclass(frozen=True)
class Scenario:
    """One `vllm bench serve` run: greedy, ignore-eos, /v1/completions, on the random
    dataset, or on `prompts_file` (JSON lines `{"prompt": ...}`, sent through the chat
    template: real text, which speculative decoding needs to show anything)."""

    name: str
    concurrency: int
    num_prompts: int
    seed: int  # different per scenario, so no run reuses another's prompts from the cache
    input_len: int = 256
    output_len: int = 128
    prompts_file: Path | None = None


@dataclass
class RunResult:
    """What we keep of one `vllm bench serve` run."""

    completed: int
    failed: int
    duration_s: float
    output_throughput: float
    median_ttft_ms: float
    median_itl_ms: float
    median_tpot_ms: float
    p90_ttft_ms: float
    p90_itl_ms: float
    p99_ttft_ms: float
    p99_itl_ms: float
    output_tokens: int
    p90_tpot_ms: float = float("nan")
    # CPU seconds the serving processes (and their children) used during the run, by
    # process: on a busy machine a steadier view of the overhead than wall-clock numbers.
    server_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_ms_per_token(self) -> float:
        """Server CPU milliseconds per generated token."""
        return 1000 * sum(self.server_cpu_s.values()) / max(1, self.output_tokens)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        """From the result file `vllm bench serve --save-result` writes: every field under
        its own name or its `RESULT_FILE_KEYS` one; one with a default may be missing,
        `server_cpu_s` is not in the file."""
        kept: dict[str, Any] = {}
        for f in fields(cls):
            key = RESULT_FILE_KEYS.get(f.name, f.name)
            if f.default_factory is MISSING and (f.default is MISSING or key in data):
                kept[f.name] = data[key]
        return cls(**kept)


# `RunResult` fields that the result file of `vllm bench serve` names otherwise.
RESULT_FILE_KEYS = {"duration_s": "duration", "output_tokens": "total_output_tokens"}


def bench_serve_argv(
    base_url: str, model_dir: Path, served: str, scenario: Scenario, result_path: Path
) -> list[str]:
    """The command line of one `vllm bench serve` run writing its result to `result_path`."""
    return vllm_bench_serve_argv(
        "--backend", "openai",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", served,
        "--tokenizer", str(model_dir),
        *_dataset_args(scenario),
        "--ignore-eos",
        "--temperature", "0",
        "--num-prompts", str(scenario.num_prompts),
        "--max-concurrency", str(scenario.concurrency),
        "--num-warmups", str(min(4, max(2, scenario.concurrency))),
        "--seed", str(scenario.seed),
        "--percentile-metrics", "ttft,tpot,itl",
        "--metric-percentiles", "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_path.parent),
        "--result-filename", result_path.name,
    )  # fmt: skip


def _dataset_args(scenario: Scenario) -> list[str]:
    if scenario.prompts_file is not None:
        return [
            "--dataset-name", "custom",
            "--dataset-path", str(scenario.prompts_file),
            "--custom-output-len", str(scenario.output_len),
        ]  # fmt: skip
    return [
        "--dataset-name", "random",
        "--random-input-len", str(scenario.input_len),
        "--random-output-len", str(scenario.output_len),
    ]  # fmt: skip


def run_bench_serve(
    base_url: str, model_dir: Path, served: str, scenario: Scenario, out_dir: Path, label: str
) -> RunResult:
    """Run `vllm bench serve` for `scenario` against `base_url`; its log and result go to
    `<out_dir>/<label>-<scenario>.{log,json}`. Raises `BenchError` (with the log tail)
    when it fails or any request fails."""
    stem = f"{label}-{scenario.name}"
    result_path = out_dir / f"{stem}.json"
    log_path = out_dir / f"{stem}.log"
    argv = bench_serve_argv(base_url, model_dir, served, scenario, result_path)
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, check=False
        )
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
    if proc.returncode != 0 or not result_path.exists():
        raise BenchError(
            f"vllm bench serve ({label}, {scenario.name}) exited with {proc.returncode} "
            f"(log: {log_path}):\n{tail}"
        )
    result = RunResult.from_json(json.loads(result_path.read_text()))
    if result.failed or result.completed != scenario.num_prompts:
        raise BenchError(
            f"{label}, {scenario.name}: {result.failed} failed, {result.completed} of "
            f"{scenario.num_prompts} completed (log: {log_path}):\n{tail}"
        )
    return result


def measure_scenarios(
    stack: Stack,
    model_dir: Path,
    served: str,
    scenarios: Sequence[Scenario],
    out_dir: Path,
    label: str,
) -> dict[str, RunResult]:
    """Every scenario against one running stack, with the stack's CPU use per run; prints
    one line per scenario."""
    results: dict[str, RunResult] = {}
    for scenario in scenarios:
        t0 = time.monotonic()
        cpu_before = stack.cpu_seconds()
        r = run_bench_serve(stack.base_url, model_dir, served, scenario, out_dir, label)
        r.server_cpu_s = cpu_delta(cpu_before, stack.cpu_seconds())
        results[scenario.name] = r
        print(
            f"  {scenario.name}: {r.output_throughput:.1f} tok/s, p50 TTFT "
            f"{r.median_ttft_ms:.1f} ms, p50 ITL {r.median_itl_ms:.2f} ms, server CPU "
            f"{r.cpu_ms_per_token:.2f} ms/token {r.server_cpu_s} "
            f"({time.monotonic() - t0:.0f}s)",
            flush=True,
        )
    return results


# --------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, `q` in [0, 1]; raises ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A plain-text table: a header, a rule, one line per row. `align` holds '<' or '>'
    per column (default: first column left, the others right)."""
    aligns = align or "<" + ">" * (len(headers) - 1)
    if len(aligns) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError("format_table: headers, rows and align differ in length")
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = (f"{c:{a}{w}}" for c, a, w in zip(cells, aligns, widths, strict=True))
        return "  ".join(parts).rstrip()

    head = line(headers)
    return "\n".join([head, "-" * len(head), *(line(row) for row in rows)])


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write `data` as indented JSON, creating the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_report(path: Path | None, data: Mapping[str, Any]) -> None:
    """Write the report to `path` (None: nowhere) and say where it went."""
    if path is not None:
        write_json(path, data)
        print(f"numbers written to {path}")


def host_info() -> dict[str, Any]:
    """CPU count and load average: how busy the machine was when the numbers were taken."""
    return {"cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg())}
