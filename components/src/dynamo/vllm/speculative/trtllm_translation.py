"""TensorRT-LLM speculative-decoding keys and their translation into vLLM 0.32's terms.

Holds the TensorRT-LLM spellings (top-level, `kv_cache_config`, draft checkpoint keys) and
the per-`decoding_type` translation of a `speculative_config`, including the
`draft_len_schedule` -> dynamic-schedule conversion. It is separate from `config_sources`
because it is one self-contained vocabulary (one translator per TensorRT-LLM decoding
type) that only changes when TensorRT-LLM's format does; the engine-file reader just
dispatches to it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dynamo.runtime.cli import ConfigError
from dynamo.vllm.speculative.config_keys import KeyCollector
from dynamo.vllm.speculative.speculators_checkpoint import detect_eagle_method

TRT_TOP_LEVEL_RENAMES: dict[str, str] = {
    "max_batch_size": "max_num_seqs",
    "max_num_tokens": "max_num_batched_tokens",
    "max_seq_len": "max_model_len",
}
"""TensorRT-LLM top-level keys with a vLLM equivalent under another name. Keys spelled the
same in both (`tensor_parallel_size`, `pipeline_parallel_size`, `trust_remote_code`,
`enable_chunked_prefill`, ...) need no entry: they are AsyncEngineArgs fields already."""

TRT_KV_CACHE_RENAMES: dict[str, str] = {
    "free_gpu_memory_fraction": "gpu_memory_utilization",
    "enable_block_reuse": "enable_prefix_caching",
    "dtype": "kv_cache_dtype",
}
"""`kv_cache_config.<key>` -> AsyncEngineArgs field."""

TRT_MODEL_KEYS = ("speculative_model_dir", "speculative_model", "pytorch_weights_path")
"""Spellings TensorRT-LLM versions used for the draft checkpoint; all mean vLLM's `model`."""

EAGLE_INFORMATIONAL_KEYS = frozenset({"eagle3_one_model"})
"""Read and accepted without a warning: vLLM always runs the drafter inside the target's
engine, so one-model vs two-model is TensorRT-LLM's implementation detail, not a choice."""

DecodingType = Literal["eagle", "eagle3", "mtp", "ngram", "drafttarget"]
SUPPORTED_DECODING_TYPES: tuple[str, ...] = ("Eagle", "Eagle3", "MTP", "NGram", "DraftTarget")

MTP_DEFAULT_LAYERS = 1
"""TensorRT-LLM's default `num_nextn_predict_layers`, used when an MTP config names none."""


@dataclass
class TranslatedSpeculative:
    """A TensorRT-LLM `speculative_config` in vLLM's terms."""

    values: dict[str, Any]
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_COMMON_TRT_SPEC_KEYS = frozenset(
    {"decoding_type", "max_draft_len", "max_concurrency", "draft_len_schedule", *TRT_MODEL_KEYS}
)


def decoding_type_of(spec: Mapping[str, Any]) -> DecodingType:
    """The normalised TensorRT-LLM `decoding_type`; unknown ones are a ConfigError, never a
    silent fallback to some other method."""
    raw = spec.get("decoding_type")
    name = str(raw).lower().replace("_", "").replace("-", "")
    if name not in ("eagle", "eagle3", "mtp", "ngram", "drafttarget"):
        raise ConfigError(
            f"speculative_config.decoding_type {raw!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_DECODING_TYPES)}"
        )
    return name  # type: ignore[return-value]


def translate_trtllm_speculative(
    spec: Mapping[str, Any],
    *,
    speculative_fields: Collection[str] = (),
    where: str = "--extra-engine-args",
) -> TranslatedSpeculative:
    """Translate a TensorRT-LLM `speculative_config` (with `decoding_type`) to vLLM's.

    vLLM keys written directly in the mapping (`num_speculative_tokens`, ...) are accepted
    too, but must agree with their TensorRT-LLM spelling.
    """
    decoding = decoding_type_of(spec)
    collected = KeyCollector(f"{where} speculative_config")
    notes: list[str] = []
    handled = set(_COMMON_TRT_SPEC_KEYS)
    if decoding == "ngram":
        handled -= set(TRT_MODEL_KEYS)  # a draft checkpoint means nothing to n-gram: warned
    else:
        _put_model(spec, collected)
    if "max_draft_len" in spec:
        collected.put("num_speculative_tokens", spec["max_draft_len"], "max_draft_len")
    handled |= _TYPE_TRANSLATORS[decoding](spec, collected, notes)
    _put_schedule(spec, collected)
    ignored: list[str] = []
    for key, value in spec.items():
        if key in handled:
            continue
        native = str(key).replace("-", "_")
        if native in speculative_fields and native not in (
            "target_model_config",
            "draft_model_config",
        ):
            collected.put(native, value, str(key))
        else:
            ignored.append(str(key))
    return TranslatedSpeculative(values=collected.values, ignored=ignored, notes=notes)


def _put_model(spec: Mapping[str, Any], collected: KeyCollector) -> None:
    for key in TRT_MODEL_KEYS:
        if spec.get(key) is not None:
            collected.put("model", str(spec[key]), key)


def _translate_eagle(
    spec: Mapping[str, Any], collected: KeyCollector, notes: list[str]
) -> set[str]:
    """Eagle -> `eagle` or `eagle3`, decided by the draft checkpoint, because TensorRT-LLM
    uses `decoding_type: Eagle` for both generations while vLLM needs to know which."""
    model = collected.values.get("model")
    if model is None:
        raise ConfigError(
            "speculative_config: decoding_type Eagle needs the draft checkpoint "
            f"({' / '.join(TRT_MODEL_KEYS)})"
        )
    method, reason = detect_eagle_method(model)
    collected.put("method", method, "decoding_type")
    notes.append(f"decoding_type Eagle -> method {method}: {reason}")
    return set(EAGLE_INFORMATIONAL_KEYS)


def _translate_eagle3(
    spec: Mapping[str, Any], collected: KeyCollector, notes: list[str]
) -> set[str]:
    if collected.values.get("model") is None:
        raise ConfigError("speculative_config: decoding_type Eagle3 needs the draft checkpoint")
    collected.put("method", "eagle3", "decoding_type")
    return set(EAGLE_INFORMATIONAL_KEYS)


def _translate_mtp(spec: Mapping[str, Any], collected: KeyCollector, notes: list[str]) -> set[str]:
    """MTP -> vLLM's native `mtp` (the target's own next-token-prediction layers). Never
    n-gram: a silent fallback would serve a different algorithm than the user asked for."""
    collected.put("method", "mtp", "decoding_type")
    layers = spec.get("num_nextn_predict_layers")
    if layers is not None:
        collected.put("num_speculative_tokens", layers, "num_nextn_predict_layers")
    elif "num_speculative_tokens" not in collected.values and "num_speculative_tokens" not in spec:
        collected.put(
            "num_speculative_tokens", MTP_DEFAULT_LAYERS, "num_nextn_predict_layers (default)"
        )
        notes.append(
            f"decoding_type MTP without num_nextn_predict_layers: using {MTP_DEFAULT_LAYERS}"
        )
    return {"num_nextn_predict_layers"}


def _translate_ngram(
    spec: Mapping[str, Any], collected: KeyCollector, notes: list[str]
) -> set[str]:
    """NGram -> `ngram`. TensorRT-LLM matches suffixes of every length up to
    `max_matching_ngram_size`, so the vLLM window is [1, max_matching_ngram_size]."""
    collected.put("method", "ngram", "decoding_type")
    if spec.get("prompt_lookup_num_tokens") is not None:  # older TensorRT-LLM spelling
        collected.put(
            "num_speculative_tokens", spec["prompt_lookup_num_tokens"], "prompt_lookup_num_tokens"
        )
    size = spec.get("max_matching_ngram_size")
    if size is not None:
        collected.put("prompt_lookup_max", size, "max_matching_ngram_size")
        if "prompt_lookup_min" not in spec:
            collected.put("prompt_lookup_min", 1, "max_matching_ngram_size (window from 1)")
    if "num_speculative_tokens" not in collected.values and "num_speculative_tokens" not in spec:
        raise ConfigError("speculative_config: decoding_type NGram needs max_draft_len")
    return {"max_matching_ngram_size", "prompt_lookup_num_tokens"}


def _translate_draft_target(
    spec: Mapping[str, Any], collected: KeyCollector, notes: list[str]
) -> set[str]:
    if collected.values.get("model") is None:
        raise ConfigError(
            "speculative_config: decoding_type DraftTarget needs speculative_model_dir"
        )
    collected.put("method", "draft_model", "decoding_type")
    return set()


_TYPE_TRANSLATORS = {
    "eagle": _translate_eagle,
    "eagle3": _translate_eagle3,
    "mtp": _translate_mtp,
    "ngram": _translate_ngram,
    "drafttarget": _translate_draft_target,
}


def _put_schedule(spec: Mapping[str, Any], collected: KeyCollector) -> None:
    """`draft_len_schedule` / `max_concurrency` -> vLLM's dynamic `num_speculative_tokens_per_batch_size`."""
    thresholds = spec.get("draft_len_schedule")
    limit = spec.get("max_concurrency")
    if thresholds is None and limit is None:
        return
    k = collected.values.get("num_speculative_tokens")
    if k is None:
        raise ConfigError(
            "speculative_config: draft_len_schedule/max_concurrency need max_draft_len"
        )
    schedule = schedule_from_thresholds(thresholds or {1: k}, max_concurrency=limit)
    written = "draft_len_schedule" if thresholds is not None else "max_concurrency"
    collected.put("num_speculative_tokens_per_batch_size", schedule, written)


def schedule_from_thresholds(
    thresholds: Mapping[Any, Any], *, max_concurrency: int | None = None
) -> list[list[int]]:
    """TensorRT-LLM's `{batch_size_from: draft_len}` as vLLM's inclusive `[[lo, hi, K], ...]`.

    `max_concurrency: C` means "no speculation above C concurrent requests", i.e. K=0 from
    batch size C+1 on. vLLM carries the last range's K up to `max_num_seqs`.
    """
    try:
        steps = {int(bs): int(k) for bs, k in thresholds.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"draft_len_schedule must map batch sizes to draft lengths, got {thresholds!r}"
        ) from exc
    if max_concurrency is not None:
        limit = int(max_concurrency)
        steps = {bs: k for bs, k in steps.items() if bs <= limit}
        steps[limit + 1] = 0
    starts = sorted(steps)
    if not starts or starts[0] != 1:
        raise ConfigError(f"draft_len_schedule must start at batch size 1, got {sorted(steps)}")
    ranges = []
    for i, start in enumerate(starts):
        end = starts[i + 1] - 1 if i + 1 < len(starts) else start
        ranges.append([start, end, steps[start]])
    return ranges
