"""Preparing the embedded model: a damaged cache is detected and rebuilt; a valid one is a
no-op. (Slow: the rebuild converts the GGUF again, about half a minute.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dynamo.llm.models import DEFAULT_MODEL


def prepare(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo.llm.models", "prepare", DEFAULT_MODEL],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DYN_MODEL_DIR": str(root)},
        check=False,
    )


def test_corrupt_cache_is_rebuilt_and_valid_cache_is_a_noop(
    tmp_path: Path, embedded_model: Path
) -> None:
    root = tmp_path / "cache"
    target = root / DEFAULT_MODEL
    shutil.copytree(embedded_model, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])  # truncated: a torn copy

    rebuilt = prepare(root)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "rebuilding" in rebuilt.stderr and "size" in rebuilt.stderr
    assert rebuilt.stdout.strip() == str(target)
    assert weights.stat().st_size == (embedded_model / "model.safetensors").stat().st_size
    assert not list(root.glob(f".{DEFAULT_MODEL}.build-*")), "staging directory left behind"

    started = time.monotonic()
    again = prepare(root)
    assert again.returncode == 0
    assert "is prepared" in again.stderr and "converting" not in again.stderr
    assert time.monotonic() - started < 20
