"""`python -m dynamo.runtime.supervise`: a worker that fails is started again after a
back-off; a clean exit, a "bad configuration" exit, or a stop request ends it.

Real child processes (small Python scripts) under the real supervisor process; the
back-off is shortened so that each test takes a second or two."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo.runtime.supervise import RESTARTS_ENV, Backoff, restarts_so_far
from dynamo.testing.waiting import wait_until

FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2"]


def child_script(tmp_path: Path, body: str) -> Path:
    """A child that appends its restart count to `runs.txt`, then runs `body`."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys, time\n"
        f"with open({str(tmp_path / 'runs.txt')!r}, 'a') as f:\n"
        f"    f.write(os.environ.get({RESTARTS_ENV!r}, '-') + '\\n')\n" + body
    )
    return script


def runs(tmp_path: Path) -> list[str]:
    path = tmp_path / "runs.txt"
    return path.read_text().split() if path.exists() else []


def supervise(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "dynamo.runtime.supervise", *args])


def test_a_failing_child_is_restarted_with_its_count_until_the_limit(tmp_path: Path) -> None:
    script = child_script(tmp_path, "sys.exit(1)\n")
    proc = supervise(*FAST, "--max-restarts", "3", "--", sys.executable, str(script))
    assert proc.wait(30) == 1
    assert runs(tmp_path) == ["0", "1", "2", "3"]


def test_a_child_killed_by_a_signal_is_restarted_and_a_clean_exit_ends_it(tmp_path: Path) -> None:
    body = (
        "import signal\n"
        "if os.environ['DYN_WORKER_RESTARTS'] == '0':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "sys.exit(0)\n"
    )
    proc = supervise(*FAST, "--", sys.executable, str(child_script(tmp_path, body)))
    assert proc.wait(30) == 0
    assert runs(tmp_path) == ["0", "1"]


def test_a_bad_configuration_exit_is_not_restarted(tmp_path: Path) -> None:
    proc = supervise(*FAST, "--", sys.executable, str(child_script(tmp_path, "sys.exit(2)\n")))
    assert proc.wait(30) == 2
    assert runs(tmp_path) == ["0"]


def test_sigterm_reaches_the_child_and_nothing_restarts(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    body = (
        "import signal\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    proc = supervise(*FAST, "--", sys.executable, str(child_script(tmp_path, body)))
    wait_until(ready.exists, timeout=20, what="the child to handle SIGTERM")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert runs(tmp_path) == ["0"]


def test_the_backoff_doubles_and_resets_after_a_stable_run() -> None:
    backoff = Backoff(initial=1.0, maximum=5.0, stable_after=60.0)
    delays, delay = [], None
    for _ in range(5):
        delay = backoff.next_delay(delay, ran_for=1.0)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.next_delay(5.0, ran_for=61.0) == 1.0


def test_restarts_so_far_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    assert restarts_so_far() == 0
    monkeypatch.setenv(RESTARTS_ENV, "4")
    assert restarts_so_far() == 4
