"""Merges the speculative-decoding sources into the one `speculative_config` vLLM gets.

Precedence, lowest first: speculators checkpoint (`--model`) < `--extra-engine-args` <
`--speculative-config` < `--spec-method/--spec-model/--spec-tokens` < `--speculation-profile`
(which sets only the batch-size -> K schedule, and only where no other source set one).
Engine-level flags (`--max-model-len`, `--tensor-parallel-size`, ...) apply to target and
draft: vLLM derives the draft's from the target's, so an explicit flag removes a draft-level
copy of itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from dynamo.llm.models import is_known_name
from dynamo.llm.speculation_profile import (
    ProfileError,
    SpeculationProfile,
    check_schedule_fits,
    load_profile,
    never_speculates,
)
from dynamo.runtime.cli import ConfigError
from dynamo.vllm.config.layers import (
    SRC_FILE,
    SRC_JSON,
    SRC_PROFILE,
    SRC_SPEC_FLAGS,
    SRC_SPECULATORS,
    ConfigLayers,
    speculative_fields,
)
from dynamo.vllm.config.model_resolution import resolve_model_dir
from dynamo.vllm.speculative import config_sources as sc
from dynamo.vllm.speculative.adaptive_k import SCHEDULER_CLS, AdaptationSettings, engine_config
from dynamo.vllm.speculative.config_keys import check_draft_length
from dynamo.vllm.speculative.free_k0 import SKIPPED_METHODS
from dynamo.vllm.speculative.k_in_force import new_state_path
from dynamo.vllm.speculative.opt_out import SCHEDULER_CLS as OPT_OUT_SCHEDULER_CLS
from dynamo.vllm.speculative.speculators_checkpoint import SpeculatorsCheckpoint

log = logging.getLogger("dynamo.vllm")

_DRAFT_TWINS = {
    "max_model_len": "max_model_len",
    "enforce_eager": "enforce_eager",
    "tensor_parallel_size": "draft_tensor_parallel_size",
}
"""Engine flag -> the speculative-config key that would set it for the draft only."""

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"

PREFIX_BLOCK_KEY = "disable_eagle_block_drop"
PREFIX_BLOCK_METHODS = frozenset({"eagle", "eagle3"})
"""Methods whose workers reuse the whole prefix-cache hit unless told otherwise
(`keep_whole_prefix_hit`)."""
SRC_PREFIX_DEFAULT = "dynamo default for Eagle: the whole prefix-cache hit is reused"

_NO_DRAFT_MODEL_METHODS = frozenset({"ngram", "ngram_gpu", "suffix", "extract_hidden_states"})
_K_REQUIRED_METHODS = frozenset({"ngram", "draft_model", "eagle", "eagle3"})


@functools.cache
def _speculative_methods() -> frozenset[str]:
    from vllm.config.speculative import SpeculativeMethod

    return frozenset(get_args(SpeculativeMethod))


def resolve_speculative(
    values: dict[str, Any],
    sources: dict[str, str],
    layers: ConfigLayers,
    checkpoint: SpeculatorsCheckpoint | None,
    *,
    dry_run: bool,
    profile: SpeculationProfile | None = None,
) -> None:
    """Merge the speculative layers (lowest first) into `values["speculative_config"]`, put
    the profile's schedule on top, and record a source per key."""
    merged = sc.merge_speculative_layers(
        [
            (SRC_SPECULATORS, checkpoint.speculative if checkpoint else None),
            (SRC_FILE, layers.file_spec),
            (SRC_JSON, layers.cli_spec_json),
            (SRC_SPEC_FLAGS, layers.cli_spec_flags),
        ]
    )
    if profile is not None:
        apply_profile(merged, profile, file_form=layers.file.form if layers.file else None)
    spec = _finish_speculative(merged, layers.cli_values, speculative_fields(), dry_run=dry_run)
    values["speculative_config"] = spec
    sources.pop("speculative_config", None)  # reported per key instead
    if spec is None:
        return
    if keep_whole_prefix_hit(spec):
        sources[f"speculative_config.{PREFIX_BLOCK_KEY}"] = SRC_PREFIX_DEFAULT
    for key, source in merged.sources.items():
        if key in spec:
            sources[f"speculative_config.{key}"] = source
    if "num_speculative_tokens" not in merged.sources and SCHEDULE_KEY in merged.sources:
        # `fill_k_from_schedule` derived K: say so, rather than leaving it without a source.
        sources["speculative_config.num_speculative_tokens"] = (
            f"largest K of the schedule ({merged.sources[SCHEDULE_KEY]})"
        )


# --------------------------------------------------------------------------- --speculation-profile


def load_speculation_profile(path: str | Path | None) -> SpeculationProfile | None:
    """Read `--speculation-profile`; a missing, garbled or inconsistent file is a
    ConfigError (exit 2 before anything loads), never a worker running some other K."""
    if not path:
        return None
    try:
        return load_profile(Path(path).expanduser())
    except ProfileError as exc:
        raise ConfigError(f"--speculation-profile: {exc}") from exc


def apply_profile(
    merged: sc.MergedSpeculative, profile: SpeculationProfile, *, file_form: str | None
) -> None:
    """Make the profile's schedule the top speculative layer. It sets only the schedule:
    the method, draft and K come from the other sources, and must be what was profiled,
    or the measured best K per batch size would describe some other engine."""
    spec = merged.values
    if spec is None or spec.get("method") is None:
        missing = "no speculation is configured" if spec is None else "no method is named"
        raise ConfigError(
            f"--speculation-profile needs a speculative method: {missing}, and the profile "
            f"was measured with method {profile.method}; configure it with --spec-method "
            f"{profile.method} (plus --spec-model for a draft model), --speculative-config "
            "or --extra-engine-args"
        )
    _refuse_second_schedule(merged, file_form)
    if never_speculates(profile.schedule):
        raise ConfigError(
            f"--speculation-profile: speculation never paid in this profile ({profile.method}"
            f" at batch sizes {profile.batch_sizes}, acceptance "
            f"{profile.acceptance_per_position}); its schedule is K=0 everywhere, so run the "
            "worker without speculation (or profile another drafter)"
        )
    if spec["method"] != profile.method:
        raise ConfigError(
            f"--speculation-profile was measured with method {profile.method}, but the "
            f"worker runs {spec['method']} (from {merged.sources.get('method', '?')}); "
            f"configure {profile.method} or profile {spec['method']} with "
            "`python -m dynamo.vllm.profile_spec`"
        )
    k_source = merged.sources.get("num_speculative_tokens", "?")
    try:
        check_schedule_fits(
            profile.schedule,
            spec.get("num_speculative_tokens"),
            f"--speculation-profile (num_speculative_tokens from {k_source})",
        )
    except ProfileError as exc:
        raise ConfigError(str(exc)) from exc
    spec[SCHEDULE_KEY] = [list(entry) for entry in profile.schedule]
    merged.sources[SCHEDULE_KEY] = SRC_PROFILE
    log.info(
        "speculative config: %s %s from --speculation-profile (%s, max batch size %d)",
        SCHEDULE_KEY,
        spec[SCHEDULE_KEY],
        profile.method,
        profile.max_batch_size,
    )


def _refuse_second_schedule(merged: sc.MergedSpeculative, file_form: str | None) -> None:
    """Two schedules cannot both win: overriding one silently would hide which K runs."""
    if merged.values is None or SCHEDULE_KEY not in merged.values:
        return
    source = merged.sources.get(SCHEDULE_KEY, "?")
    if source == SRC_FILE and file_form == "tensorrt-llm":
        source += " (TensorRT-LLM draft_len_schedule or max_concurrency, or the native key)"
    raise ConfigError(
        f"--speculation-profile sets {SCHEDULE_KEY}, but the speculative config already has "
        f"a schedule from {source}; remove one of the two"
    )


def _finish_speculative(
    merged: sc.MergedSpeculative,
    cli_values: Mapping[str, Any],
    spec_fields: frozenset[str],
    *,
    dry_run: bool,
) -> dict[str, Any] | None:
    """Apply engine flags to the draft, resolve the draft path, and check what a dry run
    can check without vLLM loading anything."""
    for note in merged.notes:
        log.info("speculative config: %s", note)
    spec = merged.values
    if spec is None:
        return None
    for engine_key, draft_key in _DRAFT_TWINS.items():
        if engine_key in cli_values and draft_key in spec:
            log.info(
                "speculative config: dropping %s=%r, the explicit --%s applies to the draft",
                draft_key,
                spec.pop(draft_key),
                engine_key.replace("_", "-"),
            )
    _resolve_draft_model(spec, merged.sources.get("model", "?"), dry_run=dry_run)
    note = sc.fill_k_from_schedule(spec)
    if note:
        log.info("speculative config: %s", note)
    if spec.get("num_speculative_tokens") is not None:
        source = merged.sources.get("num_speculative_tokens", "dynamic schedule")
        check_draft_length(
            spec["num_speculative_tokens"],
            f"speculative_config.num_speculative_tokens (from {source})",
        )
    sc.check_speculative(spec, allowed_keys=spec_fields, allowed_methods=_speculative_methods())
    if spec.get("method") in _K_REQUIRED_METHODS and spec.get("num_speculative_tokens") is None:
        raise ConfigError(
            f"speculative_config: method {spec['method']} needs num_speculative_tokens"
        )
    _check_schedule(spec)
    leading = [k for k in ("method", "model", "num_speculative_tokens") if k in spec]
    return {key: spec[key] for key in [*leading, *(k for k in spec if k not in leading)]}


def keep_whole_prefix_hit(spec: dict[str, Any]) -> bool:
    """For Eagle and Eagle3, unless a source set it, turn off vLLM's drop of the last
    block of each prefix-cache hit (`disable_eagle_block_drop`); True when it did.

    vLLM drops that block so that the drafter recomputes the one position whose KV was
    written with the next token of another request. The block is 32 tokens here, and with
    it every prompt shorter than two blocks lost its whole hit: a resent or shared chat
    prompt was prefilled again in full. Measured on the shipped Eagle3 head, reusing the
    block changes no acceptance (a shared system prompt: 1.511 with the drop, 1.513
    without; a resend of the same prompts: 1.694 both), and at 32 concurrent requests
    it brings the time to first token back to that of an engine without speculation
    (docs/speculative_decoding.md). The KV router, which predicts the whole hit, then
    predicts what the engine reuses."""
    if spec.get("method") not in PREFIX_BLOCK_METHODS or PREFIX_BLOCK_KEY in spec:
        return False
    spec[PREFIX_BLOCK_KEY] = True
    return True


def _resolve_draft_model(spec: dict[str, Any], source: str, *, dry_run: bool) -> None:
    """Embedded model names and local directories become absolute paths. A filesystem path
    that is no directory is an error on a real start (vLLM would fail only while building
    the engine, after trying the Hugging Face hub) and a warning in a dry run. Anything else
    (a hub id) is left for vLLM, which looks in the Hugging Face cache, with a warning, as
    nothing can be downloaded on these machines."""
    model = spec.get("model")
    if model is None or spec.get("method") in _NO_DRAFT_MODEL_METHODS:
        return
    name = str(model)
    path = Path(name).expanduser()
    if is_known_name(name) or path.is_dir():
        spec["model"] = str(resolve_model_dir(name, dry_run=dry_run, what="draft model"))
    elif _looks_like_path(name):
        problem = "is not a directory" if path.exists() else "does not exist"
        message = f"speculative_config.model (from {source}): {name} {problem}"
        if not dry_run:
            raise ConfigError(message)
        # A dry run shows what an example file resolves to before the draft is in place.
        log.warning("%s; a real start refuses it", message)
    else:
        log.warning("speculative config: draft model %s is not a local directory", name)


def _looks_like_path(name: str) -> bool:
    """A filesystem path rather than a Hugging Face id (`org/name`, or a bare `name`)."""
    return (
        name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()
    )


def _check_schedule(spec: dict[str, Any]) -> None:
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if schedule is None:
        return
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        normalized = validate_and_normalize_dynamic_sd_schedule([list(e) for e in schedule])
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"speculative_config.num_speculative_tokens_per_batch_size: {exc}"
        ) from exc
    spec["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in normalized]


# --------------------------------------------------------------------------- --speculation-adapt


def drafting_is_free_at_k0(spec: object) -> bool:
    """Whether a step at K = 0 costs what the plain engine's does for this speculative
    config: the chooser then prices K = 0 at the profile's no-speculation step time."""
    return isinstance(spec, Mapping) and spec.get("method") in SKIPPED_METHODS


def configure_opt_out(values: dict[str, Any]) -> None:
    """A speculating worker runs `speculative.opt_out`'s scheduler unless the user named
    another one (then `"speculative_decoding": false` cannot be honoured: said once)."""
    if not values.get("speculative_config"):
        return
    if values.get("scheduler_cls"):
        log.warning(
            '--scheduler-cls %s: requests that send "speculative_decoding": false are '
            "speculated all the same (only %s drops their drafts)",
            values["scheduler_cls"],
            OPT_OUT_SCHEDULER_CLS,
        )
        return
    values["scheduler_cls"] = OPT_OUT_SCHEDULER_CLS


def configure_adaptation(
    values: dict[str, Any],
    mode: str,
    profile_path: str | None,
    *,
    window_steps: int,
    warmup_drafts: int,
) -> None:
    """`--speculation-adapt`: vLLM's scheduler becomes the adaptive one
    (`speculative.scheduler`), told through `additional_config` where the profile is and how
    to adapt. The profile's schedule stays in the speculative config: it keeps vLLM in
    its dynamic-K mode, and the chooser replaces its K step by step.

    Without adaptation a speculating worker still runs a scheduler of its own
    (`speculative.opt_out`), so that a request can turn speculation off for itself."""
    if mode == "off":
        configure_opt_out(values)
        return
    if not profile_path:
        raise ConfigError(
            "--speculation-adapt needs --speculation-profile: the profile's acceptance and "
            "step times are where adaptation starts (measure one with "
            "`python -m dynamo.vllm.profile_spec`)"
        )
    if values.get("scheduler_cls"):
        raise ConfigError(
            f"--speculation-adapt replaces vLLM's scheduler; --scheduler-cls "
            f"{values['scheduler_cls']} was given too"
        )
    settings = AdaptationSettings(
        window_steps=window_steps,
        warmup_drafts=warmup_drafts,
        adapt_step_times=mode == "full",
    )
    extra = dict(values.get("additional_config") or {})
    extra.update(
        engine_config(
            Path(profile_path).expanduser(),
            settings,
            free_k0=drafting_is_free_at_k0(values.get("speculative_config")),
            state_path=new_state_path(),
        )
    )
    values["scheduler_cls"] = SCHEDULER_CLS
    values["additional_config"] = extra
    log.info(
        "speculation adapts online (%s): window %d steps, warm-up %d drafts",
        mode, window_steps, warmup_drafts,
    )  # fmt: skip
