"""`dynamo.vllm.free_k0`: at K = 0 the runner calls no drafter (n-gram, Eagle, Eagle3),
and a step verifying no draft samples as an engine without speculation."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

import pytest
import torch

from dynamo.vllm.free_k0 import RUNNER_MODULE, patch_runner_module
from dynamo.vllm.speculative_resolution import drafting_is_free_at_k0


@dataclass
class FakeMetadata:
    num_draft_tokens: list[int] = field(default_factory=list)


class FakeRunner:
    """Stands in for vLLM's `GPUModelRunner`: what its two wrapped methods return, and
    how often its drafter ran."""

    def __init__(
        self, method: str, drafts: list[int] | None = None, *, asynchronous: bool = False
    ) -> None:
        self.speculative_config = SimpleNamespace(method=method)
        self.use_async_scheduling = asynchronous
        self.metadata = FakeMetadata(drafts or [0])
        self.drafter_runs = 0
        self._draft_probs: object = "stale"
        self._draft_prob_req_ids: object = "stale"

    def _prepare_inputs(self, scheduler_output: object, num_scheduled_tokens: object):
        return "rows", self.metadata, 1 + max(self.metadata.num_draft_tokens)

    def propose_draft_token_ids(self, scheduler_output: object, sampled_token_ids: object, *rest):
        self.drafter_runs += 1
        return "drafted"


def runner_class() -> type[FakeRunner]:
    module = ModuleType("fake_runner")
    module.GPUModelRunner = type("GPUModelRunner", (FakeRunner,), {})  # type: ignore[attr-defined]
    patch_runner_module(module)
    patch_runner_module(module)  # once only
    return module.GPUModelRunner  # type: ignore[attr-defined,no-any-return]


def step(k: int) -> SimpleNamespace:
    return SimpleNamespace(num_spec_tokens_to_schedule=k)


def test_ngram_at_k0_answers_an_empty_list_per_sequence_without_searching() -> None:
    runner = runner_class()("ngram")
    assert runner.propose_draft_token_ids(step(0), [[1], [2, 3], []], None) == [[], [], []]
    assert runner.drafter_runs == 0
    assert runner._draft_probs is None and runner._draft_prob_req_ids is None
    assert runner.propose_draft_token_ids(step(2), [[1]], None) == "drafted"
    assert runner.drafter_runs == 1


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_at_k0_answers_a_zero_width_tensor_without_a_forward_pass(method: str) -> None:
    runner = runner_class()(method)
    drafts = runner.propose_draft_token_ids(step(0), torch.zeros((5, 4), dtype=torch.int64))
    assert isinstance(drafts, torch.Tensor)
    assert drafts.shape == (5, 0) and drafts.dtype == torch.int64
    assert runner.drafter_runs == 0


@pytest.mark.parametrize(
    ("method", "asynchronous"), [("suffix", False), ("mtp", False), ("eagle3", True)]
)
def test_unmeasured_methods_and_async_scheduling_keep_vllms_drafting(
    method: str, asynchronous: bool
) -> None:
    runner = runner_class()(method, asynchronous=asynchronous)
    assert runner.propose_draft_token_ids(step(0), [[1]]) == "drafted"
    assert runner._prepare_inputs(step(0), None) == ("rows", runner.metadata, 1)


def test_an_ngram_step_without_drafts_loses_its_speculative_metadata_at_any_k() -> None:
    runner = runner_class()("ngram", [0, 0, 0])
    assert runner._prepare_inputs(step(3), None) == ("rows", None, 1)
    assert runner._prepare_inputs(step(0), None) == ("rows", None, 1)


def test_a_step_with_any_draft_keeps_the_rejection_sampler() -> None:
    runner = runner_class()("ngram", [0, 2, 0])
    assert runner._prepare_inputs(step(0), None) == ("rows", runner.metadata, 3)


def test_eagle_samples_plainly_only_where_it_will_not_propose() -> None:
    """Eagle's drafter reads the rejection sampler's output layout when it proposes."""
    runner = runner_class()("eagle3", [0, 0])
    assert runner._prepare_inputs(step(0), None) == ("rows", None, 1)
    assert runner._prepare_inputs(step(2), None) == ("rows", runner.metadata, 1)


def test_the_chooser_prices_k0_as_free_exactly_for_the_skipped_methods() -> None:
    assert drafting_is_free_at_k0({"method": "ngram"})
    assert drafting_is_free_at_k0({"method": "eagle3"})
    assert not drafting_is_free_at_k0({"method": "suffix"})
    assert not drafting_is_free_at_k0(None)


def test_vllms_runner_still_has_what_the_wrappers_read() -> None:
    """The wrappers unpack `_prepare_inputs`' result in this order, read the metadata's
    per-request draft counts, reset the draft probabilities as vLLM's method does, and
    read K from the scheduler output; this vLLM must still have all of them."""
    module = importlib.import_module(RUNNER_MODULE)
    runner = module.GPUModelRunner
    prepare = inspect.getsource(inspect.unwrap(runner._prepare_inputs))
    assert "tuple[logits_indices, spec_decode_metadata, max_num_sampled_tokens]" in prepare
    propose = inspect.getsource(inspect.unwrap(runner.propose_draft_token_ids))
    assert list(inspect.signature(inspect.unwrap(runner.propose_draft_token_ids)).parameters)[
        :3
    ] == ["self", "scheduler_output", "sampled_token_ids"]
    for name in ("self._draft_probs = None", "self._draft_prob_req_ids = None"):
        assert name in propose
    assert "num_spec_tokens_to_schedule" in propose
    metadata = importlib.import_module("vllm.v1.spec_decode.metadata").SpecDecodeMetadata
    assert "num_draft_tokens" in metadata.__dataclass_fields__
