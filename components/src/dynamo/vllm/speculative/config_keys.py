"""Key-level rules every speculative config source shares: draft-length check, key spelling,
and the collector that refuses one vLLM key set twice to different values.

They are separate because the engine-file translation (`config_sources`), the TensorRT-LLM
translation (`trtllm_translation`) and the speculators-checkpoint reader
(`speculators_checkpoint`) all apply them; living below all three keeps those modules free
of import cycles and gives each rule one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynamo.runtime.cli import ConfigError


def check_draft_length(value: Any, where: str) -> None:
    """A draft length (`num_speculative_tokens` under any spelling) must be a positive
    integer. vLLM refuses 0 and negatives too, but only while building the engine, with a
    traceback; here the message names the source and the key as the user wrote them."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}")


def normalize_keys(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Keys as vLLM spells them: `num-speculative-tokens` and `num_speculative_tokens` are one."""
    return {str(key).replace("-", "_"): value for key, value in spec.items()}


class KeyCollector:
    """Gathers translated keys and refuses two different values for one vLLM key.

    Two spellings of one setting in one file (`max_seq_len: 4096` next to
    `max_model_len: 2048`) mean the file contradicts itself; guessing which one the user
    meant would silently change the engine, so it is an error.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}

    def put(self, key: str, value: Any, written_as: str) -> None:
        """Record `key` (as the user wrote it: `written_as`); a different earlier value is an
        error, and draft lengths are checked as they arrive so the message names the key."""
        if key == "num_speculative_tokens":
            check_draft_length(value, f"{self.where}: {written_as}")
        if key in self.values and self.values[key] != value:
            raise ConfigError(
                f"{self.where}: {self.origin[key]}={self.values[key]!r} contradicts "
                f"{written_as}={value!r} (both set vLLM's {key})"
            )
        self.values[key] = value
        self.origin.setdefault(key, written_as)
