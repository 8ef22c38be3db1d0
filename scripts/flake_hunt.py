#!/usr/bin/env python3
"""Run test modules several times while another process keeps one core busy.

CI runs on shared machines that are slow at times; a test that passes on an idle machine
and fails when a core is taken is a flake waiting for CI. This runs each module given
(a file, or a folder: every `test_*.py` under it) `--runs` times in a row, each run a
fresh pytest process, with a spinner process burning one core for the whole hunt, and
prints a table of passes and failures per module. Exit status 1 when any run failed.

    make flake-hunt MODULE=tests/integration/kv_router/test_router_replica_sync.py
    make flake-hunt MODULE="tests/integration tests/e2e" RUNS=5

The log of every failed run is kept under `--log-dir` (default: a temporary folder whose
path is printed).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def spin() -> None:
    """Burn one core until killed."""
    while True:
        pass


def modules(paths: list[str]) -> list[Path]:
    """Test modules named by `paths`: files as given, folders expanded to their
    `test_*.py` files, in sorted order."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(sorted(path.rglob("test_*.py")))
        elif path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"flake_hunt: no such test module or folder: {raw}")
    if not found:
        raise SystemExit(f"flake_hunt: no test modules under {' '.join(paths)}")
    return found


def run_once(module: Path, pytest_args: list[str], log: Path) -> tuple[bool, float]:
    """One pytest process over `module`; (passed, seconds). Its output goes to `log`."""
    start = time.monotonic()
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider",
             *pytest_args],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )  # fmt: skip
    # 5: every test of the module was deselected by the caller's -k / -m: not a failure.
    return done.returncode in (0, 5), time.monotonic() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run test modules RUNS times each while one core is kept busy; "
        "report passes and failures per module."
    )
    parser.add_argument("paths", nargs="+", help="test modules or folders of them")
    parser.add_argument("--runs", type=int, default=5, help="runs per module (default 5)")
    parser.add_argument(
        "--busy-cores", type=int, default=1, help="cores kept busy meanwhile (default 1)"
    )
    parser.add_argument("--log-dir", type=Path, help="where failed runs' logs are kept")
    parser.add_argument(
        "--pytest-args", default="", help="extra pytest arguments, one string (e.g. '-x')"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy_cores < 0:
        parser.error("--runs must be at least 1 and --busy-cores at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = modules(args.paths)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="flake-hunt-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy_cores)]
    for spinner in spinners:
        spinner.start()
    print(
        f"flake hunt: {len(targets)} module(s) x {args.runs} run(s), "
        f"{args.busy_cores} core(s) kept busy; logs of failed runs in {log_dir}",
        flush=True,
    )
    failures = 0
    rows = []
    try:
        for module in targets:
            passed, times = 0, []
            for run in range(1, args.runs + 1):
                log = log_dir / f"{module.stem}.run{run}.log"
                ok, seconds = run_once(module, args.pytest_args.split(), log)
                times.append(seconds)
                passed += ok
                if ok:
                    log.unlink()
                print(f"  {module} run {run}: {'pass' if ok else 'FAIL'} ({seconds:.0f} s)"
                      + ("" if ok else f" log: {log}"), flush=True)  # fmt: skip
            failures += args.runs - passed
            rows.append((module, passed, args.runs, max(times)))
    finally:
        for spinner in spinners:
            spinner.kill()
    print("\nmodule | passed | runs | slowest run (s)")
    for module, passed, runs, slowest in rows:
        print(f"{module} | {passed} | {runs} | {slowest:.0f}")
    total = len(targets) * args.runs
    print(f"\n{total - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
