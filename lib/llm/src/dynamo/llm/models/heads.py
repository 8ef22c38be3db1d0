"""Draft heads that ship with the project, prepared next to the model they draft for.

A head is trained once (`python -m dynamo.vllm.train_eagle3`, `make eagle3`) and committed
under `heads/<name>/` as a speculators checkpoint whose verifier is named by its recipe
(`smollm2-135m-instruct`), so the repository copy does not depend on where anyone's cache
lives. `prepare_head` copies it into the model cache (`<cache>/<name>/`) with the verifier
rewritten to the prepared target's absolute directory, which is what vLLM itself expects
when the head is given as `--model`. A marker file records the digest of the shipped
weights, so a retrained head replaces a stale prepared copy on the next `make setup`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dynamo.llm.models import cache

Log = Callable[[str], None]

HEADS_DIR = Path(__file__).resolve().parent / "heads"
"""Where the shipped heads live in the source tree (package data)."""

MARKER = "dynamo-head.json"
"""Written into a prepared head: which shipped weights it was copied from."""


@dataclass(frozen=True)
class DraftHead:
    """A shipped draft head for an embedded model."""

    name: str
    description: str
    target: str
    """The embedded model (recipe name) the head drafts for: its verifier."""
    method: str
    num_speculative_tokens: int
    """The K it was trained (and measured) for."""

    @property
    def source_dir(self) -> Path:
        return HEADS_DIR / self.name


KNOWN_HEADS: dict[str, DraftHead] = {
    head.name: head
    for head in (
        DraftHead(
            name="smollm2-135m-instruct-eagle3",
            description="Eagle3 head (1 layer, draft vocabulary 8192) trained here by "
            "self-distillation for smollm2-135m-instruct; recipe.json beside it",
            target="smollm2-135m-instruct",
            method="eagle3",
            num_speculative_tokens=3,
        ),
    )
}


class HeadError(RuntimeError):
    """A shipped head is missing or damaged in the source tree."""


def get_head(name: str) -> DraftHead | None:
    return KNOWN_HEADS.get(name.strip().lower())


def weights_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def is_head_prepared(head: DraftHead) -> bool:
    """The prepared copy exists and was made from the weights shipped now."""
    marker = cache.model_dir(head.name) / MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("weights_sha256") == weights_digest(head.source_dir)


def prepare_head(head: DraftHead, target_dir: Path, *, log: Log) -> Path:
    """Copy the shipped head into the cache with its verifier pointing at `target_dir` (the
    prepared target). A no-op when the prepared copy is current."""
    destination = cache.model_dir(head.name)
    if is_head_prepared(head):
        log(f"{head.name} is prepared at {destination}")
        return destination
    source = head.source_dir
    config_path = source / "config.json"
    if not config_path.is_file() or not list(source.glob("*.safetensors")):
        raise HeadError(f"the shipped head {head.name} is missing from {source}")
    with cache.build_lock(head.name):
        for leftover in cache.remove_leftovers(head.name):
            log(f"removed leftover {leftover}")
        with cache.staging_dir(head.name) as staging:
            for path in source.iterdir():
                if path.is_file():
                    shutil.copy2(path, staging / path.name)
            config = json.loads(config_path.read_text())
            verifier = config["speculators_config"]["verifier"]
            verifier["name_or_path"] = str(target_dir)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            marker = {"head": head.name, "weights_sha256": weights_digest(source)}
            (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            cache.install(staging, destination)
    log(f"prepared {head.name} at {destination} (verifier {target_dir})")
    return destination
