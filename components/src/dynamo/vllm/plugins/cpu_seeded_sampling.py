"""A vLLM plugin that keeps seeded requests from killing a vLLM-CPU engine under chunked prefill.

When the scheduler splits a prompt over several steps (chunked prefill), every step but
the last still samples a token for that request, and vLLM throws the token away. So
that the throwaway does not move a seeded request's random stream (its output must not
depend on how its prompt was chunked), vLLM then winds the request's generator back
(`gen.set_offset(gen.get_offset() - 4)` in the model runner's bookkeeping). Only CUDA's
Philox generator has an offset: a CPU `torch.Generator` raises `RuntimeError: CPU
Generator does not use offset`, which fails the step and kills the engine with every
request in it (measured: four ~1,800-token completions, one with `"seed": 7`, on a
worker with `--max-num-batched-tokens 512`: all four 500 `engine dead`, the model gone).

The repair gives the sampler a stand-in for such a step instead of rewinding: before
the model runner samples, each request whose token will be discarded and that has a
generator lends the sampler a copy of it (`DiscardableGenerator`, whose offset methods
do nothing); after the step the request gets its own generator back, untouched. The
discarded draw moved only the copy, which is exactly what the rewind achieves on CUDA,
so a seeded request's tokens are the same however its prompt was chunked.

The patch is applied to `CPUModelRunner.sample_tokens` when vLLM imports that module (a
hook on the import, so processes that never build a CPU model runner import nothing),
and only where a CPU generator lacks offsets (a torch that has them needs no repair).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
_PATCHED = "_dynamo_lends_generators_for_discarded_samples"


class DiscardableGenerator(torch.Generator):
    """A copy of a seeded request's CPU generator for one step whose sample is thrown
    away: drawing from it leaves the request's own generator where it was, so vLLM's
    rewind has nothing to undo and is a no-op here."""

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        del offset


class _InputBatch(Protocol):
    num_reqs: int
    generators: dict[int, torch.Generator]


class _ModelRunner(Protocol):
    """What the repair reads of vLLM's model runner."""

    input_batch: _InputBatch
    discard_request_mask: Any  # a CpuGpuBuffer: `.np` is its numpy view


Lent = dict[int, tuple[torch.Generator, DiscardableGenerator]]


def lend_stand_ins(runner: _ModelRunner) -> Lent:
    """Replace the generator of every request whose sample this step discards with a
    copy; returns what was replaced, for `give_back`."""
    batch = runner.input_batch
    discarded = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
    lent: Lent = {}
    for index in map(int, discarded):
        own = batch.generators.get(index)
        if own is None or isinstance(own, DiscardableGenerator):
            continue
        stand_in = DiscardableGenerator(device=own.device)
        stand_in.set_state(own.get_state())
        batch.generators[index] = stand_in
        lent[index] = (own, stand_in)
    return lent


def give_back(runner: _ModelRunner, lent: Lent) -> None:
    """Each request its own generator again (where the stand-in still holds its place)."""
    generators = runner.input_batch.generators
    for index, (own, stand_in) in lent.items():
        if generators.get(index) is stand_in:
            generators[index] = own


def lending_sample_tokens(sample_tokens: Callable[..., Any]) -> Callable[..., Any]:
    """`sample_tokens` with stand-ins lent for the discarded samples of its step."""

    @functools.wraps(sample_tokens)
    def wrapper(self: _ModelRunner, *args: Any, **kwargs: Any) -> Any:
        lent = lend_stand_ins(self)
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            give_back(self, lent)

    return wrapper


def cpu_generators_lack_offsets() -> bool:
    """Whether this torch's CPU generator refuses offsets (the case vLLM trips over)."""
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def patch_runner_module(module: ModuleType) -> None:
    """Wrap `CPUModelRunner.sample_tokens` in `module` (once)."""
    if wrap_methods_once(
        module, "CPUModelRunner", {"sample_tokens": lending_sample_tokens}, _PATCHED
    ):
        log.debug("seeded requests on vLLM-CPU: discarded samples draw from a stand-in generator")


def wrap_methods_once(
    module: ModuleType,
    class_name: str,
    wrappers: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]],
    marker: str,
) -> bool:
    """Replace each method `name` of class `class_name` in `module` by `wrappers[name]`
    of it, marking the replacement with the attribute `marker`; False (and nothing
    changed) where `module` has no such class or its methods already carry `marker`."""
    cls = getattr(module, class_name, None)
    if cls is None or any(getattr(getattr(cls, name), marker, False) for name in wrappers):
        return False
    for name, wrap in wrappers.items():
        wrapped = wrap(getattr(cls, name))
        setattr(wrapped, marker, True)
        setattr(cls, name, wrapped)
    return True


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies `patch` to module `name` right after it is first executed."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and let the other finders find the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        patch = self.patch

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def register() -> None:
    """The plugin's entry point (`vllm.general_plugins`): idempotent, cheap, and silent
    where there is nothing to repair."""
    if not cpu_generators_lack_offsets():
        return
    patch_on_import(RUNNER_MODULE, patch_runner_module)


def patch_on_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run `patch` on module `name` as soon as it is imported (at once if it already is);
    a second call with the same name and patch adds nothing."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    if not any(
        isinstance(f, PatchOnImport) and f.name == name and f.patch is patch for f in sys.meta_path
    ):
        sys.meta_path.insert(0, PatchOnImport(name, patch))
