"""NVIDIA Dynamo itself (`ai-dynamo` from the package registry) as a reference stack:
its frontend and its own mocker on the same workload as ours, without etcd or NATS.

Dynamo is installed into a virtualenv of its own (default
`~/.cache/dynamo-bench/ai-dynamo-<version>`, reused when present): `ai-dynamo` and
`ai-dynamo-runtime` without their declared dependencies (vLLM, Kubernetes, ...: none of
which the frontend or the mocker import), then only the few modules those two entry
points import (`REFERENCE_MODULES`, found by running their `--help` until it worked).
`ensure_reference` does it and checks that both `--help`s run; it raises
`ReferenceUnavailable` with a one-line reason otherwise; `reference_or_reason` says which
it was and returns the reason instead.

`reference_stack` starts one `python -m dynamo.mocker --num-workers N` process and one
`python -m dynamo.frontend` on a free port, both with file discovery (`DYN_FILE_KV` set to
a directory of their own), the TCP request plane and the ZMQ event plane, and yields the
frontend's base URL once every worker has registered and the model is served.

What it reports: its responses' `usage.prompt_tokens_details.cached_tokens` is the mocker's
own prefix-cache hit (checked with `--router-mode round-robin`, where the router keeps no
cache state: a prompt's first request reports 0 cached tokens, a repeat on the same worker
its full blocks), so it is counted like ours. With `nvext.extra_fields = ["timing"]` in a
request, the final chunk's `nvext.timing.kv_hit_rate` is the KV router's predicted overlap
for that request (overlap blocks / prompt blocks): the router's predicted hit rate.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dynamo.runtime.ports import free_port
from dynamo.testing.processes import ManagedProcess, running, wait_serving, wait_while_alive
from harness import Stack

REFERENCE_VERSION = "1.6.1"
DEFAULT_VENV = Path.home() / ".cache" / "dynamo-bench" / f"ai-dynamo-{REFERENCE_VERSION}"

# What `python -m dynamo.frontend --help` and `python -m dynamo.mocker --help` of
# ai-dynamo 1.6.1 import beyond the two packages (pydantic within ai-dynamo-runtime's range).
REFERENCE_MODULES = (
    "uvloop",
    "typing-extensions",
    "packaging",
    "pyyaml",
    "msgspec",
    "pydantic>=2.10.6,<=2.13.5",
)
# Both processes find each other through files and talk over TCP / ZMQ: no etcd, no NATS.
PLANES = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq")
READY_MARKER = ".bench-ready"
INSTALL_TIMEOUT_S = 600


class ReferenceUnavailable(RuntimeError):
    """The reference could not be installed or does not start; the message says why."""


@dataclass(frozen=True)
class Reference:
    """An installed reference: its interpreter, version, and how long installing took
    (0 when an earlier install was reused)."""

    python: Path
    version: str
    install_s: float


def ensure_reference(venv: Path = DEFAULT_VENV, version: str = REFERENCE_VERSION) -> Reference:
    """The reference virtualenv, created and filled if it is not ready yet; raises
    `ReferenceUnavailable` (one line) when installing or the `--help` check fails."""
    python = venv / "bin" / "python"
    marker = venv / READY_MARKER
    if marker.exists() and marker.read_text().strip() == version and python.exists():
        return Reference(python, version, 0.0)
    began = time.monotonic()
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "creating the virtualenv")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    packages = [f"ai-dynamo=={version}", f"ai-dynamo-runtime=={version}"]
    _run([*pip, "--no-deps", *packages], f"pip install --no-deps {' '.join(packages)}")
    _run([*pip, *REFERENCE_MODULES], f"pip install {' '.join(REFERENCE_MODULES)}")
    for entry in ("dynamo.frontend", "dynamo.mocker"):
        _run([str(python), "-m", entry, "--help"], f"python -m {entry} --help")
    marker.write_text(version + "\n")
    return Reference(python, version, round(time.monotonic() - began, 1))


def reference_or_reason(
    venv: Path, file: TextIO | None = None
) -> tuple[Reference | None, str | None]:
    """`ensure_reference(venv)`, saying on `file` (default stdout) what came of it: the
    reference and None, or None and why it is unavailable (the benchmark then measures
    ours only)."""
    try:
        reference = ensure_reference(venv)
    except ReferenceUnavailable as exc:
        print(f"reference unavailable, measuring ours only: {exc}", file=file, flush=True)
        return None, str(exc)
    how = f"installed in {reference.install_s:.0f}s" if reference.install_s else "reused"
    print(f"reference: ai-dynamo {reference.version} in {venv} ({how})", file=file, flush=True)
    return reference, None


def _run(argv: Sequence[str], what: str) -> None:
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReferenceUnavailable(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise ReferenceUnavailable(f"{what} failed: {lines[-1] if lines else proc.returncode}")


@dataclass(frozen=True)
class MockerShape:
    """The simulated workers, in terms both mockers understand."""

    workers: int
    block_size: int
    kv_blocks: int
    max_model_len: int
    speed_up: float


def mocker_argv(
    python: Path, model_dir: Path, served: str, namespace: str, shape: MockerShape
) -> list[str]:
    """Dynamo's `python -m dynamo.mocker` with `shape`."""
    return [
        str(python), "-m", "dynamo.mocker",
        "--model-path", str(model_dir),
        "--model-name", served,
        "--endpoint", f"dyn://{namespace}.backend.generate",
        "--num-workers", str(shape.workers),
        "--block-size", str(shape.block_size),
        "--num-gpu-blocks-override", str(shape.kv_blocks),
        "--max-model-len", str(shape.max_model_len),
        "--speedup-ratio", str(shape.speed_up),
        *PLANES,
    ]  # fmt: skip


def frontend_argv(python: Path, port: int, namespace: str, extra: Sequence[str]) -> list[str]:
    """Dynamo's `python -m dynamo.frontend` on 127.0.0.1:`port` for `namespace`."""
    return [
        str(python), "-m", "dynamo.frontend",
        "--http-host", "127.0.0.1",
        "--http-port", str(port),
        "--namespace", namespace,
        *PLANES,
        *extra,
    ]  # fmt: skip


def registered_workers(discovery: Path, namespace: str) -> int:
    """Worker instances of `namespace`'s `backend/generate` in a file-discovery directory
    (one file per instance, named by its percent-encoded key)."""
    instances = discovery / "v1" / "instances"
    if not instances.is_dir():
        return 0
    prefix = f"{namespace}%2Fbackend%2Fgenerate%2F"
    return sum(1 for entry in instances.iterdir() if entry.name.startswith(prefix))


@contextlib.contextmanager
def reference_stack(
    reference: Reference,
    model_dir: Path,
    served: str,
    shape: MockerShape,
    *,
    namespace: str,
    log_dir: Path,
    frontend_args: Sequence[str] = ("--router-mode", "kv"),
    mocker_args: Sequence[str] = (),
    timeout: float = 120.0,
) -> Iterator[Stack]:
    """Dynamo's mocker (`shape`) and frontend (`frontend_args`), until the frontend serves
    `served` and all workers have registered; yields the stack (parts `frontend` and
    `mocker`), stops both on exit.
    Logs: `<log_dir>/<namespace>-{mocker,frontend}.log`. `namespace` must be
    alphanumeric (it names files)."""
    discovery = log_dir / f"{namespace}-discovery"
    discovery.mkdir(parents=True, exist_ok=True)
    env = {"DYN_FILE_KV": str(discovery)}
    port = free_port()
    with running([]) as procs:
        argv = mocker_argv(reference.python, model_dir, served, namespace, shape)
        procs.append(ManagedProcess(f"{namespace}-mocker", [*argv, *mocker_args], log_dir, env))
        argv = frontend_argv(reference.python, port, namespace, frontend_args)
        procs.append(ManagedProcess(f"{namespace}-frontend", argv, log_dir, env))
        base_url = f"http://127.0.0.1:{port}"
        wait_while_alive(
            lambda: registered_workers(discovery, namespace) >= shape.workers,
            procs,
            timeout=timeout,
            interval=0.25,
            what=f"{shape.workers} Dynamo mocker workers to register in {discovery}",
        )
        wait_serving(base_url, served, procs, timeout=timeout, interval=0.25)
        time.sleep(1.0)  # the frontend's watch picks up the last instances' files
        mocker, frontend = procs
        yield Stack(base_url, {"frontend": frontend.pid, "mocker": mocker.pid}, tuple(procs))
