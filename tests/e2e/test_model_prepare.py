"""Preparing the embedded model: a damaged cache is detected and rebuilt; a valid one is a
no-op. (Slow: the rebuild converts the GGUF again, about half a minute.)"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.module_runs import run_module


def prepare(root: Path) -> subprocess.CompletedProcess[str]:
    return run_module(
        "dynamo.llm.models", "prepare", DEFAULT_MODEL, env={"DYN_MODEL_DIR": str(root)}, timeout=600
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
