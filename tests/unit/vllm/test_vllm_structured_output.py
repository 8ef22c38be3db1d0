"""Structured output in the vLLM worker's conversion (`dynamo.vllm.serving.conversion`).

Claims: a request's `StructuredOutput` becomes vLLM's `StructuredOutputsParams` on the
`SamplingParams`, every constraint and option carried; none leaves the params
unconstrained; what vLLM's own checks or its xgrammar compiler refuse (two constraints,
a regex xgrammar cannot compile, a schema feature it does not support) is raised as
`VLLMClientError`, which the handler turns into the client's 400.
"""

from __future__ import annotations

import json

import pytest
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

from dynamo.llm.protocols import PreprocessedRequest, StructuredOutput
from dynamo.vllm.serving.conversion import to_sampling_params

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


def request(constraint: StructuredOutput | None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=[1, 2, 3], structured_output=constraint
    )


def test_no_constraint_leaves_params_unconstrained() -> None:
    assert to_sampling_params(request(None)).structured_outputs is None


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (StructuredOutput(json_schema=SCHEMA), StructuredOutputsParams(json=SCHEMA)),
        (StructuredOutput(json_object=True), StructuredOutputsParams(json_object=True)),
        (StructuredOutput(regex="[0-9]+"), StructuredOutputsParams(regex="[0-9]+")),
        (StructuredOutput(choice=["a", "b"]), StructuredOutputsParams(choice=["a", "b"])),
        (StructuredOutput(grammar='root ::= "x"'), StructuredOutputsParams(grammar='root ::= "x"')),
        (
            StructuredOutput(
                json_schema=SCHEMA,
                disable_any_whitespace=True,
                disable_additional_properties=True,
                whitespace_pattern=" ?",
            ),
            StructuredOutputsParams(
                json=SCHEMA,
                disable_any_whitespace=True,
                disable_additional_properties=True,
                whitespace_pattern=" ?",
            ),
        ),
    ],
)
def test_each_constraint_maps_to_vllm(
    constraint: StructuredOutput, expected: StructuredOutputsParams
) -> None:
    assert to_sampling_params(request(constraint)).structured_outputs == expected


def test_two_constraints_are_a_client_error() -> None:
    with pytest.raises(VLLMClientError, match="one kind of structured outputs"):
        to_sampling_params(request(StructuredOutput(regex="a", choice=["b"])))


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutput(regex="(unclosed"),
        StructuredOutput(json_schema=json.dumps({"type": "string", "format": "no-such"})),
        StructuredOutput(grammar="root ::= "),
    ],
)
def test_what_xgrammar_refuses_is_a_client_error(constraint: StructuredOutput) -> None:
    params = to_sampling_params(request(constraint))
    with pytest.raises(VLLMClientError):
        validate_xgrammar_grammar(params)
