"""The sampling defaults a recipe puts into its model's `generation_config.json`.

`vllm serve` (and our worker, with `--generation-config auto`) gives every sampling field a
request leaves unset the value in the model's generation_config.json. A converted GGUF has
none, so a request without `temperature` would sample at 1.0, which on a 135M model gives
word salad. Each recipe therefore names the defaults its model's authors recommend, and
they are merged into the file (its other keys, such as the bos/eos ids, are kept).

They are a separate layer from the conversion on purpose: a cache prepared before the
recipe gained (or changed) its defaults is patched in place, in milliseconds and without
torch, instead of being converted again, and the manifest entry of the one file is
refreshed so the quick and full checks keep passing. Only the standard library is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynamo.llm.models.manifest import FileEntry, read_manifest, sha256_file, write_manifest
from dynamo.llm.models.recipes import ModelRecipe

GENERATION_CONFIG = "generation_config.json"


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    """The directory's generation_config.json ({} when absent or unreadable)."""
    try:
        loaded = json.loads((model_dir / GENERATION_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def stale_defaults(model_dir: Path, recipe: ModelRecipe) -> dict[str, Any]:
    """The recipe's defaults the directory's generation_config.json lacks or contradicts
    (empty: up to date)."""
    current = read_generation_config(model_dir)
    return {
        key: value
        for key, value in recipe.generation_defaults.items()
        if key not in current or current[key] != value
    }


def write_defaults(model_dir: Path, defaults: Mapping[str, Any]) -> Path:
    """Merge `defaults` into generation_config.json atomically (temp file, fsync, rename):
    a process reading it meanwhile sees the old file or the new one, never half of one."""
    path = model_dir / GENERATION_CONFIG
    merged = {**read_generation_config(model_dir), **defaults}
    partial = model_dir / f".{GENERATION_CONFIG}.partial"
    with partial.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    partial.replace(path)
    return path


def upgrade_in_place(model_dir: Path, recipe: ModelRecipe) -> dict[str, Any]:
    """Bring a prepared directory's defaults up to the recipe's and refresh its manifest
    entry; returns what changed (empty: nothing to do). Call under the build lock."""
    stale = stale_defaults(model_dir, recipe)
    if not stale:
        return {}
    path = write_defaults(model_dir, stale)
    manifest = read_manifest(model_dir)
    stat = path.stat()
    entry = FileEntry(sha256=sha256_file(path), size=stat.st_size, mtime_ns=stat.st_mtime_ns)
    write_manifest(model_dir, replace(manifest, files={**manifest.files, GENERATION_CONFIG: entry}))
    return stale
