"""A worker's role in disaggregated serving, read the same way by every backend.

`--disaggregation-mode agg|prefill|decode`, with `--is-prefill-worker` and
`--is-decode-worker` as aliases, decides what a worker registers as: the `worker_type` on
its model card (the frontend pairs prefill and decode endpoints by it), the component it
registers under by default (prefill workers apart, under `prefill`), and its default
migration limit (0 for prefill: its one-token leg is never migrated; a lost prefill falls
back to local prefill on the decode worker). The vLLM worker and the mocker declare the
flags with their own help texts and read them with these functions.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, Literal

from dynamo.llm.protocols import WorkerType
from dynamo.llm.worker.backend import DEFAULT_MIGRATION_LIMIT
from dynamo.runtime.cli import ConfigError

DisaggregationMode = Literal["agg", "prefill", "decode"]
DEFAULT_COMPONENT = "backend"
PREFILL_COMPONENT = "prefill"

WORKER_TYPES: dict[DisaggregationMode, WorkerType] = {
    "agg": WorkerType.AGGREGATED,
    "prefill": WorkerType.PREFILL,
    "decode": WorkerType.DECODE,
}
"""`--disaggregation-mode` -> what the model card advertises."""


def disaggregation_mode_of(parsed: argparse.Namespace | Mapping[str, Any]) -> DisaggregationMode:
    """`--disaggregation-mode`, with `--is-prefill-worker`/`--is-decode-worker` as aliases;
    ConfigError when they contradict each other."""
    values = vars(parsed) if isinstance(parsed, argparse.Namespace) else parsed
    prefill, decode, mode = (
        values["is_prefill_worker"],
        values["is_decode_worker"],
        values["disaggregation_mode"],
    )
    if prefill and decode:
        raise ConfigError("--is-prefill-worker and --is-decode-worker are mutually exclusive")
    alias = "prefill" if prefill else "decode" if decode else None
    if alias and mode and mode != alias:
        raise ConfigError(f"--is-{alias}-worker contradicts --disaggregation-mode {mode}")
    return alias or mode or "agg"


def component_for(mode: DisaggregationMode, given: str | None) -> str:
    """`--component` as given, else the role's: prefill workers register apart."""
    if given:
        return given
    return PREFILL_COMPONENT if mode == "prefill" else DEFAULT_COMPONENT


def migration_limit_for(mode: DisaggregationMode, given: int | None) -> int:
    """`--migration-limit` as given, else the role's default (0 for a prefill worker)."""
    if given is not None:
        return given
    return 0 if mode == "prefill" else DEFAULT_MIGRATION_LIMIT
