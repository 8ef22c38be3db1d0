"""Turns `--model` into the local target directory the engine loads, with the name clients
ask for it by.

A speculators checkpoint given as `--model` stays the draft; its verifier becomes the target,
so every engine flag applies to the verifier.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dynamo.llm.models import (
    ModelNotPreparedError,
    PrepareError,
    UnknownModelError,
    is_known_name,
    resolve_model,
)
from dynamo.llm.models import model_dir as cached_model_dir
from dynamo.llm.models.prepare import served_name_for
from dynamo.runtime.cli import ConfigError
from dynamo.vllm.config.layers import SRC_SPECULATORS, SRC_VLLM, SRC_WORKER
from dynamo.vllm.speculative.speculators_checkpoint import (
    SpeculatorsCheckpoint,
    read_speculators_checkpoint,
)

log = logging.getLogger("dynamo.vllm")


def resolve_model_dir(name: str, *, dry_run: bool, what: str = "--model") -> Path:
    """A recipe name or a local directory as a path; a dry run never prepares a model."""
    try:
        return resolve_model(name, prepare=not dry_run)
    except ModelNotPreparedError:
        log.warning("%s %s is not prepared yet; a real start prepares it", what, name)
        return cached_model_dir(name.strip().lower())
    except UnknownModelError as exc:
        raise ConfigError(f"{what}: {exc}") from exc
    except PrepareError as exc:
        raise ConfigError(f"{what}: cannot prepare {name}: {exc}") from exc


def resolve_target(
    values: dict[str, Any], sources: dict[str, str], *, dry_run: bool
) -> tuple[Path, SpeculatorsCheckpoint | None]:
    """The target model directory. A speculators checkpoint given as the model stays the
    draft; its verifier becomes the target (so every engine flag applies to the verifier)."""
    model_dir = resolve_model_dir(str(values["model"]), dry_run=dry_run)
    checkpoint = read_speculators_checkpoint(model_dir)
    target = model_dir
    if sources.get("model") == SRC_VLLM:
        sources["model"] = SRC_WORKER  # the embedded model, not vLLM's own default
    if checkpoint is not None:
        target = _resolve_verifier(checkpoint, dry_run=dry_run)
        sources["model"] = f"{SRC_SPECULATORS} verifier"
        log.info(
            "--model %s is a speculators checkpoint: target %s, draft %s",
            model_dir,
            target,
            model_dir,
        )
    values["model"] = str(target)
    return target, checkpoint


def _resolve_verifier(checkpoint: SpeculatorsCheckpoint, *, dry_run: bool) -> Path:
    """The verifier as a local directory: an embedded model name, a path, or a path
    relative to the checkpoint. Hub ids cannot be fetched here, so they are an error."""
    name = checkpoint.verifier
    if is_known_name(name) or Path(name).expanduser().is_absolute():
        return resolve_model_dir(name, dry_run=dry_run, what="speculators verifier")
    for candidate in (checkpoint.path / name, Path(name)):  # relative: to the checkpoint first
        if candidate.is_dir():
            return candidate.resolve()
    raise ConfigError(
        f"speculators checkpoint {checkpoint.path}: verifier {name!r} is neither an embedded model "
        "nor a local directory; edit speculators_config.verifier.name_or_path to point at the "
        "target, or pass the target as --model and the draft with --speculative-config"
    )


def served_name(values: dict[str, Any], sources: dict[str, str]) -> str:
    """The name clients use: the first --served-model-name, else the recipe or directory name
    of the target (the verifier for a speculators checkpoint)."""
    names = values.get("served_model_name")
    if names:
        return str(names[0] if isinstance(names, list) else names)
    name = served_name_for(values["model"])  # already the resolved target directory
    values["served_model_name"] = [name]
    sources["served_model_name"] = SRC_WORKER
    return name
