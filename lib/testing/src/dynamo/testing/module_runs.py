"""Running a command line of the project (`python -m <module> ...`) to its end, as a test
of the command line itself: exit status, stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""What a child that must not reach the Hugging Face hub adds to its environment."""


def run_module(
    module: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    unset: Iterable[str] = (),
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """`python -m module *args` with this interpreter, waited for (`timeout` seconds at
    most), its output captured as text. Its environment is this process's with `env`
    added and the variables in `unset` removed. A non-zero exit is the caller's to check."""
    child_env = {**os.environ, **(env or {})}
    for name in unset:
        child_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        check=False,
    )
