"""Chat template, tokenization, validation and option mapping of the `Preprocessor`."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from frontend_support import (
    EOS,
    MODEL,
    chat_request,
    completion_request,
    make_card,
    openai_error_of,
)

from dynamo.frontend.openai.protocol import CompletionRequest
from dynamo.frontend.preprocess import preprocessor as preprocessor_module
from dynamo.frontend.preprocess.preprocessor import Preprocessor


def test_chat_uses_the_models_own_template(preprocessor: Preprocessor, tokenizer: Any) -> None:
    prepared = preprocessor.prepare_chat_sync(chat_request(), "req-1")
    rendered = tokenizer.decode(prepared.request.token_ids)
    assert rendered.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")  # generation prompt added
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert prepared.request.request_id == "req-1"
    assert prepared.request.model == MODEL


def test_chat_text_parts_are_joined_and_other_parts_rejected(preprocessor: Preprocessor) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    text = preprocessor.render_chat(chat_request(messages=[{"role": "user", "content": parts}]))
    assert "first\nsecond" in text
    image = [{"type": "image_url", "image_url": {"url": "data:"}}]
    err = openai_error_of(
        lambda: preprocessor.render_chat(
            chat_request(messages=[{"role": "user", "content": image}])
        )
    )
    assert (err.status, err.param) == (400, "messages")
    assert "image_url" in err.message


def test_empty_messages_and_template_conflicts_are_400(preprocessor: Preprocessor) -> None:
    assert (
        openai_error_of(
            lambda: preprocessor.prepare_chat_sync(chat_request(messages=[]), "r")
        ).param
        == "messages"
    )
    err = openai_error_of(
        lambda: preprocessor.prepare_chat_sync(
            chat_request(continue_final_message=True, add_generation_prompt=True), "r"
        )
    )
    assert err.param == "continue_final_message"


def test_continue_final_message_leaves_the_assistant_turn_open(preprocessor: Preprocessor) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    text = preprocessor.render_chat(chat_request(messages=messages, continue_final_message=True))
    assert text.endswith("Hello, I am")


def test_completion_prompt_forms(preprocessor: Preprocessor, tokenizer: Any) -> None:
    ids = tokenizer.backend_tokenizer.encode("Once upon a time", add_special_tokens=False).ids
    assert preprocessor.prepare_completion_sync(completion_request(), "r").request.token_ids == ids
    assert (
        preprocessor.prepare_completion_sync(completion_request(prompt=ids), "r").request.token_ids
        == ids
    )
    assert (
        preprocessor.prepare_completion_sync(
            completion_request(prompt=[ids]), "r"
        ).request.token_ids
        == ids
    )
    one = preprocessor.prepare_completion_sync(completion_request(prompt=["Once upon a time"]), "r")
    assert one.request.token_ids == ids


@pytest.mark.parametrize(
    "prompt",
    [[], "", ["a", "b"], [[1], [2]], [10**9]],
    ids=["empty-list", "empty-string", "two-prompts", "two-id-lists", "out-of-vocab"],
)
def test_bad_prompts_are_400_naming_prompt(preprocessor: Preprocessor, prompt: Any) -> None:
    err = openai_error_of(
        lambda: preprocessor.prepare_completion_sync(completion_request(prompt=prompt), "r")
    )
    assert (err.status, err.param) == (400, "prompt")


def test_context_length_default_and_limits(tokenizer: Any) -> None:
    pre = Preprocessor(make_card(context_length=64), tokenizer)
    prepared = pre.prepare_completion_sync(completion_request(), "r")
    prompt_len = len(prepared.request.token_ids)
    assert prepared.request.stop_conditions.max_tokens == 64 - prompt_len

    exact = pre.prepare_completion_sync(completion_request(max_tokens=64 - prompt_len), "r")
    assert exact.request.stop_conditions.max_tokens == 64 - prompt_len

    err = openai_error_of(
        lambda: pre.prepare_completion_sync(completion_request(max_tokens=65 - prompt_len), "r")
    )
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert "64" in err.message

    err = openai_error_of(
        lambda: pre.prepare_completion_sync(completion_request(prompt="word " * 100), "r")
    )
    assert (err.status, err.param) == (400, "prompt")

    err = openai_error_of(
        lambda: pre.prepare_chat_sync(chat_request(max_completion_tokens=1000), "r")
    )
    assert err.param == "max_completion_tokens"


def test_unknown_context_length_leaves_max_tokens_to_the_worker(tokenizer: Any) -> None:
    pre = Preprocessor(make_card(context_length=0), tokenizer)
    assert (
        pre.prepare_completion_sync(completion_request(), "r").request.stop_conditions.max_tokens
        is None
    )


def test_sampling_stop_and_output_options_are_mapped(preprocessor: Preprocessor) -> None:
    req = chat_request(
        max_tokens=10,
        max_completion_tokens=20,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        stop=["END", "", "END", "STOP"],
        stop_token_ids=[5, 6],
        min_tokens=2,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    prepared = preprocessor.prepare_chat_sync(req, "r")
    wire, plan = prepared.request, prepared.plan
    s = wire.sampling_options
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.05, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, 0.2, 1.1)
    c = wire.stop_conditions
    assert c.max_tokens == 20  # max_completion_tokens wins
    assert (c.min_tokens, c.stop, c.stop_token_ids, c.ignore_eos) == (
        2,
        ["END", "STOP"],
        [5, 6],
        False,
    )
    assert wire.output_options.logprobs == 3
    assert wire.eos_token_ids == [EOS]
    assert plan.stop_strings == ("END", "STOP")
    assert plan.hidden_stop_ids == frozenset({EOS, 5, 6})
    assert plan.stream and plan.include_usage and plan.logprobs == 3


def test_speculation_turned_off_reaches_the_wire_and_silence_adds_nothing(
    preprocessor: Preprocessor,
) -> None:
    off = preprocessor.prepare_chat_sync(chat_request(speculative_decoding=False), "r")
    assert off.request.sampling_options.speculative_decoding is False
    completion = completion_request(speculative_decoding=False)
    assert (
        preprocessor.prepare_completion_sync(completion, "r").request.sampling_options
    ).speculative_decoding is False
    silent = preprocessor.prepare_chat_sync(chat_request(), "r")
    assert silent.request.sampling_options.speculative_decoding is None


def test_priority_reaches_the_wire_and_defaults_to_vllms_zero(preprocessor: Preprocessor) -> None:
    urgent = preprocessor.prepare_chat_sync(chat_request(priority=-5), "r")
    assert urgent.request.priority == -5
    completion = preprocessor.prepare_completion_sync(completion_request(priority=3), "r")
    assert completion.request.priority == 3
    assert preprocessor.prepare_chat_sync(chat_request(), "r").request.priority == 0


def test_logit_bias_allowed_ids_and_bad_words_reach_the_wire_as_vllm_takes_them(
    preprocessor: Preprocessor,
) -> None:
    """OpenAI's string keys become token ids and each bias is clamped to [-100, 100], as
    `vllm serve` does; the other two pass as sent."""
    fields = {
        "logit_bias": {"5": 150.0, "6": -0.5, "7": -1000},
        "allowed_token_ids": [5, 6, 7],
        "bad_words": ["Paris", "London"],
    }
    for prepared in (
        preprocessor.prepare_chat_sync(chat_request(**fields), "r"),
        preprocessor.prepare_completion_sync(completion_request(**fields), "r"),
    ):
        options = prepared.request.sampling_options
        assert options.logit_bias == {5: 100.0, 6: -0.5, 7: -100.0}
        assert options.allowed_token_ids == [5, 6, 7]
        assert options.bad_words == ["Paris", "London"]
    silent = preprocessor.prepare_chat_sync(chat_request(logit_bias={}), "r").request
    assert silent.sampling_options.logit_bias is None


def test_ignore_eos_keeps_eos_text_visible(preprocessor: Preprocessor) -> None:
    prepared = preprocessor.prepare_completion_sync(completion_request(ignore_eos=True), "r")
    assert prepared.request.stop_conditions.ignore_eos is True
    assert EOS not in prepared.plan.hidden_stop_ids


def test_completion_logprobs_and_echo(preprocessor: Preprocessor) -> None:
    prepared = preprocessor.prepare_completion_sync(completion_request(logprobs=2, echo=True), "r")
    assert prepared.request.output_options.logprobs == 2
    assert prepared.plan.echo_text == "Once upon a time"
    plain = preprocessor.prepare_completion_sync(completion_request(), "r")
    assert plain.request.output_options.logprobs is None
    assert plain.plan.echo_text is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 17}, "n"),
        ({"top_k": -5}, "top_k"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"allowed_token_ids": [5, 10**7]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"10000000": 1.0}}, "logit_bias"),
        ({"logit_bias": {"hello": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
        ({"bad_words": ["fine", ""]}, "bad_words"),
    ],
)
def test_invalid_options_are_400_naming_the_field(
    preprocessor: Preprocessor, fields: dict[str, Any], param: str
) -> None:
    err = openai_error_of(lambda: preprocessor.prepare_chat_sync(chat_request(**fields), "r"))
    assert (err.status, err.param) == (400, param)


def test_eos_ids_fall_back_to_the_tokenizer_when_the_card_has_none(tokenizer: Any) -> None:
    pre = Preprocessor(make_card(eos_token_ids=[]), tokenizer)
    assert pre.eos_token_ids == (tokenizer.eos_token_id,)


async def test_large_prompts_are_tokenized_off_the_event_loop(
    preprocessor: Preprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    pre = Preprocessor(make_card(context_length=100_000), preprocessor.tokenizer)
    original = pre.prepare_completion_sync

    def recording(req: CompletionRequest, request_id: str, *args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(req, request_id, *args)

    monkeypatch.setattr(preprocessor_module, "LARGE_INPUT_CHARS", 100)
    monkeypatch.setattr(pre, "prepare_completion_sync", recording)
    await pre.prepare_completion(completion_request(prompt="short"), "a")
    await pre.prepare_completion(completion_request(prompt="long text " * 50), "b")
    main = threading.main_thread().name
    assert threads[0] == main
    assert threads[1] != main
