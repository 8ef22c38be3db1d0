"""The schedule chosen from a speculation profile: goodput, interpolation, validation."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from dynamo.llm.speculation_profile import (
    ProfileError,
    SpeculationProfile,
    StepTimes,
    check_schedule_fits,
    choose_schedule,
    goodput,
    goodput_without_speculation,
    k_for_batch,
    load_profile,
    save_profile,
    step_time,
    tokens_per_step,
)


def synthetic(
    step_times: dict[int, list[float]],
    acceptance: list[float],
    batch_sizes: list[int],
    max_batch_size: int | None = None,
) -> SpeculationProfile:
    profile = SpeculationProfile(
        model="m",
        method="ngram",
        speculative_config={"method": "ngram"},
        batch_sizes=batch_sizes,
        acceptance_per_position=acceptance,
        step_times=[StepTimes(k=k, step_ms=ms) for k, ms in sorted(step_times.items())],
        schedule=[[1, 1, 0]],
        max_batch_size=max_batch_size or batch_sizes[-1],
    )
    return msgspec.structs.replace(profile, schedule=choose_schedule(profile))


# A CPU-like engine: cheap at batch 1, each draft costs more as the batch grows.
CPU_LIKE = synthetic(
    {0: [10.0, 12.0, 20.0, 40.0], 1: [11.0, 15.0, 32.0, 72.0], 2: [12.0, 18.0, 44.0, 104.0]},
    acceptance=[0.7, 0.5],
    batch_sizes=[1, 4, 16, 32],
)


def test_tokens_per_step_adds_the_bonus_token_and_the_rates_of_reached_positions() -> None:
    assert tokens_per_step([0.7, 0.5, 0.2], 0) == 1.0
    assert tokens_per_step([0.7, 0.5, 0.2], 2) == pytest.approx(2.2)
    with pytest.raises(ProfileError, match="K=4"):
        tokens_per_step([0.7, 0.5, 0.2], 4)
    # n-gram drafts only where the context matches: a third of the steps carry a draft.
    assert tokens_per_step([0.6, 0.3], 2, drafted=1 / 3) == pytest.approx(1.3)


def test_steps_without_drafts_make_speculation_worth_less() -> None:
    sparse = msgspec.structs.replace(CPU_LIKE, drafted_fraction=0.25)
    assert goodput(sparse, 1, 4) == pytest.approx(4 * (1 + 0.25 * 0.7) * 1000 / 15.0)
    assert goodput(sparse, 0, 4) == goodput(CPU_LIKE, 0, 4)
    # Speculation stops paying at a smaller batch.
    assert choose_schedule(sparse)[-1][0] < CPU_LIKE.schedule[-1][0]
    assert choose_schedule(sparse)[-1][2] == 0


def test_step_time_interpolates_between_points_flat_below_and_extends_beyond() -> None:
    sizes, ms = [2, 4, 8], [10.0, 20.0, 30.0]
    assert step_time(sizes, ms, 4) == 20.0
    assert step_time(sizes, ms, 3) == pytest.approx(15.0)
    assert step_time(sizes, ms, 6) == pytest.approx(25.0)
    assert step_time(sizes, ms, 1) == 10.0  # below the smallest: flat
    assert step_time(sizes, ms, 16) == pytest.approx(50.0)  # last slope: 2.5 ms per sequence
    assert step_time([4], [7.0], 32) == 7.0


def test_goodput_is_tokens_per_second_of_the_whole_batch() -> None:
    # batch 4, K=1: 4 sequences x 1.7 tokens per 15 ms step.
    assert goodput(CPU_LIKE, 1, 4) == pytest.approx(4 * 1.7 * 1000 / 15.0)
    assert goodput(CPU_LIKE, 0, 16) == pytest.approx(16 * 1000 / 20.0)
    # Without a plain-engine measurement, K=0 stands for it; with one, that is used.
    assert goodput_without_speculation(CPU_LIKE, 16) == goodput(CPU_LIKE, 0, 16)
    plain = msgspec.structs.replace(CPU_LIKE, no_speculation_step_ms=[8.0, 10.0, 16.0, 32.0])
    assert goodput_without_speculation(plain, 16) == pytest.approx(16 * 1000 / 16.0)


def test_schedule_drafts_more_at_small_batches_and_none_where_speculation_loses() -> None:
    schedule = CPU_LIKE.schedule
    assert schedule[0][:2] == [1, schedule[0][1]] and schedule[0][2] == 2
    assert schedule[-1][1] == 32 and schedule[-1][2] == 0
    ks = [k for _, _, k in schedule]
    assert ks == sorted(ks, reverse=True)  # K only falls as the batch grows
    # Every batch size gets the K of highest goodput.
    for batch in range(1, 33):
        chosen = k_for_batch(schedule, batch)
        assert all(
            goodput(CPU_LIKE, chosen, batch) >= goodput(CPU_LIKE, k, batch) for k in (0, 1, 2)
        )
    # Ranges tile 1..max_batch_size with no gaps.
    assert [lo for lo, _, _ in schedule[1:]] == [hi + 1 for _, hi, _ in schedule[:-1]]


def test_a_tie_goes_to_the_smaller_k() -> None:
    flat = synthetic({0: [10.0], 1: [15.0]}, acceptance=[0.5], batch_sizes=[1])
    assert flat.schedule == [[1, 1, 0]]


def test_speculation_that_never_pays_gives_k_zero_everywhere() -> None:
    useless = synthetic({0: [10.0, 20.0], 1: [12.0, 30.0]}, acceptance=[0.05], batch_sizes=[1, 8])
    assert useless.schedule == [[1, 8, 0]]


def test_schedule_extends_to_the_engines_max_batch_size_by_extrapolation() -> None:
    profile = synthetic(
        {0: [10.0, 20.0], 1: [11.0, 26.0]}, acceptance=[0.4], batch_sizes=[1, 8], max_batch_size=64
    )
    # K=1 beats K=0 at batch 1 (1.4/11 > 1/10) and loses at 8 (1.4/26 < 1/20).
    assert profile.schedule[0][2] == 1
    assert profile.schedule[-1] == [profile.schedule[-1][0], 64, 0]
    assert choose_schedule(profile, 16)[-1][1] == 16


def test_k_for_batch_carries_the_last_range_on() -> None:
    schedule = [[1, 4, 3], [5, 16, 1], [17, 32, 0]]
    assert [k_for_batch(schedule, b) for b in (0, 1, 4, 5, 16, 17, 100)] == [3, 3, 3, 1, 1, 0, 0]


def test_check_schedule_fits_names_both_numbers_and_the_fixes() -> None:
    check_schedule_fits([[1, 4, 3], [5, 8, 0]], 3, "worker")
    check_schedule_fits([[1, 4, 3]], None, "worker")
    with pytest.raises(ProfileError, match=r"K=3 but num_speculative_tokens=2.*--max-k 2"):
        check_schedule_fits([[1, 4, 3], [5, 8, 0]], 2, "worker")


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile(CPU_LIKE, path)
    assert load_profile(path) == CPU_LIKE
    assert json.loads(path.read_text())["schedule"] == CPU_LIKE.schedule


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_sizes": [4, 1, 16, 32]}, "increasing"),
        ({"step_times": [{"k": 1, "step_ms": [1.0, 1.0, 1.0, 1.0]}]}, "K = 0, 1"),
        ({"step_times": [{"k": 0, "step_ms": [1.0]}, {"k": 1, "step_ms": [1.0]}]}, "one positive"),
        ({"acceptance_per_position": [0.5]}, "acceptance has 1 positions"),
        ({"schedule": [[1, 32, 5]]}, "outside 0..2"),
        ({"schedule": []}, "no schedule"),
        ({"version": 99}, "profile version 99"),
        ({"drafted_fraction": 0.0}, "drafted_fraction must be in"),
        ({"no_speculation_step_ms": [10.0]}, "no_speculation_step_ms: need one positive"),
    ],
)
def test_load_refuses_profiles_that_cannot_describe_an_engine(
    tmp_path: Path, change: dict, message: str
) -> None:
    raw = json.loads(msgspec.json.encode(CPU_LIKE)) | change
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_load_names_the_file_when_it_is_missing_or_not_a_profile(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"cannot read speculation profile .*missing\.json"):
        load_profile(tmp_path / "missing.json")
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"model": 1}')
    with pytest.raises(ProfileError, match=r"garbled\.json is not a speculation profile"):
        load_profile(garbled)
