"""The model's sampling defaults (`generation_config.json`), as the worker advertises them.

`vllm serve` gives every sampling field a request leaves unset the value of the model's
`generation_config.json` (`--generation-config auto`, the default), of another directory's
(`--generation-config DIR`), or none (`--generation-config vllm`); `--override-generation-config`
adds to or replaces those values. The worker reads the same values through vLLM's own
`ModelConfig.get_diff_sampling_param()` (so the set of fields and the `max_new_tokens` ->
`max_tokens` rename are vLLM's), and puts them on its model card as `SamplingDefaults`, so
the frontend, which builds the request, applies them where the client is silent.

This module turns vLLM's untyped dict into the typed card struct, and checks the flag's
value before weights load: vLLM silently serves with no defaults when the directory lacks
the file, and would try a model hub for a name that is not a directory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from dynamo.llm.protocols import SamplingDefaults
from dynamo.runtime.cli import ConfigError

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
KEYWORDS = ("auto", "vllm")
"""`--generation-config` values that are not a directory (vLLM's own)."""


def check_generation_config(value: str | None) -> None:
    """Raise ConfigError unless `value` is `auto`, `vllm` or a directory holding
    generation_config.json (what vLLM's `--generation-config` accepts)."""
    if value is None or value in KEYWORDS:
        return
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"--generation-config {value!r}: not a directory (give `auto` to read the "
            "model's generation_config.json, `vllm` for vLLM's neutral defaults, or the "
            "directory that holds a generation_config.json)"
        )
    if not (path / GENERATION_CONFIG_FILE).is_file():
        raise ConfigError(f"--generation-config {value!r}: no {GENERATION_CONFIG_FILE} in it")


def sampling_defaults_from(diff: Mapping[str, Any]) -> SamplingDefaults | None:
    """vLLM's `get_diff_sampling_param()` dict as the card's struct (None when empty).

    A value of the wrong type (a hand-edited generation_config.json) is dropped with a
    warning rather than stopping the worker: the engine then uses its own default for it.
    """
    fields: dict[str, Any] = {}
    for name in SamplingDefaults.__struct_fields__:
        value = diff.get(name)
        if value is None:
            continue
        try:
            msgspec.convert({name: value}, SamplingDefaults, strict=False)
        except msgspec.ValidationError as exc:
            log.warning("ignoring the model's default %s=%r: %s", name, value, exc)
            continue
        fields[name] = value
    if not fields:
        return None
    defaults = msgspec.convert(fields, SamplingDefaults, strict=False)
    log.info(
        "sampling defaults for fields a request leaves unset: %s",
        " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(defaults).items() if v is not None),
    )
    return defaults
