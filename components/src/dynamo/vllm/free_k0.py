"""A vLLM plugin that makes a step at K = 0 free of drafting work, where vLLM does not.

With a dynamic K (a profile's schedule, or `--speculation-adapt`), vLLM's scheduler can
ask for no drafts after a step (`num_spec_tokens_to_schedule == 0`), but its model runner
still calls the drafter. For n-gram that is the whole match search over every sequence's
context (numba, on the step's critical path, growing with the context), only for
`batch_propose` to cut each match to zero tokens. The result is known in advance: no
drafts. So at K = 0 the proposer returns an empty draft for every sequence at once.

Eagle and the other drafters with a model keep state (their KV cache for the positions
they saw), and skipping their forward pass would leave holes a later step reads; they
are left as vLLM runs them.

The patch is applied to `NgramProposer.propose` when vLLM imports that module (the same
import hook as `cpu_seeded_sampling`), in every process that loads vLLM's plugins.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from dynamo.vllm.cpu_seeded_sampling import patch_on_import

# Under vLLM's logger: this runs in vLLM's worker processes, where only its logging is set up.
log = logging.getLogger("vllm.dynamo.free_k0")

NGRAM_MODULE = "vllm.v1.spec_decode.ngram_proposer"
_PATCHED = "_dynamo_skips_the_search_at_k0"


def skipping_at_k0(propose: Callable[..., list[list[int]]]) -> Callable[..., list[list[int]]]:
    """`NgramProposer.propose` that returns no drafts, without searching, at K = 0."""

    @functools.wraps(propose)
    def wrapper(
        self: Any,
        num_speculative_tokens: int,
        sampled_token_ids: Sequence[Sequence[int]],
        *args: Any,
        **kwargs: Any,
    ) -> list[list[int]]:
        if num_speculative_tokens == 0:
            return [[] for _ in sampled_token_ids]
        return propose(self, num_speculative_tokens, sampled_token_ids, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def patch_ngram_module(module: ModuleType) -> None:
    """Wrap `NgramProposer.propose` in `module` (once)."""
    proposer = getattr(module, "NgramProposer", None)
    if proposer is None or getattr(proposer.propose, _PATCHED, False):
        return
    proposer.propose = skipping_at_k0(proposer.propose)
    log.info("n-gram speculation: steps at K = 0 skip the match search (dynamo_free_k0)")


def register() -> None:
    """The plugin's entry point (`vllm.general_plugins`): idempotent and cheap."""
    patch_on_import(NGRAM_MODULE, patch_ngram_module)
