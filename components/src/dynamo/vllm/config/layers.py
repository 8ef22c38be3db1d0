"""The merge of engine settings from their sources, lowest first: vLLM defaults, the
`--extra-engine-args` file, the command line.

The file layer is typed by feeding its keys through the worker's own parser, so
`max_model_len: 4k` in YAML means what `--max-model-len 4k` means. Every merged key keeps
a source label (`SRC_*`), shown in logs and in the dry run's `sources:` section.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs

from dynamo.runtime.cli import ConfigError
from dynamo.vllm.config.parser import explicit_values, worker_dests
from dynamo.vllm.speculative import config_sources as sc
from dynamo.vllm.speculative.config_keys import check_draft_length, normalize_keys

log = logging.getLogger("dynamo.vllm")

# Sources, as they appear in logs and in the dry-run's `sources:` section.
SRC_VLLM = "vllm default"
SRC_WORKER = "worker default"
SRC_CLI = "cli"
SRC_FILE = "extra-engine-args"
SRC_JSON = "--speculative-config"
SRC_SPEC_FLAGS = "--spec-method/--spec-model/--spec-tokens"
SRC_SPECULATORS = "speculators checkpoint"
SRC_PROFILE = "--speculation-profile"

_SPEC_FLAGS = {
    "spec_method": "method",
    "spec_model": "model",
    "spec_tokens": "num_speculative_tokens",
}
"""vLLM's shorthand flags for the speculative config; folded into it here so the
precedence holds (vLLM itself would refuse them next to `--speculative-config`)."""

_INTERNAL_SPEC_FIELDS = frozenset(
    {"target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
)


@functools.cache
def speculative_fields() -> frozenset[str]:
    """The SpeculativeConfig keys a user may set (vLLM fills the internal ones itself)."""
    from vllm.config.speculative import SpeculativeConfig

    return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)) - _INTERNAL_SPEC_FIELDS


@dataclasses.dataclass
class ConfigLayers:
    """What each source contributes, before merging."""

    defaults: dict[str, Any]
    file: sc.EngineFileConfig | None
    file_values: dict[str, Any]
    file_spec: dict[str, Any] | None
    cli_values: dict[str, Any]
    cli_spec_json: dict[str, Any] | None
    cli_spec_flags: dict[str, Any] | None


def collect_layers(
    parser: argparse.ArgumentParser, full: Mapping[str, Any], given: Mapping[str, Any]
) -> ConfigLayers:
    """Split the sources: vLLM defaults, the engine file, and what the command line gave."""
    engine_fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    path = full["extra_engine_args"]
    file_cfg = _read_file_layer(path, engine_fields, speculative_fields())
    file_values, file_spec = _typed_file_values(parser, file_cfg, path)
    worker_flags = worker_dests(parser)
    cli_values = {k: v for k, v in given.items() if k not in worker_flags}
    cli_spec_json = _cli_speculative_json(cli_values.pop("speculative_config", None))
    return ConfigLayers(
        defaults={k: v for k, v in vars(parser.parse_args([])).items() if k in engine_fields},
        file=file_cfg,
        file_values=file_values,
        file_spec=file_spec,
        cli_values=cli_values,
        cli_spec_json=cli_spec_json,
        cli_spec_flags=_pop_spec_flags(cli_values),
    )


def _read_file_layer(
    path: str | None, engine_fields: set[str], spec_fields: frozenset[str]
) -> sc.EngineFileConfig | None:
    if not path:
        return None
    translated = sc.translate_engine_config(
        sc.load_engine_file(path),
        engine_fields,
        speculative_fields=spec_fields,
        where=f"--extra-engine-args {path}",
    )
    log.info("--extra-engine-args %s: %s form", path, translated.form)
    for note in translated.notes:
        log.info("--extra-engine-args %s: %s", path, note)
    return translated


def _typed_file_values(
    parser: argparse.ArgumentParser, file_cfg: sc.EngineFileConfig | None, path: str | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The file's engine keys typed by vLLM's own parser, and its speculative layer (with
    any `spec_method`/`spec_model`/`spec_tokens` keys folded into it)."""
    if file_cfg is None:
        return {}, None
    by_dest = {action.dest: action for action in parser._actions}
    raw = dict(file_cfg.engine)
    untyped = {k: raw.pop(k) for k in list(raw) if k not in by_dest}
    try:
        typed = explicit_values(parser, _as_cli_tokens(by_dest, raw))
    except ConfigError as exc:
        raise ConfigError(f"--extra-engine-args {path}: {exc}") from exc
    typed.update(untyped)
    spec = dict(file_cfg.speculative) if file_cfg.speculative else None
    for flag_key, spec_key in _SPEC_FLAGS.items():
        value = typed.pop(flag_key, None)
        if value is None:
            continue
        if spec_key == "num_speculative_tokens":
            check_draft_length(value, f"--extra-engine-args {path}: {flag_key}")
        spec = spec or {}
        if spec.get(spec_key, value) != value:
            raise ConfigError(
                f"--extra-engine-args {path}: {flag_key}={value!r} contradicts speculative_config.{spec_key}"
            )
        spec[spec_key] = value
    return typed, spec


def _as_cli_tokens(by_dest: Mapping[str, argparse.Action], values: Mapping[str, Any]) -> list[str]:
    """File values as the command-line tokens that would set them (`None` = not set)."""
    tokens: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        action = by_dest[key]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            tokens.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            if value:
                tokens.append(flag)
        elif action.nargs in ("+", "*") and isinstance(value, list):
            tokens += [flag, *(_token(item) for item in value)]
        else:
            tokens.append(f"{flag}={_token(value)}")
    return tokens


def _token(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value)
    return str(value)


def _cli_speculative_json(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {value!r}")
    value = normalize_keys(value)
    if "num_speculative_tokens" in value:
        check_draft_length(
            value["num_speculative_tokens"], "--speculative-config: num_speculative_tokens"
        )
    return value


def _pop_spec_flags(cli_values: dict[str, Any]) -> dict[str, Any] | None:
    layer = {
        spec_key: cli_values.pop(flag)
        for flag, spec_key in _SPEC_FLAGS.items()
        if flag in cli_values
    }
    layer = {k: v for k, v in layer.items() if v is not None}
    if "num_speculative_tokens" in layer:
        check_draft_length(layer["num_speculative_tokens"], "--spec-tokens")
    return layer or None


def merge_engine_values(layers: ConfigLayers) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM defaults < file < command line, with the source of every key."""
    values = dict(layers.defaults)
    sources = dict.fromkeys(values, SRC_VLLM)
    file_values, file_cfg = layers.file_values, layers.file
    for key, value in file_values.items():
        values[key] = value
        written = file_cfg.origin.get(key, key) if file_cfg else key
        sources[key] = SRC_FILE if written == key else f"{SRC_FILE} ({written})"
    overridden = []
    for key, value in layers.cli_values.items():
        if key in file_values and file_values[key] != value:
            overridden.append(f"{key} ({file_values[key]!r} -> {value!r})")
        values[key] = value
        sources[key] = SRC_CLI
    if overridden:
        log.info("command line overrides --extra-engine-args: %s", ", ".join(overridden))
    for key in _SPEC_FLAGS:
        values[key] = None  # folded into speculative_config
    return values, sources
