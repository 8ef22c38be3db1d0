"""The card's `sampling_defaults` fill the sampling fields a request leaves unset.

Claims (as `vllm serve` does with generation_config.json): an unset field takes the model's
default; an explicit value wins, an explicit 0 temperature included; `max_tokens` left
unset takes the model's default capped by the rest of the context, and an explicit one
wins; a card without defaults changes nothing.
"""

from __future__ import annotations

from typing import Any

from frontend_support import chat_request, completion_request, make_card

from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.llm.protocols import SamplingDefaults, SamplingOptions

DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, repetition_penalty=1.1)


def with_defaults(tokenizer: Any, defaults: SamplingDefaults | None) -> Preprocessor:
    return Preprocessor(make_card(sampling_defaults=defaults), tokenizer)


def test_unset_fields_take_the_models_defaults(tokenizer: Any) -> None:
    pre = with_defaults(tokenizer, DEFAULTS)
    options = pre.prepare_chat_sync(chat_request(), "r").request.sampling_options
    assert options == SamplingOptions(temperature=0.2, top_p=0.9, top_k=40, repetition_penalty=1.1)
    completion = pre.prepare_completion_sync(completion_request(), "r").request
    assert completion.sampling_options == options


def test_explicit_values_win_even_zero(tokenizer: Any) -> None:
    pre = with_defaults(tokenizer, DEFAULTS)
    request = chat_request(temperature=0, top_p=1.0, seed=7)
    options = pre.prepare_chat_sync(request, "r").request.sampling_options
    assert options.temperature == 0
    assert options.top_p == 1.0
    assert options.seed == 7
    assert options.top_k == 40  # still unset by the request


def test_max_tokens_default_is_capped_by_the_context(tokenizer: Any) -> None:
    pre = with_defaults(tokenizer, SamplingDefaults(max_tokens=16))
    stop = pre.prepare_chat_sync(chat_request(), "r").request.stop_conditions
    assert stop.max_tokens == 16
    explicit = pre.prepare_chat_sync(chat_request(max_tokens=40), "r").request.stop_conditions
    assert explicit.max_tokens == 40
    huge = with_defaults(tokenizer, SamplingDefaults(max_tokens=100_000))
    prepared = huge.prepare_chat_sync(chat_request(), "r").request
    assert prepared.stop_conditions.max_tokens == 256 - len(prepared.token_ids)


def test_card_without_defaults_leaves_the_request_alone(tokenizer: Any) -> None:
    pre = with_defaults(tokenizer, None)
    prepared = pre.prepare_chat_sync(chat_request(), "r").request
    assert prepared.sampling_options == SamplingOptions()
    assert prepared.stop_conditions.max_tokens == 256 - len(prepared.token_ids)
