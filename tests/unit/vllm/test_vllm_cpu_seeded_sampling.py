"""The repair that keeps a seeded request with a chunked prefill from killing a vLLM-CPU
engine (`dynamo.vllm.plugins.cpu_seeded_sampling`).

Claims:
* this torch's CPU generator has no offset (the rewind vLLM does raises), so the repair
  applies here;
* for a step whose samples vLLM discards, each such request's generator is replaced by a
  copy; drawing from the copy and then "rewinding" it (what vLLM's bookkeeping does)
  leaves the request's own generator exactly where it was, and it is given back after the
  step, also when the step raises; requests whose samples are kept keep their own;
* the patch wraps `CPUModelRunner.sample_tokens` once, applied when the module is first
  imported (or at once when it already was).

The engine itself is exercised in `tests/e2e/test_frontend_openai.py`.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dynamo.vllm.plugins import cpu_seeded_sampling
from dynamo.vllm.plugins.cpu_seeded_sampling import (
    DiscardableGenerator,
    cpu_generators_lack_offsets,
    lending_sample_tokens,
    patch_on_import,
    patch_runner_module,
)


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def runner(discard: list[bool], generators: dict[int, torch.Generator]) -> Any:
    """What the repair reads of vLLM's model runner: the batch's generators and the mask
    of requests whose sample this step discards."""
    batch = SimpleNamespace(num_reqs=len(discard), generators=generators)
    mask = SimpleNamespace(np=np.array(discard + [False] * 4))
    return SimpleNamespace(input_batch=batch, discard_request_mask=mask)


def vllm_step(model_runner: Any) -> None:
    """What one vLLM step does with the generators: each request draws (as the sampler
    does), then every discarded request's generator is wound back by 4 (bookkeeping)."""
    for generator in model_runner.input_batch.generators.values():
        torch.empty(8).exponential_(generator=generator)
    discarded = np.nonzero(
        model_runner.discard_request_mask.np[: model_runner.input_batch.num_reqs]
    )
    for index in discarded[0]:
        generator = model_runner.input_batch.generators.get(int(index))
        if generator is not None:
            generator.set_offset(generator.get_offset() - 4)


def test_this_torch_needs_the_repair() -> None:
    assert cpu_generators_lack_offsets()
    with pytest.raises(RuntimeError, match="offset"):
        vllm_step(runner([True], {0: seeded(7)}))


def test_a_discarded_sample_leaves_the_request_generator_untouched() -> None:
    chunked, kept, unseeded_slot = seeded(7), seeded(11), 2
    reference_chunked, reference_kept = seeded(7), seeded(11)
    torch.empty(8).exponential_(generator=reference_kept)  # a kept sample moves it
    model_runner = runner([True, False, True], {0: chunked, 1: kept})
    step = lending_sample_tokens(lambda self: vllm_step(self))
    step(model_runner)
    generators = model_runner.input_batch.generators
    assert generators[0] is chunked and generators[1] is kept and unseeded_slot not in generators
    assert torch.equal(chunked.get_state(), reference_chunked.get_state())
    assert torch.equal(kept.get_state(), reference_kept.get_state())
    # Its next, kept sample is the one it would have drawn had the prompt not been chunked.
    assert torch.equal(
        torch.empty(8).exponential_(generator=chunked),
        torch.empty(8).exponential_(generator=reference_chunked),
    )


def test_the_generator_is_given_back_when_the_step_fails() -> None:
    own = seeded(3)
    model_runner = runner([True], {0: own})

    def failing(self: Any) -> None:
        assert isinstance(self.input_batch.generators[0], DiscardableGenerator)
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        lending_sample_tokens(failing)(model_runner)
    assert model_runner.input_batch.generators[0] is own


def fake_runner_module(name: str) -> ModuleType:
    module = ModuleType(name)

    class CPUModelRunner:
        def sample_tokens(self, grammar_output: Any) -> str:
            return "sampled"

    module.CPUModelRunner = CPUModelRunner  # type: ignore[attr-defined]
    return module


def test_the_runner_is_patched_once() -> None:
    module = fake_runner_module("fake_runner")
    patch_runner_module(module)
    wrapped = module.CPUModelRunner.sample_tokens
    patch_runner_module(module)
    assert module.CPUModelRunner.sample_tokens is wrapped
    instance = module.CPUModelRunner()
    instance.input_batch = SimpleNamespace(num_reqs=0, generators={})
    instance.discard_request_mask = SimpleNamespace(np=np.array([False]))
    assert instance.sample_tokens(None) == "sampled"


def test_the_patch_waits_for_the_module_to_be_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "dynamo_test_lazy_runner"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            class CPUModelRunner:
                def sample_tokens(self, grammar_output):
                    return "sampled"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    patched: list[str] = []

    def first(module: ModuleType) -> None:
        patched.append(module.__name__)

    patch_on_import(name, first)
    patch_on_import(name, first)  # the same patch already waiting: once
    patch_on_import(name, lambda module: patched.append("another"))  # another patch: both
    assert patched == [] and name not in sys.modules
    try:
        __import__(name)
        assert sorted(patched) == sorted([name, "another"])
        patch_on_import(name, lambda module: patched.append("at once"))  # imported already
        assert patched[-1] == "at once" and len(patched) == 3
    finally:
        sys.modules.pop(name, None)


def test_register_hooks_the_cpu_model_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    hooked: list[str] = []
    monkeypatch.setattr(
        cpu_seeded_sampling, "patch_on_import", lambda name, patch: hooked.append(name)
    )
    cpu_seeded_sampling.register()
    assert hooked == ["vllm.v1.worker.cpu_model_runner"]
