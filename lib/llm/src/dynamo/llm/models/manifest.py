"""`dynamo_manifest.json`: what a prepared model directory must contain, and the checks.

The manifest is written last, inside the staging directory, so its presence means the build
finished. It records the sha256, size and mtime of every file. Two levels of checking:

* quick (`full=False`): sizes and mtimes, hashing only files whose mtime moved (a copied
  directory costs one hash pass, an untouched one costs a few `stat` calls). This is what
  `prepare` does on every call, so it stays free of torch/transformers imports.
* full (`full=True`): every file is hashed. This is what `verify` does.

Only the standard library is used here, on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from dynamo.llm.models.recipes import ModelRecipe

MANIFEST_NAME = "dynamo_manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class SourceInfo:
    """Where the weights came from."""

    package: str
    package_version: str
    gguf_file: str
    gguf_sha256: str


@dataclass(frozen=True)
class Manifest:
    recipe: str
    recipe_version: int
    source: SourceInfo
    created: str
    files: dict[str, FileEntry]
    tools: dict[str, str] = field(default_factory=dict)
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        return cls(
            recipe=str(raw["recipe"]),
            recipe_version=int(raw["recipe_version"]),
            source=SourceInfo(**raw["source"]),
            created=str(raw["created"]),
            files={name: FileEntry(**entry) for name, entry in raw["files"].items()},
            tools={str(k): str(v) for k, v in raw.get("tools", {}).items()},
            format=int(raw.get("format", 0)),
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _model_files(model_dir: Path) -> list[str]:
    """Relative POSIX paths of every regular file under `model_dir`, manifest excluded."""
    names = []
    for root, _dirs, files in os.walk(model_dir):
        for name in files:
            rel = (Path(root) / name).relative_to(model_dir).as_posix()
            if rel != MANIFEST_NAME:
                names.append(rel)
    return sorted(names)


def build_manifest(
    model_dir: Path, recipe: ModelRecipe, source: SourceInfo, tools: dict[str, str] | None = None
) -> Manifest:
    """Hash every file in `model_dir` (which must be complete) into a manifest."""
    files = {}
    for rel in _model_files(model_dir):
        path = model_dir / rel
        stat = path.stat()
        files[rel] = FileEntry(
            sha256=sha256_file(path), size=stat.st_size, mtime_ns=stat.st_mtime_ns
        )
    return Manifest(
        recipe=recipe.name,
        recipe_version=recipe.version,
        source=source,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        files=files,
        tools=dict(tools or {}),
    )


def write_manifest(model_dir: Path, manifest: Manifest) -> Path:
    """Write the manifest durably (temp file, fsync, rename): it is the 'build finished' mark."""
    target = model_dir / MANIFEST_NAME
    partial = model_dir / f".{MANIFEST_NAME}.partial"
    with partial.open("w", encoding="utf-8") as handle:
        handle.write(manifest.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    partial.replace(target)
    return target


def read_manifest(model_dir: Path) -> Manifest:
    """The manifest of `model_dir`; FileNotFoundError or ValueError when absent or unreadable."""
    path = model_dir / MANIFEST_NAME
    try:
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unreadable manifest {path}: {exc}") from exc


def check_model_dir(model_dir: Path, recipe: ModelRecipe, *, full: bool = False) -> list[str]:
    """Problems that make `model_dir` unusable as a build of `recipe`; empty when it is valid.

    Each problem is one human-readable line naming the file and what is wrong with it.
    """
    if not model_dir.is_dir():
        return [f"{model_dir} does not exist"]
    try:
        manifest = read_manifest(model_dir)
    except FileNotFoundError:
        return [f"{MANIFEST_NAME} is missing (unfinished or foreign directory)"]
    except ValueError as exc:
        return [str(exc)]
    problems = _check_identity(manifest, recipe)
    for rel, entry in sorted(manifest.files.items()):
        problem = _check_file(model_dir / rel, entry, full=full)
        if problem:
            problems.append(f"{rel}: {problem}")
    return problems


def _check_identity(manifest: Manifest, recipe: ModelRecipe) -> list[str]:
    problems = []
    if manifest.format != MANIFEST_FORMAT:
        problems.append(f"manifest format {manifest.format}, expected {MANIFEST_FORMAT}")
    if manifest.recipe != recipe.name:
        problems.append(f"built by recipe {manifest.recipe!r}, expected {recipe.name!r}")
    if manifest.recipe_version != recipe.version:
        problems.append(
            f"built by recipe version {manifest.recipe_version}, current is {recipe.version}"
        )
    missing = [name for name in recipe.required_files if name not in manifest.files]
    if missing:
        problems.append(f"manifest lacks required files: {', '.join(missing)}")
    if not any(name.endswith(".safetensors") for name in manifest.files):
        problems.append("manifest lists no *.safetensors weights")
    return problems


def _check_file(path: Path, entry: FileEntry, *, full: bool) -> str | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return "missing"
    if stat.st_size != entry.size:
        return f"size {stat.st_size}, expected {entry.size}"
    if not full and stat.st_mtime_ns == entry.mtime_ns:
        return None
    if sha256_file(path) != entry.sha256:
        return "sha256 differs from the manifest"
    return None
