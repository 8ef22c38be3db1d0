"""Speculative-decoding configuration sources, translated into vLLM 0.32's own terms.

Users bring speculative decoding configs in three shapes: a TensorRT-LLM
`--extra-engine-args` YAML (the same file the TensorRT-LLM backend takes), a native vLLM
YAML/JSON, or a speculators-format checkpoint passed as `--model`. This module turns each of
them into plain data: AsyncEngineArgs field names and a native `speculative_config` dict, and
merges the speculative layers with the precedence of docs/speculative_decoding.md.

It imports nothing from vLLM on purpose: the rules here are the contract users rely on, and
keeping them pure makes every rule testable in milliseconds. The callers (`config_layers`,
`speculative_resolution`) supply what only vLLM knows (its field names) and do the typing
through vLLM's own parser.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dynamo.runtime.cli import ConfigError


def check_draft_length(value: Any, where: str) -> None:
    """A draft length (`num_speculative_tokens` under any spelling) must be a positive
    integer. vLLM refuses 0 and negatives too, but only while building the engine, with a
    traceback; here the message names the source and the key as the user wrote them."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- TensorRT-LLM keys

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

METHODS_NEEDING_A_DRAFT = frozenset(
    {"eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash"}
)
"""vLLM methods whose proposer is a separate checkpoint (`model` must be given). `mtp` and
`dspark` default to the target's own weights; n-gram and suffix need no weights at all."""

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


class _Collector:
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
        if key == "num_speculative_tokens":
            check_draft_length(value, f"{self.where}: {written_as}")
        if key in self.values and self.values[key] != value:
            raise ConfigError(
                f"{self.where}: {self.origin[key]}={self.values[key]!r} contradicts "
                f"{written_as}={value!r} (both set vLLM's {key})"
            )
        self.values[key] = value
        self.origin.setdefault(key, written_as)


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
    collected = _Collector(where)
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
    value: Any, collected: _Collector, ignored: list[str], where: str
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


# --------------------------------------------------------------------------- speculative_config


@dataclass
class TranslatedSpeculative:
    """A TensorRT-LLM `speculative_config` in vLLM's terms."""

    values: dict[str, Any]
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_COMMON_TRT_SPEC_KEYS = frozenset(
    {"decoding_type", "max_draft_len", "max_concurrency", "draft_len_schedule", *TRT_MODEL_KEYS}
)


def normalize_keys(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Keys as vLLM spells them: `num-speculative-tokens` and `num_speculative_tokens` are one."""
    return {str(key).replace("-", "_"): value for key, value in spec.items()}


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
    collected = _Collector(f"{where} speculative_config")
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


def _put_model(spec: Mapping[str, Any], collected: _Collector) -> None:
    for key in TRT_MODEL_KEYS:
        if spec.get(key) is not None:
            collected.put("model", str(spec[key]), key)


def _translate_eagle(spec: Mapping[str, Any], collected: _Collector, notes: list[str]) -> set[str]:
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


def _translate_eagle3(spec: Mapping[str, Any], collected: _Collector, notes: list[str]) -> set[str]:
    if collected.values.get("model") is None:
        raise ConfigError("speculative_config: decoding_type Eagle3 needs the draft checkpoint")
    collected.put("method", "eagle3", "decoding_type")
    return set(EAGLE_INFORMATIONAL_KEYS)


def _translate_mtp(spec: Mapping[str, Any], collected: _Collector, notes: list[str]) -> set[str]:
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


def _translate_ngram(spec: Mapping[str, Any], collected: _Collector, notes: list[str]) -> set[str]:
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
    spec: Mapping[str, Any], collected: _Collector, notes: list[str]
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


def _put_schedule(spec: Mapping[str, Any], collected: _Collector) -> None:
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


# --------------------------------------------------------------------------- checkpoints


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
