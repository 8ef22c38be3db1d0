"""Prompts as the e2e tests send them straight to a worker: chat-templated token ids, in
greedy requests (temperature 0, so two runs of the same prompt can be compared token for
token)."""

from __future__ import annotations

import uuid

from dynamo.llm.protocols import PreprocessedRequest, SamplingOptions, StopConditions


def chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn through the model's chat template, ready for generation."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def greedy_request(
    token_ids: list[int], max_tokens: int, *, model: str, ignore_eos: bool = False
) -> PreprocessedRequest:
    """A greedy request for `token_ids` with a fresh id; `ignore_eos` makes it run to
    exactly `max_tokens`."""
    return PreprocessedRequest(
        request_id=str(uuid.uuid4()),
        model=model,
        token_ids=token_ids,
        sampling_options=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )
