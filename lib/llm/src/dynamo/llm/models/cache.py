"""Where prepared models live, and how a new build replaces an old one without a torn state.

Layout under the cache root (`$DYN_MODEL_DIR`, default `~/.cache/dynamo/models`):

    <root>/<name>/                 the prepared model (valid only with its manifest)
    <root>/.<name>.lock            flock held while (re)building, so concurrent preparers wait
    <root>/.<name>.build-XXXX/     staging directory of a build in progress
    <root>/.<name>.old-XXXX/       a replaced build, removed right after the swap

Staging lives next to the target so the final `rename` stays on one filesystem (atomic).
Leftover staging and old directories from an interrupted run are removed by the next build.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV_MODEL_DIR = "DYN_MODEL_DIR"
_DEFAULT_ROOT = Path("~/.cache/dynamo/models")


def model_cache_dir() -> Path:
    """The cache root: `$DYN_MODEL_DIR` when set and non-empty, else ~/.cache/dynamo/models."""
    configured = os.environ.get(ENV_MODEL_DIR, "").strip()
    return (Path(configured) if configured else _DEFAULT_ROOT).expanduser().absolute()


def model_dir(name: str) -> Path:
    """Where the model called `name` lives once prepared (it may not exist yet)."""
    return model_cache_dir() / name


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Exclusive lock for building `name`; blocks while another process builds it."""
    root = model_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{name}.lock").open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def remove_leftovers(name: str) -> list[Path]:
    """Delete staging/old directories of `name` left by interrupted runs (call under the lock)."""
    removed = []
    for pattern in (f".{name}.build-*", f".{name}.old-*"):
        for path in model_cache_dir().glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextmanager
def staging_dir(name: str) -> Iterator[Path]:
    """A fresh directory next to the target; removed on exit unless `install` moved it."""
    path = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=model_cache_dir()))
    try:
        yield path
    finally:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)


def install(staged: Path, target: Path) -> None:
    """Put `staged` at `target`, replacing whatever is there.

    A directory cannot be renamed over a non-empty one, so the old one is renamed aside first,
    then the new one takes its place, then the old one is deleted. A crash in between leaves
    either no target (rebuilt next time) or a complete one; never a mixture.
    """
    _fsync_dir(staged)
    aside = None
    if target.exists() or target.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        aside.rmdir()
        target.rename(aside)
    staged.rename(target)
    _fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
