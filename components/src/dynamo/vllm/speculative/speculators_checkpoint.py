"""Speculators-format checkpoints: reading a draft directory's `config.json`.

Holds the detection of Eagle vs Eagle3 from a draft checkpoint and the reading of a
speculators checkpoint (draft weights plus the name of its verifier). It is separate
because it is the only part of the config sources that touches the filesystem and model
formats rather than user-written keys; the TensorRT-LLM translation and the model
resolution both consult it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.runtime.cli import ConfigError
from dynamo.vllm.speculative.config_keys import check_draft_length

SPECULATORS_METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "peagle": {"method": "eagle3", "parallel_drafting": True},
    "dflash": {"method": "dflash"},
    "dflash2": {"method": "dflash"},
    "dspark": {"method": "dspark"},
}
"""`speculators_model_type` -> vLLM method (and the flags that type implies): exactly the
types vLLM 0.32 can load as a draft (its `SUPPORTED_SPECULATORS_TYPES`), mapped as its own
speculators reader maps them. Others (e.g. Eagle-1 `eagle`) fail here, not in the engine."""


def read_config_json(model: str | Path) -> dict[str, Any] | None:
    """`config.json` of a local model directory, or None (hub ids, missing or broken files)."""
    path = Path(str(model)).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_EAGLE3_CONFIG_KEYS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "target_hidden_size")


def detect_eagle_method(model: str | Path) -> tuple[str, str]:
    """`eagle` or `eagle3` for a draft checkpoint, with the reason (logged by the caller).

    Eagle3 drafts read hidden states from several target layers and usually have their own
    reduced vocabulary, which shows in their config; Eagle(1) drafts look like a one-layer
    copy of the target. Without a local config.json the name is all there is (vLLM itself
    relies on names like `EAGLE3-LLaMA3.1-...` the same way).
    """
    config = read_config_json(model)
    if config is None:
        if "eagle3" in str(model).lower():
            return "eagle3", f"no local config.json for {model}; its name says eagle3"
        return "eagle", f"no local config.json for {model}; its name does not say eagle3"
    marker = _eagle3_marker(config)
    if marker:
        return "eagle3", f"{model}/config.json {marker}"
    return "eagle", f"{model}/config.json has no Eagle3 markers"


def _eagle3_marker(config: Mapping[str, Any]) -> str | None:
    kind = config.get("speculators_model_type")
    if kind in ("eagle3", "peagle"):
        return f"has speculators_model_type {kind}"
    for arch in config.get("architectures") or []:
        if "eagle3" in str(arch).lower():
            return f"has architecture {arch}"
    nested = config.get("eagle_config")
    for section in (config, nested if isinstance(nested, Mapping) else {}):
        for key in _EAGLE3_CONFIG_KEYS:
            if section.get(key) is not None:
                return f"has {key}"
    return None


@dataclass(frozen=True)
class SpeculatorsCheckpoint:
    """A speculators-format checkpoint: draft weights plus the name of the target (verifier)."""

    path: Path
    verifier: str
    speculative: dict[str, Any]
    """The proposal as a native speculative config; `model` is the checkpoint itself."""


def read_speculators_checkpoint(model_dir: str | Path) -> SpeculatorsCheckpoint | None:
    """The embedded speculative config of `model_dir`, or None when it is an ordinary model.

    The checkpoint stays the draft `model`: vLLM 0.32 loads such a directory as a draft
    through its `SpeculatorsConfig` (and does the same itself when given one as `--model`),
    so only the target has to change.
    """
    config = read_config_json(model_dir)
    if config is None or config.get("speculators_config") is None:
        return None
    where = f"speculators checkpoint {model_dir}"
    body = config["speculators_config"]
    kind = config.get("speculators_model_type")
    if kind not in SPECULATORS_METHODS:
        raise ConfigError(
            f"{where}: speculators_model_type {kind!r} is not supported; "
            f"supported: {', '.join(sorted(SPECULATORS_METHODS))}"
        )
    verifier = ((body.get("verifier") or {}) if isinstance(body, Mapping) else {}).get(
        "name_or_path"
    )
    if not verifier:
        raise ConfigError(f"{where}: speculators_config.verifier.name_or_path is missing")
    proposal = _chosen_proposal(body, where)
    k = proposal.get("speculative_tokens")
    if k is None:
        raise ConfigError(f"{where}: the proposal method has no speculative_tokens")
    check_draft_length(k, f"{where}: speculators_config.proposal_methods[].speculative_tokens")
    speculative = {
        **SPECULATORS_METHODS[kind],
        "model": str(model_dir),
        "num_speculative_tokens": k,
    }
    return SpeculatorsCheckpoint(
        path=Path(model_dir), verifier=str(verifier), speculative=speculative
    )


def _chosen_proposal(body: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The proposal named by `default_proposal_method`, else the first one listed."""
    proposals = body.get("proposal_methods") or []
    if not proposals or not all(isinstance(p, Mapping) for p in proposals):
        raise ConfigError(f"{where}: speculators_config.proposal_methods is empty or malformed")
    wanted = body.get("default_proposal_method")
    for proposal in proposals:
        if wanted is not None and proposal.get("proposal_type") == wanted:
            return proposal
    return proposals[0]
