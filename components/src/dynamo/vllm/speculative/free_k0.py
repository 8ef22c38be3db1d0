"""A vLLM plugin that makes a step at K = 0 cost what a step without speculation does.

With a dynamic K (a profile's schedule, or `--speculation-adapt`), vLLM's scheduler can
ask for no drafts after a step (`num_spec_tokens_to_schedule == 0`), but a speculating
model runner still does two kinds of work for drafts that do not exist:

* It calls the drafter. For n-gram that is the whole match search over every sequence's
  context (numba, on the step's critical path, growing with the context), only for each
  match to be cut to zero tokens. For Eagle and Eagle3 it is the drafter's first forward
  pass over the step's tokens, run only to write the drafter's KV cache for them. At
  K = 0 the runner now answers an empty draft for every sequence without calling it.
* It samples through the rejection sampler, with its metadata, even when the step
  verifies no draft at all (measured: about 2 ms of a 50 ms step at 32 sequences, a 6%
  loss against an engine without speculation). Such a step now samples with vLLM's plain
  sampler, exactly as an engine without speculation: the same logits rows (the last
  scheduled token of each request), one token per request.

* After each step the engine core asks the runner, in a round trip to its process, for
  the drafts it proposed, even when it was asked for none (measured at 32 sequences:
  2.5% of the engine core's busy time, on the step's critical path). When the step's K is
  0 and the runner is one of the above, the engine core now skips the question: the
  answer would be an empty draft for each sequence, and vLLM's scheduler has already
  emptied each scheduled sequence's drafts. The scheduler says the step's K
  (`StepKnowsK`: `SpeculationOptOutScheduler`, which every speculating worker runs).

What skipping Eagle's pass costs: the drafter's KV cache has no entry for the positions
decoded at K = 0, and when drafting resumes its attention reads whatever those slots
hold. Measured on the shipped Eagle3 head (docs/speculative_decoding.md, "A free K = 0"),
that costs less acceptance than a catch-up pass would cost time, so there is none. A
prompt is another matter: a step at K = 0 that carries prompt tokens (a new request, a
chunk of a long prompt) still runs Eagle's pass, or every draft of that request would
attend over a prompt its drafter never saw. Skipped there, adaptive Eagle3 at one
sequence (where each request's prefill runs alone, with no sequence decoding, at K = 0)
accepted 0.39 / 0.12 / 0.04 at positions 0-2 where a static K = 3 accepts 0.41 / 0.17 /
0.08.

Only methods whose skip was measured take it: n-gram (stateless), Eagle and Eagle3.
Suffix decoding updates its tree when it proposes, MTP and draft models were not
measured; they keep vLLM's behaviour. With asynchronous scheduling (GPU builds) the
runner keeps vLLM's path too: there the drafter also hands the next step its token
counts.

The patches wrap `GPUModelRunner._prepare_inputs` and `propose_draft_token_ids` (which
vLLM's CPU runner inherits) and `EngineCore.post_step` when vLLM imports those modules
(the same import hook as `cpu_seeded_sampling`), in every process that loads vLLM's
plugins.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import torch

from dynamo.vllm.plugins.cpu_seeded_sampling import patch_on_import, wrap_methods_once

# Under vLLM's logger: this runs in vLLM's worker processes, where only its logging is set up.
log = logging.getLogger("vllm.dynamo.free_k0")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
SKIPPED_METHODS = frozenset({"ngram", "eagle", "eagle3"})
"""Speculative methods whose drafter the runner skips at K = 0 (see the module)."""
DRAFTERS_WITH_KV = frozenset({"eagle", "eagle3"})
"""Of those, the drafters that keep a KV cache: they still see every prompt token."""
_PATCHED = "_dynamo_free_k0"


@runtime_checkable
class StepKnowsK(Protocol):
    """A scheduler that says the K of the step it scheduled last."""

    def k_after_step(self) -> int:
        """Drafts per sequence the runner was asked for after that step (-1: unknown)."""
        ...


def skips_drafting(runner: Any, scheduler_output: Any) -> bool:
    """Whether `runner`'s step calls no drafter: its K is 0, the method's drafter is
    skipped at K = 0, and a drafter with a KV cache gets no prompt tokens in this step."""
    config = runner.speculative_config
    return (
        scheduler_output.num_spec_tokens_to_schedule == 0
        and drafter_skipped_at_k0(config, runner.use_async_scheduling)
        and not (config.method in DRAFTERS_WITH_KV and carries_prompt_tokens(scheduler_output))
    )


def carries_prompt_tokens(scheduler_output: Any) -> bool:
    """Whether a step computes tokens other than each request's one new token and the
    drafts it verifies: a prompt, or a chunk of one."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return any(
        tokens > 1 + len(drafts.get(req_id, ()))
        for req_id, tokens in scheduler_output.num_scheduled_tokens.items()
    )


def drafter_skipped_at_k0(speculative_config: Any, asynchronous: bool) -> bool:
    """Whether a runner with this speculative config skips its drafter at K = 0."""
    return (
        speculative_config is not None
        and speculative_config.method in SKIPPED_METHODS
        and not asynchronous
    )


def drafts_were_made(core: Any) -> bool:
    """Whether the runner behind engine core `core` may hold drafts after the step just
    run: False only when the scheduler says that step's K was 0 and the runner skips its
    drafter at K = 0."""
    scheduler = core.scheduler
    return not (
        isinstance(scheduler, StepKnowsK)
        and scheduler.k_after_step() == 0
        and drafter_skipped_at_k0(core.vllm_config.speculative_config, core.async_scheduling)
    )


def fetching_drafts_only_when_made(post_step: Callable[..., Any]) -> Callable[..., Any]:
    """`EngineCore.post_step` that asks the runner for its drafts only after a step that
    may have made some (see the module)."""

    @functools.wraps(post_step)
    def wrapper(self: Any, model_executed: bool, *args: Any, **kwargs: Any) -> Any:
        if model_executed and not drafts_were_made(self):
            return None
        return post_step(self, model_executed, *args, **kwargs)

    return wrapper


def no_drafts(sampled_token_ids: Any) -> list[list[int]] | torch.Tensor:
    """An empty draft per sequence, in the form the runner's drafter would give it: a
    list per sequence for n-gram, a (sequences, 0) tensor for a drafter with a model."""
    if isinstance(sampled_token_ids, torch.Tensor):
        return sampled_token_ids.new_empty((sampled_token_ids.shape[0], 0), dtype=torch.int64)
    return [[] for _ in sampled_token_ids]


def skipping_drafter_at_k0(propose: Callable[..., Any]) -> Callable[..., Any]:
    """`GPUModelRunner.propose_draft_token_ids` that calls no drafter at K = 0."""

    @functools.wraps(propose)
    def wrapper(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not skips_drafting(self, scheduler_output):
            return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        # What vLLM's own method resets before drafting: no draft, so no draft probabilities.
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return no_drafts(sampled_token_ids)

    return wrapper


def plain_sampling_without_drafts(prepare_inputs: Callable[..., Any]) -> Callable[..., Any]:
    """`GPUModelRunner._prepare_inputs` that drops the speculative metadata of a step that
    verifies no draft, so the step samples as an engine without speculation.

    vLLM's method returns (logits rows, speculative metadata, most tokens sampled per
    request). With no draft in the step, the metadata's logits rows are already the plain
    ones and one token is sampled per request; only the metadata goes, and with it the
    rejection sampler. A drafter with a model reads the sampler's layout when it proposes,
    so for Eagle this is done only at K = 0, where it does not propose."""

    @functools.wraps(prepare_inputs)
    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        logits_indices, metadata, max_sampled = prepare_inputs(
            self, scheduler_output, *args, **kwargs
        )
        no_draft = metadata is not None and not any(metadata.num_draft_tokens)
        if no_draft and (
            self.speculative_config.method == "ngram"  # stateless: never reads the layout
            or skips_drafting(self, scheduler_output)
        ):
            metadata = None
        return logits_indices, metadata, max_sampled

    return wrapper


def patch_runner_module(module: ModuleType) -> None:
    """Wrap the runner's `_prepare_inputs` and `propose_draft_token_ids` in `module` (once)."""
    wrappers = {
        "_prepare_inputs": plain_sampling_without_drafts,
        "propose_draft_token_ids": skipping_drafter_at_k0,
    }
    if not wrap_methods_once(module, "GPUModelRunner", wrappers, _PATCHED):
        return
    log.info(
        "speculation: steps at K = 0 run no drafter (%s) and sample as without "
        "speculation (dynamo_free_k0)",
        ", ".join(sorted(SKIPPED_METHODS)),
    )


def patch_engine_core_module(module: ModuleType) -> None:
    """Wrap `EngineCore.post_step` in `module` (once)."""
    wrap_methods_once(module, "EngineCore", {"post_step": fetching_drafts_only_when_made}, _PATCHED)


def register() -> None:
    """The plugin's entry point (`vllm.general_plugins`): idempotent and cheap."""
    patch_on_import(RUNNER_MODULE, patch_runner_module)
    patch_on_import(ENGINE_CORE_MODULE, patch_engine_core_module)
