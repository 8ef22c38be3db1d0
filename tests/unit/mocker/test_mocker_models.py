"""The mocker's small models: acceptance, step time, generated tokens, engine config."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from dynamo.mocker import AcceptanceModel, MockEngineConfig, TimingModel
from dynamo.mocker.tokens import TokenSampler, request_seed


def test_per_position_rates_give_the_leading_run_distribution() -> None:
    model = AcceptanceModel.from_rates([0.5], 2)
    assert model.probabilities == pytest.approx((0.5, 0.25, 0.25))
    assert model.mean_acceptance_length == pytest.approx(1.75)
    assert model.per_position_rates() == pytest.approx([0.5, 0.25])
    varied = AcceptanceModel.from_rates([0.9, 0.5, 0.0], 3)
    assert varied.probabilities == pytest.approx((0.1, 0.45, 0.45, 0.0))


def test_sampling_matches_the_distribution() -> None:
    model = AcceptanceModel.from_distribution([1, 0, 3], 2)
    rng = random.Random(1)
    draws = [model.sample(rng) for _ in range(20000)]
    assert 1 not in draws
    assert draws.count(2) / len(draws) == pytest.approx(0.75, abs=0.02)
    assert AcceptanceModel.from_rates([1.0], 3).sample(rng) == 3
    assert AcceptanceModel.from_rates([0.0], 3).sample(rng) == 0
    assert AcceptanceModel.none().sample(rng) == 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: AcceptanceModel.from_rates([0.5, 0.5], 3), "1 or 3"),
        (lambda: AcceptanceModel.from_rates([1.5], 2), "in \\[0, 1\\]"),
        (lambda: AcceptanceModel.from_distribution([1, 1], 2), "needs 3 weights"),
        (lambda: AcceptanceModel.from_distribution([0, 0, 0], 2), "not all be 0"),
    ],
)
def test_bad_acceptance_settings(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_step_time_grows_with_batch_prefill_and_k() -> None:
    timing = TimingModel(
        prefill_ms_per_token=0.1,
        decode_ms_per_step=10.0,
        decode_ms_per_token=0.5,
        draft_ms_per_token=1.0,
        speed_up=2.0,
    )
    assert timing.step_ms(0, 1, 0) == pytest.approx(10.5)
    assert timing.step_ms(0, 8, 0) == pytest.approx(14.0)
    assert timing.step_ms(0, 8, 3) == pytest.approx(10 + 0.5 * 32 + 3)
    assert timing.step_ms(100, 0, 3) == pytest.approx(20.0)  # no decode: no drafting
    assert timing.step_seconds(100, 0, 3) == pytest.approx(0.010)
    assert timing.inter_token_ms(1, 2.0, 1) == pytest.approx((10 + 1 + 1) / 2 / 2)
    with pytest.raises(ValueError):
        TimingModel(speed_up=0)
    with pytest.raises(ValueError):
        TimingModel(decode_ms_per_step=-1)


def test_sampler_draws_prompt_words_and_never_special_tokens() -> None:
    prompt = [1, 50, 60, 2, 70, 50]
    sampler = TokenSampler(prompt, random.Random(0), vocab_size=100, excluded={0, 1, 2})
    drawn = [sampler.next_token() for _ in range(200)]
    assert set(drawn) == {50, 60, 70}
    assert sampler.next_token(forbidden={50, 60}) == 70
    assert sampler.alternatives(5, 50) == [60, 70]
    only_special = TokenSampler([1, 2], random.Random(0), vocab_size=10, excluded={0, 1, 2})
    assert all(3 <= only_special.next_token() < 10 for _ in range(50))


def test_request_seed_mixes_engine_seed_request_seed_and_prompt() -> None:
    base = request_seed(0, None, [5, 6])
    assert base == request_seed(0, None, [5, 6])
    assert len({base, request_seed(1, None, [5, 6]), request_seed(0, 3, [5, 6])}) == 3
    assert request_seed(0, None, [5, 7]) != base


def test_engine_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        MockEngineConfig(block_size=16, num_gpu_blocks=10, max_model_len=4096)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        MockEngineConfig(num_speculative_tokens=4, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="acceptance model is for K=2"):
        MockEngineConfig(num_speculative_tokens=3, acceptance=AcceptanceModel.from_rates([0.5], 2))
    default = MockEngineConfig(num_speculative_tokens=2)
    assert default.acceptance_model.probabilities == pytest.approx((0.3, 0.21, 0.49))
