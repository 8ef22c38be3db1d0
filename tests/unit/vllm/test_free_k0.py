"""`dynamo.vllm.speculative.free_k0`: at K = 0 the runner calls no drafter (n-gram, Eagle, Eagle3),
a step verifying no draft samples as an engine without speculation, and the engine core
does not ask the runner for the drafts it did not make."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import TypeVar

import pytest
import torch

from dynamo.vllm.config.speculative_resolution import drafting_is_free_at_k0
from dynamo.vllm.speculative.free_k0 import (
    ENGINE_CORE_MODULE,
    RUNNER_MODULE,
    SKIPPED_METHODS,
    StepKnowsK,
    patch_engine_core_module,
    patch_runner_module,
)
from dynamo.vllm.speculative.opt_out import SpeculationOptOutScheduler


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


C = TypeVar("C")


def patched_class(name: str, fake: type[C], patch: Callable[[ModuleType], object]) -> type[C]:
    """A subclass `name` of `fake` in a module of its own that `patch` patched (twice: the
    second must change nothing)."""
    module = ModuleType(f"fake_{name}")
    setattr(module, name, type(name, (fake,), {}))
    patch(module)
    patch(module)  # once only
    return getattr(module, name)


def runner_class() -> type[FakeRunner]:
    return patched_class("GPUModelRunner", FakeRunner, patch_runner_module)


def step(k: int, scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    """A scheduler output at `k` whose requests compute `scheduled` tokens each (default:
    two decoding requests, one token each, no drafts to verify)."""
    return SimpleNamespace(
        num_spec_tokens_to_schedule=k,
        num_scheduled_tokens=scheduled or {"a": 1, "b": 1},
        scheduled_spec_decode_tokens={},
    )


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


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_at_k0_still_runs_its_pass_over_prompt_tokens(method: str) -> None:
    """A new request's prompt (or a chunk of one) in a step at K = 0 reaches Eagle's
    drafter, which then reads the sampler's layout: no plain sampling either. Drafts
    verified with a step's one new token are not prompt tokens."""
    runner = runner_class()(method, [0, 0])
    prefill = step(0, {"new": 40, "decoding": 1})
    assert runner.propose_draft_token_ids(prefill, torch.zeros((2, 1))) == "drafted"
    assert runner._prepare_inputs(prefill, None) == ("rows", runner.metadata, 1)
    verifying = step(0, {"a": 3, "b": 1})
    verifying.scheduled_spec_decode_tokens = {"a": [7, 8]}
    drafts = runner.propose_draft_token_ids(verifying, torch.zeros((2, 3)))
    assert isinstance(drafts, torch.Tensor) and drafts.shape == (2, 0)
    assert runner.drafter_runs == 1


def test_ngram_at_k0_skips_its_search_over_prompts_too() -> None:
    """n-gram keeps no state: nothing to see in a prompt before it is asked to draft."""
    runner = runner_class()("ngram")
    assert runner.propose_draft_token_ids(step(0, {"new": 40}), [[1]]) == [[]]
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
    output = importlib.import_module("vllm.v1.core.sched.output").SchedulerOutput
    for name in ("num_scheduled_tokens", "scheduled_spec_decode_tokens"):
        assert name in output.__dataclass_fields__


class FakeScheduler:
    """Says the K of its last step, as `SpeculationOptOutScheduler` does."""

    def __init__(self, k: int) -> None:
        self.k = k

    def k_after_step(self) -> int:
        return self.k


class FakeEngineCore:
    """Stands in for vLLM's `EngineCore`: how often `post_step` asked for drafts."""

    def __init__(self, scheduler: object, method: str | None, *, asynchronous: bool = False):
        self.scheduler = scheduler
        config = None if method is None else SimpleNamespace(method=method)
        self.vllm_config = SimpleNamespace(speculative_config=config)
        self.async_scheduling = asynchronous
        self.fetches = 0

    def post_step(self, model_executed: bool) -> None:
        if model_executed:
            self.fetches += 1


def core_class() -> type[FakeEngineCore]:
    return patched_class("EngineCore", FakeEngineCore, patch_engine_core_module)


@pytest.mark.parametrize("method", sorted(SKIPPED_METHODS))
def test_after_a_step_at_k0_the_engine_core_does_not_ask_for_drafts(method: str) -> None:
    core = core_class()(FakeScheduler(0), method)
    core.post_step(True)
    assert core.fetches == 0


@pytest.mark.parametrize(
    ("scheduler", "method", "asynchronous"),
    [
        (FakeScheduler(2), "ngram", False),  # drafts were asked for
        (FakeScheduler(-1), "ngram", False),  # no step scheduled yet
        (object(), "ngram", False),  # a scheduler that does not say its K
        (FakeScheduler(0), "mtp", False),  # a drafter that still runs at K = 0
        (FakeScheduler(0), "eagle3", True),  # asynchronous scheduling keeps vLLM's path
    ],
)
def test_otherwise_the_engine_core_asks_as_vllm_does(
    scheduler: object, method: str, asynchronous: bool
) -> None:
    core = core_class()(scheduler, method, asynchronous=asynchronous)
    core.post_step(True)
    assert core.fetches == 1


def test_the_opt_out_scheduler_says_its_k_and_vllms_engine_core_still_reads_it() -> None:
    """Every speculating worker's scheduler is a `StepKnowsK`; vLLM's `post_step` still
    fetches drafts through the executor, guarded by the attributes the wrapper reads."""
    assert issubclass(SpeculationOptOutScheduler, StepKnowsK)
    scheduler = object.__new__(SpeculationOptOutScheduler)
    assert scheduler.k_after_step() == -1
    core = importlib.import_module(ENGINE_CORE_MODULE).EngineCore
    source = inspect.getsource(inspect.unwrap(core.post_step))
    assert "take_draft_token_ids" in source and "self.async_scheduling" in source
    assert list(inspect.signature(inspect.unwrap(core.post_step)).parameters) == [
        "self",
        "model_executed",
    ]
    step_source = inspect.getsource(core.step)
    assert "self.scheduler.schedule(" in step_source
