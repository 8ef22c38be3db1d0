"""`dynamo.vllm.free_k0`: at K = 0 the n-gram proposer answers no drafts without searching."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

from dynamo.vllm.free_k0 import NGRAM_MODULE, patch_ngram_module


class FakeNgramProposer:
    """Stands in for vLLM's: counts its searches."""

    searches = 0

    def propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]], *rest):
        FakeNgramProposer.searches += 1
        return [[7] * num_speculative_tokens for _ in sampled_token_ids]


def fake_module() -> ModuleType:
    module = ModuleType("fake_ngram")
    module.NgramProposer = type("NgramProposer", (FakeNgramProposer,), {})  # type: ignore[attr-defined]
    return module


def test_k0_answers_empty_drafts_without_searching_and_other_ks_search() -> None:
    module = fake_module()
    patch_ngram_module(module)
    patch_ngram_module(module)  # once only
    proposer = module.NgramProposer()
    FakeNgramProposer.searches = 0
    assert proposer.propose(0, [[1], [2, 3], []], None, None) == [[], [], []]
    assert FakeNgramProposer.searches == 0
    assert proposer.propose(2, [[1], [2]], None, None) == [[7, 7], [7, 7]]
    assert FakeNgramProposer.searches == 1


def test_vllms_proposer_takes_k_then_the_sampled_tokens_first() -> None:
    """The wrapper reads K and the batch from the first two arguments of vLLM's own
    `NgramProposer.propose`; this vLLM must still have them there."""
    module = importlib.import_module(NGRAM_MODULE)
    parameters = list(inspect.signature(module.NgramProposer.propose).parameters)
    assert parameters[:3] == ["self", "num_speculative_tokens", "sampled_token_ids"]
