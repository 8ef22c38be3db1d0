"""The repair of vLLM-CPU's `expand_kernel` fallback (dynamo.vllm.plugins.cpu_kernel_fixes)."""

from __future__ import annotations

import pytest
import torch

from dynamo.vllm.plugins import cpu_kernel_fixes
from dynamo.vllm.plugins.cpu_kernel_fixes import expand_to_tokens, fallback_is_broken, register


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_each_request_value_is_spread_over_its_positions_in_place(dtype: torch.dtype) -> None:
    values = torch.tensor([3, 0, 7], dtype=dtype)
    ends = torch.tensor([2, 5, 6], dtype=torch.int32)
    output = torch.full((6,), -9, dtype=dtype)
    expand_to_tokens(output, values, ends, 0, 1)
    assert output.tolist() == [3, 3, 1, 1, 1, 7]  # the 0 became 1 (replace_from → replace_to)


def test_positions_beyond_the_last_request_are_left_alone() -> None:
    output = torch.full((4,), -1.0)
    expand_to_tokens(output, torch.tensor([0.25]), torch.tensor([2]), 0, 1)
    assert output.tolist() == [0.25, 0.25, -1.0, -1.0]


def test_a_fallback_that_does_not_write_float_outputs_is_detected() -> None:
    def writes_a_copy(output, input_val, cu_num_tokens, replace_from, replace_to):  # type: ignore[no-untyped-def]
        expand_to_tokens(output.to(torch.int64), input_val.to(torch.int64), cu_num_tokens, 0, 0)

    assert fallback_is_broken(writes_a_copy)
    assert not fallback_is_broken(expand_to_tokens)


def test_after_the_plugin_runs_vllms_cpu_fallback_expands_temperatures() -> None:
    cpu_triton_utils = pytest.importorskip("vllm.utils.cpu_triton_utils")
    register()
    register()  # idempotent: vLLM loads plugins in every process, sometimes twice
    expand = cpu_triton_utils._expand_kernel_impl  # what the platform registers
    output = torch.empty(3, dtype=torch.float32)
    expand(output, torch.tensor([0.2]), torch.tensor([3], dtype=torch.int32), 0, 1)
    assert torch.allclose(output, torch.tensor([0.2, 0.2, 0.2]))
    assert cpu_kernel_fixes.fallback_is_broken(expand) is False
