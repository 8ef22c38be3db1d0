"""Speculative-decoding configuration sources, translated into vLLM 0.32's own terms.

Users bring speculative decoding configs in three shapes: a TensorRT-LLM
`--extra-engine-args` YAML (the same file the TensorRT-LLM backend takes), a native vLLM
YAML/JSON, or a speculators-format checkpoint passed as `--model`. This module turns each of
them into plain data: AsyncEngineArgs field names and a native `speculative_config` dict, and
merges the speculative layers with the precedence of docs/speculative_decoding.md.

It imports nothing from vLLM on purpose: the rules here are the contract users rely on, and
keeping them pure makes every rule testable in milliseconds. The callers (`config.layers`,
`config.speculative_resolution`) supply what only vLLM knows (its field names) and do the typing
through vLLM's own parser.

The TensorRT-LLM vocabulary lives in `trtllm_translation`, checkpoint reading in
`speculators_checkpoint`, and the key-level rules they share in `config_keys`; this module
reads engine files, dispatches to those, and merges and checks the result.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dynamo.runtime.cli import ConfigError
from dynamo.vllm.speculative.config_keys import KeyCollector, check_draft_length, normalize_keys
from dynamo.vllm.speculative.trtllm_translation import (
    TRT_KV_CACHE_RENAMES,
    TRT_TOP_LEVEL_RENAMES,
    translate_trtllm_speculative,
)

METHODS_NEEDING_A_DRAFT = frozenset(
    {"eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash"}
)
"""vLLM methods whose proposer is a separate checkpoint (`model` must be given). `mtp` and
`dspark` default to the target's own weights; n-gram and suffix need no weights at all."""


# --------------------------------------------------------------------------- engine files


@dataclass
class EngineFileConfig:
    """One `--extra-engine-args` file after translation, still untyped (YAML scalars)."""

    form: Literal["native", "tensorrt-llm"]
    engine: dict[str, Any]
    """AsyncEngineArgs field -> value, without `speculative_config`."""
    speculative: dict[str, Any] | None
    """Native vLLM speculative config, or None when the file configures no speculation."""
    ignored: list[str] = field(default_factory=list)
    """Dotted keys with no vLLM meaning; the caller warns about them once, in one line."""
    origin: dict[str, str] = field(default_factory=dict)
    """Native key -> the key the user wrote (for messages and provenance)."""
    notes: list[str] = field(default_factory=list)
    """Decisions worth one INFO line each (e.g. why Eagle became eagle3)."""


def load_engine_file(path: str | Path) -> dict[str, Any]:
    """Read an `--extra-engine-args` YAML file; anything but a mapping is a ConfigError."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--extra-engine-args {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--extra-engine-args {path}: not valid YAML ({_yaml_problem(exc)})"
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--extra-engine-args {path}: expected a mapping of keys, got {type(data).__name__}"
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: what is wrong, and where."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def is_trtllm_form(raw: Mapping[str, Any]) -> bool:
    """Whether a file uses TensorRT-LLM spellings (decides nothing, only how it is reported)."""
    spec = raw.get("speculative_config")
    if isinstance(spec, Mapping) and "decoding_type" in spec:
        return True
    return any(key in raw for key in (*TRT_TOP_LEVEL_RENAMES, "kv_cache_config"))


def translate_engine_config(
    raw: Mapping[str, Any],
    engine_fields: Collection[str],
    *,
    speculative_fields: Collection[str] = (),
    where: str = "--extra-engine-args",
) -> EngineFileConfig:
    """Translate one engine file (native vLLM form, TensorRT-LLM form, or a mix).

    Every key is either a vLLM AsyncEngineArgs field (kept), a TensorRT-LLM key with a vLLM
    equivalent (renamed), or a key vLLM has no meaning for (reported in `ignored`).
    """
    collected = KeyCollector(where)
    ignored: list[str] = []
    notes: list[str] = []
    speculative: dict[str, Any] | None = None
    for key, value in raw.items():
        key = str(key).replace("-", "_")
        if key == "speculative_config":
            speculative = _translate_file_speculative(
                value, speculative_fields, where, ignored, notes
            )
        elif key in TRT_TOP_LEVEL_RENAMES:
            collected.put(TRT_TOP_LEVEL_RENAMES[key], value, key)
        elif key == "kv_cache_config":
            _translate_kv_cache_config(value, collected, ignored, where)
        elif key in engine_fields:
            collected.put(key, value, key)
        else:
            ignored.append(key)
    return EngineFileConfig(
        form="tensorrt-llm" if is_trtllm_form(raw) else "native",
        engine=collected.values,
        speculative=speculative,
        ignored=ignored,
        origin=collected.origin,
        notes=notes,
    )


def _translate_kv_cache_config(
    value: Any, collected: KeyCollector, ignored: list[str], where: str
) -> None:
    """`kv_cache_config` sub-keys: the ones vLLM has an engine flag for are renamed."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: kv_cache_config must be a mapping, got {value!r}")
    for sub_key, sub_value in value.items():
        written = f"kv_cache_config.{sub_key}"
        if sub_key in TRT_KV_CACHE_RENAMES:
            collected.put(TRT_KV_CACHE_RENAMES[sub_key], sub_value, written)
        else:
            ignored.append(written)


def _translate_file_speculative(
    value: Any,
    speculative_fields: Collection[str],
    where: str,
    ignored: list[str],
    notes: list[str],
) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: speculative_config must be a mapping, got {value!r}")
    if "decoding_type" not in value:
        native = normalize_keys(value)
        if "num_speculative_tokens" in native:
            check_draft_length(
                native["num_speculative_tokens"],
                f"{where}: speculative_config.num_speculative_tokens",
            )
        return native
    translated = translate_trtllm_speculative(
        value, speculative_fields=speculative_fields, where=where
    )
    ignored.extend(f"speculative_config.{key}" for key in translated.ignored)
    notes.extend(translated.notes)
    return translated.values


# --------------------------------------------------------------------------- merging


@dataclass
class MergedSpeculative:
    """The speculative config after all sources, with where each key came from."""

    values: dict[str, Any] | None
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def merge_speculative_layers(
    layers: Sequence[tuple[str, Mapping[str, Any] | None]],
) -> MergedSpeculative:
    """Merge speculative configs, lowest precedence first, key by key.

    A layer that names a different `method` replaces everything below it: the keys of an
    Eagle config (draft model, ...) mean nothing to n-gram and must not leak into it.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    for source, layer in layers:
        if not layer:
            continue
        layer = normalize_keys(layer)
        method = layer.get("method")
        if method is not None and values.get("method") not in (None, method):
            notes.append(
                f"{source} sets method {method}: the {values['method']} settings below it are dropped"
            )
            values, sources = {}, {}
        for key, value in layer.items():
            values[key] = value
            sources[key] = source
    return MergedSpeculative(values=values or None, sources=sources, notes=notes)


def check_speculative(
    spec: Mapping[str, Any],
    *,
    allowed_keys: Collection[str],
    allowed_methods: Collection[str],
) -> None:
    """Reject what vLLM would reject only after loading weights (unknown keys and methods,
    a model-based method without a model), so a bad config fails in a dry run."""
    unknown = sorted(set(spec) - set(allowed_keys))
    if unknown:
        raise ConfigError(
            f"speculative_config: unknown keys {', '.join(unknown)} (vLLM 0.32 SpeculativeConfig has no such fields)"
        )
    method = spec.get("method")
    if method is not None and method not in allowed_methods:
        raise ConfigError(
            f"speculative_config.method {method!r} is not a vLLM 0.32 method; choose one of {', '.join(sorted(allowed_methods))}"
        )
    if method is None and spec.get("model") is None:
        raise ConfigError("speculative_config needs a method (or a draft model to detect it from)")
    if method in METHODS_NEEDING_A_DRAFT and not spec.get("model"):
        raise ConfigError(
            f"speculative_config: method {method} needs a draft checkpoint in `model`"
        )


def fill_k_from_schedule(spec: dict[str, Any]) -> str | None:
    """With a dynamic schedule and no `num_speculative_tokens`, K is the schedule's largest
    (vLLM caps every scheduled K at `num_speculative_tokens`, so it must be at least that).
    Returns a note when it changed or noticed something, else None."""
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if not schedule:
        return None
    try:
        largest = max(int(entry[2]) for entry in schedule)
    except (TypeError, ValueError, IndexError) as exc:
        raise ConfigError(
            f"num_speculative_tokens_per_batch_size must be [[lo, hi, K], ...], got {schedule!r}"
        ) from exc
    k = spec.get("num_speculative_tokens")
    if k is None:
        spec["num_speculative_tokens"] = largest
        return f"num_speculative_tokens set to {largest}, the largest K of the dynamic schedule"
    if largest > int(k):
        return f"dynamic schedule asks for K={largest} but num_speculative_tokens={k} caps it"
    return None
