"""The online K chooser (`dynamo.vllm.speculative.adaptive_k`): warm-up from the profile,
the decaying window, ties and the margin, K = 0 and its probe, empty windows, and step
times far from the profile's."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.llm.speculation_profile import SpeculationProfile, StepTimes
from dynamo.vllm.speculative.adaptive_k import (
    BASELINE_STEPS,
    UPWARD_STEPS,
    AdaptationError,
    AdaptationSettings,
    AdaptiveK,
)
from dynamo.vllm.speculative.step_cost import RATIO_BOUNDS, batch_bucket, monotone_fit

# A CPU-like engine: a draft is cheap at batch 1 and costs more as the batch grows; the
# plain engine (no drafter) is what a free K = 0 costs.
PROFILE = SpeculationProfile(
    model="m",
    method="eagle3",
    speculative_config={"method": "eagle3"},
    batch_sizes=[1, 4, 16, 32],
    acceptance_per_position=[0.7, 0.5, 0.35],
    step_times=[
        StepTimes(k=0, step_ms=[11.0, 13.5, 22.0, 44.0]),
        StepTimes(k=1, step_ms=[12.0, 16.0, 34.0, 76.0]),
        StepTimes(k=2, step_ms=[13.0, 19.0, 46.0, 108.0]),
        StepTimes(k=3, step_ms=[14.0, 22.0, 58.0, 140.0]),
    ],
    no_speculation_step_ms=[10.0, 12.0, 20.0, 40.0],
    schedule=[[1, 4, 3], [5, 32, 0]],
    max_batch_size=32,
)
FAST = AdaptationSettings(window_steps=20, warmup_drafts=50, probe_every=5)


def feed_acceptance(chooser: AdaptiveK, rates: list[float], steps: int, batch: int = 4) -> None:
    """`steps` verification steps of `batch` sequences at the chooser's max K whose
    position i is accepted at `rates[i]` (vLLM's per-position rates; counts rounded as a
    batch would give them): a position is reached by the drafts accepted up to it."""
    for _ in range(steps):
        accepted = [round(batch * r) for r in rates]
        reached = [batch, *accepted[:-1]]
        chooser.observe_verification(reached, accepted, batch, batch)


def test_before_any_traffic_the_choice_is_the_profiles() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    assert chooser.best(1) == 3
    assert chooser.best(32) == 0
    assert chooser.acceptance.rates() == pytest.approx([0.7, 0.5, 0.35])


def test_low_live_acceptance_drives_k_to_zero_and_high_brings_it_back() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    feed_acceptance(chooser, [0.0, 0.0, 0.0], steps=60)
    assert chooser.best(1) == 0
    feed_acceptance(chooser, [1.0, 1.0, 1.0], steps=60)
    assert chooser.best(1) == 3
    assert chooser.best(16) > 0  # acceptance far above the profile's pays at larger batches


def test_the_warm_up_weighs_the_profile_against_the_first_live_steps() -> None:
    slow = AdaptiveK(PROFILE, max_k=3, settings=AdaptationSettings(warmup_drafts=10_000))
    fast = AdaptiveK(PROFILE, max_k=3, settings=AdaptationSettings(warmup_drafts=0))
    for chooser in (slow, fast):
        feed_acceptance(chooser, [0.0, 0.0, 0.0], steps=5)
    assert slow.acceptance.rates()[0] > 0.69  # five steps barely move 10,000 drafts
    assert fast.acceptance.rates()[0] == 0.0  # no prior: the live counts are all there is


def test_the_window_forgets_old_traffic() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    feed_acceptance(chooser, [1.0, 1.0, 1.0], steps=200)
    feed_acceptance(chooser, [0.25, 0.0, 0.0], steps=200)
    assert chooser.acceptance.rates()[0] == pytest.approx(0.25, abs=0.01)


def test_a_later_position_never_accepts_more_than_an_earlier_one() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=AdaptationSettings(warmup_drafts=0))
    # Position 1 reached twice and accepted both times; position 2 never reached: it
    # borrows position 1's conditional rate.
    chooser.observe_verification([10, 2, 0], [5, 2, 0], 10, 10)
    assert chooser.acceptance.rates() == [0.5, 0.5, 0.5]


def test_positions_the_k_in_force_does_not_reach_follow_the_earlier_ones() -> None:
    """Traffic that accepted nothing, then predictable traffic drafted at K = 1 only:
    position 0's rise lifts positions 1 and 2 by their conditional rates (the profile's,
    0.5 / 0.7 and 0.35 / 0.5), so K can climb back past 1."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    feed_acceptance(chooser, [0.0, 0.0, 0.0], steps=60)
    assert chooser.best(1) == 0
    for _ in range(60):
        chooser.observe_verification([4, 0, 0], [4, 0, 0], 4, 4)  # K = 1, all accepted
    rates = chooser.acceptance.rates()
    assert rates[0] > 0.95  # what is left of the zeros after 60 steps of a 20-step window
    assert rates[1] == pytest.approx(rates[0] * 0.5 / 0.7)
    assert rates[2] == pytest.approx(rates[0] * 0.35 / 0.7)
    assert chooser.best(1) == 3


def test_steps_without_drafts_leave_the_estimate_where_it_was() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=AdaptationSettings(warmup_drafts=0))
    assert chooser.acceptance.rates() == [0.0, 0.0, 0.0]  # nothing known: no gain assumed
    assert chooser.best(1) == 0
    chooser.observe_verification([4, 4, 3], [4, 3, 2], 4, 4)
    before = chooser.acceptance.rates()
    for _ in range(30):
        chooser.observe_verification([0, 0, 0], [0, 0, 0], 0, 0)
    assert chooser.acceptance.rates() == pytest.approx(before)


def test_n_gram_steps_that_found_no_match_lower_the_drafted_fraction() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=AdaptationSettings(warmup_drafts=0))
    for _ in range(10):
        chooser.observe_verification([1, 1, 1], [1, 1, 1], 4, 1)
    assert chooser.acceptance.drafted_fraction() == pytest.approx(0.25)
    assert chooser.acceptance.tokens_per_step(3) == pytest.approx(1.75)


def test_k_above_zero_must_beat_k_zero_by_the_margin_and_ties_go_to_the_smaller_k() -> None:
    # One draft at rate r gains (1 + r) tokens for a step 20% dearer: break-even at 0.2.
    flat = msgspec.structs.replace(
        PROFILE,
        batch_sizes=[1],
        acceptance_per_position=[0.2, 0.0, 0.0],
        step_times=[StepTimes(k=k, step_ms=[10.0 + 2.0 * k]) for k in range(4)],
        no_speculation_step_ms=[10.0],
        schedule=[[1, 1, 0]],
        max_batch_size=1,
    )
    exact = AdaptiveK(flat, max_k=3, settings=AdaptationSettings(margin=0.0))
    assert exact.best(1) == 0  # K = 1 only ties K = 0
    flat_better = msgspec.structs.replace(flat, acceptance_per_position=[0.23, 0.0, 0.0])
    assert AdaptiveK(flat_better, 3, AdaptationSettings(margin=0.0)).best(1) == 1
    assert AdaptiveK(flat_better, 3, AdaptationSettings(margin=0.03)).best(1) == 0


def test_after_a_run_at_k_zero_one_step_probes_with_one_draft() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    chosen = [chooser.choose(32) for _ in range(12)]
    assert chosen == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]
    assert chooser.choose(0) == 0  # nothing to decode: nothing to probe


def test_measured_step_times_correct_the_profile() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    assert chooser.best(4) == 3
    # Served, every drafting step costs twice the profile's; a step without drafts as much.
    for _ in range(40):
        for k in (1, 2, 3):
            chooser.observe_step(k, 4, 2 * chooser.cost.profiled_ms(k, 4))
        chooser.observe_step(0, 4, chooser.cost.profiled_ms(0, 4))
    assert chooser.cost.correction(2) == pytest.approx(2.0)
    assert chooser.best(4) == 0


def test_step_time_corrections_are_kept_per_batch_size() -> None:
    """Served drafting costs the profile's time at 4 sequences and half as much again at
    32: K = 1 stays priced right at 4 and loses its edge at 32, and 64 (never measured)
    takes the nearest bucket's ratio, 32's."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    for _ in range(40):
        for k in (0, 1, 2, 3):
            chooser.observe_step(k, 4, chooser.cost.profiled_ms(k, 4))
            slower = 1.5 if k else 1.0
            chooser.observe_step(k, 32, slower * chooser.cost.profiled_ms(k, 32))
    assert chooser.cost.correction(1, 4) == pytest.approx(1.0)
    assert chooser.cost.correction(1, 32) == pytest.approx(1.5)
    assert chooser.cost.correction(1, 64) == pytest.approx(1.5)
    assert chooser.cost.correction(1, 8) == pytest.approx(1.0)  # bucket 4 is nearer
    assert chooser.cost.correction(1) == pytest.approx(1.25)  # every bucket, weighted
    assert chooser.cost.correction(0, 32) == pytest.approx(1.0)
    assert chooser.best(4) == 3
    assert chooser.best(32) < chooser.best(4)


def test_an_unmeasured_k_borrows_the_mean_correction() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    assert chooser.cost.correction(2) == 1.0
    chooser.observe_step(0, 1, 3 * chooser.cost.profiled_ms(0, 1))
    chooser.observe_step(1, 1, 1 * chooser.cost.profiled_ms(1, 1))
    assert chooser.cost.correction(3) == pytest.approx(2.0)


def test_extreme_or_invalid_step_times_do_not_break_the_choice() -> None:
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    chooser.observe_step(1, 4, 0.0)  # ignored
    chooser.observe_step(1, 0, 5.0)  # ignored
    assert chooser.cost.correction(1) == 1.0
    chooser.observe_step(3, 4, 1e9)  # a stall (the machine was busy) counts at the bound
    assert chooser.cost.correction(3) == RATIO_BOUNDS[1]
    # The other drafting Ks borrow it; K = 0 keeps the profile's time until measured.
    assert chooser.cost.correction(1) == RATIO_BOUNDS[1]
    assert chooser.cost.correction(0) == 1.0
    assert chooser.best(4) == 0
    for _ in range(20):  # steps at K = 3 as the profile says outweigh the one stall
        chooser.observe_step(3, 4, chooser.cost.profiled_ms(3, 4))
    assert chooser.cost.correction(3) < 1.3
    assert chooser.best(4) == 3


def test_acceptance_only_mode_keeps_the_profiles_step_times() -> None:
    chooser = AdaptiveK(PROFILE, 3, AdaptationSettings(adapt_step_times=False))
    chooser.observe_step(1, 4, 1000.0)
    assert chooser.cost.correction(1) == 1.0


def test_k_is_capped_by_the_engine_and_without_a_free_k0_the_drafter_is_paid_for() -> None:
    capped = AdaptiveK(PROFILE, max_k=1)
    assert capped.best(1) == 1
    assert capped.acceptance.rates() == pytest.approx([0.7])
    paid = AdaptiveK(PROFILE, max_k=3, free_k0=False)
    assert paid.cost.profiled_ms(0, 1) == 11.0
    assert AdaptiveK(PROFILE, max_k=3).cost.profiled_ms(0, 1) == 10.0


@pytest.mark.parametrize(
    "settings",
    [
        {"window_steps": 0},
        {"warmup_drafts": -1},
        {"margin": 1.0},
        {"probe_every": 0},
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict) -> None:
    with pytest.raises(AdaptationError):
        AdaptationSettings(**settings)


def test_an_engine_without_drafts_has_nothing_to_adapt() -> None:
    with pytest.raises(AdaptationError, match="nothing to adapt"):
        AdaptiveK(PROFILE, max_k=0)


def test_a_k_that_measured_cheaper_than_a_smaller_one_costs_as_much_as_it() -> None:
    """Noise: K = 1 measured 10% under the profile, K = 0 10% over. K = 1 must not look
    cheaper than K = 0, or acceptance near 0 would keep drafting (seen with n-gram)."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST, free_k0=False)
    feed_acceptance(chooser, [0.02, 0.0, 0.0], steps=60)
    for _ in range(30):
        chooser.observe_step(0, 4, 1.1 * chooser.cost.profiled_ms(0, 4))
        chooser.observe_step(1, 4, 0.9 * chooser.cost.profiled_ms(1, 4))
    cost = chooser.cost
    assert cost.step_ms(1, 4) >= cost.step_ms(0, 4)
    assert chooser.best(4) == 0


def test_a_probe_after_a_run_at_k_zero_speaks_for_the_traffic_of_now() -> None:
    """Steps at K = 0 fade what was measured before them, so once traffic turns
    predictable the first probes that find their drafts accepted bring K back."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    feed_acceptance(chooser, [0.0, 0.0, 0.0], steps=60)
    chosen = []
    for _ in range(3 * FAST.probe_every):
        k = chooser.choose(4)
        chosen.append(k)
        if k > 0:  # every draft of the step accepted
            chooser.observe_verification([4] * k + [0] * (3 - k), [4] * k + [0] * (3 - k), 4, 4)
    assert chosen[: FAST.probe_every] == [0] * (FAST.probe_every - 1) + [1]
    assert chosen[-1] == 3


def test_k0_not_measured_yet_keeps_the_profiles_time() -> None:
    """A worker that only ran K = 3 measured it at 1.5x the profile (served steps cost
    more). K = 0 is priced at the profile, not at the borrowed 1.5x: speculation then
    loses where the profile's margin was thinner than what serving adds, K = 0 runs and is
    measured, and from then on its own ratio decides."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    assert chooser.best(4) == 3  # the profile: K = 3 pays at batch 4
    for _ in range(30):
        chooser.observe_step(3, 4, 1.5 * chooser.cost.profiled_ms(3, 4))
    assert chooser.cost.correction(0) == 1.0
    assert chooser.cost.correction(1) == pytest.approx(1.5)  # a drafting K borrows the mean
    assert chooser.best(4) == 0
    for _ in range(30):  # K = 0 served costs 1.5x too: the profile's comparison stands
        chooser.observe_step(0, 4, 1.5 * chooser.cost.profiled_ms(0, 4))
    assert chooser.best(4) == 3


def test_steps_that_draft_are_followed_now_and_then_by_two_at_k0_to_measure_it() -> None:
    """With step times adapting, K = 0 is measured by the same clock as the Ks that run:
    after `probe_every` steps in a row that draft, two at K = 0 (the second verifies and
    drafts nothing). Without step-time adaptation there is nothing to measure."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    chosen = [chooser.choose(1) for _ in range(2 * (FAST.probe_every + 2))]
    assert chosen == ([3] * FAST.probe_every + [0, 0]) * 2
    acceptance_only = AdaptiveK(
        PROFILE,
        max_k=3,
        settings=AdaptationSettings(
            window_steps=20, warmup_drafts=50, probe_every=5, adapt_step_times=False
        ),
    )
    assert [acceptance_only.choose(1) for _ in range(14)] == [3] * 14


def test_below_the_largest_k_every_other_measurement_run_probes_the_next_k_up() -> None:
    """Drafting at K = 1 (the largest K that pays by the estimate), runs of `probe_every`
    steps end in turn with the two steps at K = 0 and with UPWARD_STEPS at K = 2: a K
    never chosen is measured all the same."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    for _ in range(30):  # K = 2 and 3 measured dear at one sequence: K = 1 is best there
        for k, ratio in ((0, 1.0), (1, 1.0), (2, 1.6), (3, 1.6)):
            chooser.observe_step(k, 1, ratio * chooser.cost.profiled_ms(k, 1))
    assert chooser.best(1) == 1
    steps = 2 * FAST.probe_every + BASELINE_STEPS + UPWARD_STEPS
    chosen = [chooser.choose(1) for _ in range(steps)]
    assert chosen == (
        [1] * FAST.probe_every + [0] * BASELINE_STEPS + [1] * FAST.probe_every + [2] * UPWARD_STEPS
    )


def serve_steps(chooser: AdaptiveK, batch: int, served_ratio: list[float], steps: int) -> list[int]:
    """`steps` steps of `batch` sequences, the chooser's K each, timed as the scheduler
    times them: a step is measured (at `served_ratio[k]` of the profile) only when the
    drafts it verified were as many as it drafts, that is after a step at the same K."""
    chosen: list[int] = []
    for _ in range(steps):
        k = chooser.choose(batch)
        if chosen and chosen[-1] == k:
            chooser.observe_step(k, batch, served_ratio[k] * chooser.cost.profiled_ms(k, batch))
        chosen.append(k)
    return chosen


def test_a_larger_k_priced_from_another_batch_size_is_measured_and_climbed_to() -> None:
    """The trap Eagle3 fell into at one sequence: K = 2 and 3 measured only in warm-up
    steps at 4 sequences, at 2x the profile, beside K = 0 at 1x; at one sequence K = 0
    and K = 1 served at 0.88x and 0.9x, so K = 2 and 3 are priced there at 0.88 x 2 of
    the profile and K = 1 wins, while served they cost 0.85x and 0.8x. Measured by the
    upward probes, K climbs to 3, where the goodput is."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    for _ in range(5):
        for k, ratio in ((0, 1.0), (1, 1.0), (2, 2.0), (3, 2.0)):
            chooser.observe_step(k, 4, ratio * chooser.cost.profiled_ms(k, 4))
    served = [0.88, 0.9, 0.85, 0.8]
    for k in (0, 1):
        for _ in range(30):
            chooser.observe_step(k, 1, served[k] * chooser.cost.profiled_ms(k, 1))
    assert chooser.best(1) == 1
    chosen = serve_steps(chooser, 1, served, 200)
    assert chooser.best(1) == 3
    # By then: K = 3, and the steps at K = 0 that keep it measured (2 in every 7 here).
    tail = chosen[-100:]
    assert set(tail) == {0, 3}
    assert tail.count(3) >= 70


def test_served_drafting_never_costs_less_beside_k0_than_the_profile_says() -> None:
    """Served steps that measure below the profile's at every drafting K (0.6x here), K = 0
    not measured yet: drafting is still priced at least the profile's excess over K = 0
    (serving adds contention, it does not take compute away), so K = 0 keeps 16 sequences
    as the profile says; measured at 0.6x too, the comparison is the profile's."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    assert chooser.best(16) == 0
    for _ in range(2):  # a probe's few steps, a fifth of half a window here
        for k in (1, 2, 3):
            chooser.observe_step(k, 16, 0.6 * chooser.cost.profiled_ms(k, 16))
    cost = chooser.cost
    for k in (1, 2, 3):
        floor = cost.step_ms(0, 16) * cost.profiled_ms(k, 16) / 20.0
        assert cost.trust(k, 16) < 0.05
        assert cost.step_ms(k, 16) >= floor * 0.97  # near the floor, not at 0.6x
    assert chooser.best(16) == 0
    for _ in range(30):
        chooser.observe_step(0, 16, 0.6 * chooser.cost.profiled_ms(0, 16))
    assert chooser.best(16) == 0
    assert cost.step_ms(2, 16) == pytest.approx(0.6 * cost.profiled_ms(2, 16))


def test_a_k_not_measured_at_a_batch_size_keeps_its_excess_over_k0_there() -> None:
    """K = 1 measured at 4 sequences at 1.2x the profile beside K = 0 at 1.0x; at 16, only
    K = 0 measured, at 1.5x (served steps cost more with the batch). K = 1 at 16 is priced
    at 1.5 x 1.2, not at 4's 1.2 beside K = 0's 1.5: borrowed alone, drafting would look
    cheap exactly where it costs most."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    for _ in range(30):
        chooser.observe_step(0, 4, chooser.cost.profiled_ms(0, 4))
        chooser.observe_step(1, 4, 1.2 * chooser.cost.profiled_ms(1, 4))
        chooser.observe_step(0, 16, 1.5 * chooser.cost.profiled_ms(0, 16))
    assert chooser.cost.correction(1, 16) == pytest.approx(1.8)
    assert chooser.cost.correction(1, 4) == pytest.approx(1.2)  # measured there: its own
    assert chooser.cost.correction(1, 32) == pytest.approx(1.2)  # K = 0 not measured at 32
    for _ in range(30):  # once K = 1 is measured at 16, its own ratio decides
        chooser.observe_step(1, 16, 1.3 * chooser.cost.profiled_ms(1, 16))
    assert chooser.cost.correction(1, 16) == pytest.approx(1.3)


def test_a_k_not_measured_at_a_small_batch_takes_the_cheaper_of_the_two_estimates() -> None:
    """The other way: K = 1 measured only at 4 sequences (0.98x the profile, beside K = 0
    at 0.81x), K = 0 also at 1 sequence (0.9x). Carried down, both estimates are high
    (served drafting adds less at smaller batches): K = 1's own 0.98 is taken, not
    0.9 x 0.98 / 0.81 = 1.09, which kept n-gram at K = 0 at one sequence where K = 2 paid."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    for _ in range(30):
        chooser.observe_step(0, 4, 0.81 * chooser.cost.profiled_ms(0, 4))
        chooser.observe_step(1, 4, 0.98 * chooser.cost.profiled_ms(1, 4))
        chooser.observe_step(0, 1, 0.9 * chooser.cost.profiled_ms(0, 1))
    assert chooser.cost.correction(1, 1) == pytest.approx(0.98)


def test_a_few_steps_of_one_k_do_not_price_a_larger_k_measured_over_many() -> None:
    """At one sequence: K = 1 over 3 steps at 1.02x the profile (12.24 ms), K = 2 over 100
    steps at 0.82x (10.66 ms). K = 2 measured cheaper than K = 1: both are priced at
    their weighted mean, near K = 2's 100 steps, not at K = 1's few (taking the larger
    kept n-gram at K = 0 where K = 2 paid). K = 0 (0.8x, 8 ms) stays below, and the
    profile's excess over it (K = 2 at 1.3x, 10.4 ms) is below the pooled price."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=AdaptationSettings(window_steps=1000))
    cost = chooser.cost
    for k, ratio, steps in ((0, 0.8, 40), (1, 1.02, 3), (2, 0.82, 100)):
        for _ in range(steps):
            chooser.observe_step(k, 1, ratio * cost.profiled_ms(k, 1))
    assert cost.step_ms(0, 1) == pytest.approx(8.0)
    pooled = cost.step_ms(2, 1)
    assert cost.step_ms(1, 1) == pytest.approx(pooled)
    assert 0.82 * 13.0 < pooled < 0.82 * 13.0 * 1.01
    assert cost.step_ms(3, 1) >= pooled


def test_a_drafting_k_costs_at_least_the_profiles_excess_over_k0() -> None:
    """K = 0 measured at 2.05x the profile at 32 sequences and K = 1 at 1.87x, at other
    moments (seen: K = 1 then looked 4% dearer than K = 0 and ran at 32 sequences where
    drafting served 0.69x). K = 1 is priced at K = 0's served time times the profile's
    excess instead."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    cost = chooser.cost
    for _ in range(30):
        chooser.observe_step(0, 32, 2.05 * cost.profiled_ms(0, 32))
    for _ in range(5):  # a few probe steps, fewer than half a window
        chooser.observe_step(1, 32, 1.87 * cost.profiled_ms(1, 32))
    assert not cost.trusted(1, 32)
    trust = cost.trust(1, 32)
    assert 0.1 < trust < 0.25  # 5 steps (decayed) of 10, squared
    floor, own = 2.05 * cost.profiled_ms(1, 32), 1.87 * cost.profiled_ms(1, 32)
    assert cost.step_ms(1, 32) == pytest.approx(own + (1.0 - trust) * (floor - own))
    assert cost.step_ms(1, 32) > cost.step_ms(0, 32) * 1.0  # still dearer than K = 0


def test_a_drafting_k_run_for_half_a_window_is_priced_at_its_own_measurement() -> None:
    """The profile's excess over K = 0 is one measurement too: at one sequence it put
    Eagle3's K = 3 at 1.31x K = 0 where hundreds of served steps measured 1.16x, and held
    to it K = 3 only tied K = 1. Once K has run half a window of steps at a batch size,
    its own time stands."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    cost = chooser.cost
    for _ in range(30):
        chooser.observe_step(0, 1, 1.0 * cost.profiled_ms(0, 1))
    chooser.observe_step(3, 1, 0.8 * cost.profiled_ms(3, 1))
    # One step: the floor (the profile's excess) all but holds.
    assert cost.step_ms(3, 1) == pytest.approx(cost.profiled_ms(3, 1), rel=0.01)
    for _ in range(3):
        chooser.observe_step(3, 1, 0.8 * cost.profiled_ms(3, 1))
    # Four: it gives way in part (4 of 10 steps, decayed, squared).
    assert 0.8 * cost.profiled_ms(3, 1) < cost.step_ms(3, 1) < 0.99 * cost.profiled_ms(3, 1)
    for _ in range(30):
        chooser.observe_step(3, 1, 0.8 * cost.profiled_ms(3, 1))
    assert cost.trusted(3, 1)
    # Its own time (pooled a little with K = 2's borrowed 0.9x, which weighs one step).
    assert cost.step_ms(3, 1) == pytest.approx(0.8 * cost.profiled_ms(3, 1), rel=0.01)


# The shipped Eagle3 profile's times at one and four sequences (its K = 0 measured with the
# drafter running; the plain engine's is the free K = 0's).
EAGLE3_SMALL_BATCHES = SpeculationProfile(
    model="m",
    method="eagle3",
    speculative_config={"method": "eagle3"},
    batch_sizes=[1, 4],
    acceptance_per_position=[0.43, 0.2, 0.11],
    step_times=[
        StepTimes(k=0, step_ms=[44.0, 47.5]),
        StepTimes(k=1, step_ms=[43.6, 49.0]),
        StepTimes(k=2, step_ms=[52.0, 55.6]),
        StepTimes(k=3, step_ms=[51.1, 54.9]),
    ],
    no_speculation_step_ms=[39.0, 44.1],
    schedule=[[1, 4, 3]],
    max_batch_size=4,
)


def test_a_k_that_ran_most_of_half_a_window_is_mostly_priced_at_its_own_time() -> None:
    """Seen with Eagle3 at one sequence: K = 1 measured at length (0.94x the profile),
    K = 2 over about 90 steps at 0.82x, 1.09x K = 1's time where the profile says 1.19x,
    then held to the whole floor of the profile's excess over K = 0 (1.33x) until half a
    window: K = 1 won, K = 2 ran only in upward probes from then on, and adaptive served
    1.14x no speculation where a static K = 2 served 1.27x. The floor now gives way as
    K's steps add up, and K = 2 keeps the batch."""
    chooser = AdaptiveK(EAGLE3_SMALL_BATCHES, max_k=3)
    cost = chooser.cost
    chooser.observe_step(3, 4, 1.42 * cost.profiled_ms(3, 4))  # one warm-up step at 4
    for k, ratio, steps in ((0, 0.96, 200), (1, 0.94, 300), (2, 0.82, 90)):
        for _ in range(steps):
            chooser.observe_step(k, 1, ratio * cost.profiled_ms(k, 1))
    feed_acceptance(chooser, [0.43, 0.21, 0.11], steps=400, batch=100)
    assert not cost.trusted(2, 1)
    assert 0.4 < cost.trust(2, 1) < 0.7
    assert chooser.best(1) == 2


def test_an_unmeasured_k_is_held_to_the_excess_serving_widened_elsewhere() -> None:
    """Seen entering 16 sequences: neither K had run there; K = 0 was priced from the
    buckets either side, K = 1 from a smaller one, so only the profile's excess over
    K = 0 held K = 1 up, while at the smaller bucket serving had widened that excess
    1.33x; about 75 steps drafted at a loss. The floor of a K not yet trusted carries
    that widening; a narrowing does not lower it."""
    chooser = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    cost = chooser.cost
    for _ in range(30):
        chooser.observe_step(0, 1, 0.9 * cost.profiled_ms(0, 1))
        chooser.observe_step(1, 1, 1.2 * cost.profiled_ms(1, 1))
        chooser.observe_step(0, 16, 2.0 * cost.profiled_ms(0, 16))
    widening = cost.widening(1, batch_bucket(4))
    assert widening == pytest.approx(1.2 / 0.9, rel=0.01)  # from the fitted times at 1
    assert cost.widening(2, batch_bucket(4)) == widening  # K = 2 never ran: K = 1's
    k0 = cost.step_ms(0, 4)
    assert k0 == pytest.approx((0.9 + 2.0) / 2 * cost.profiled_ms(0, 4))  # either side
    profile_excess = cost.profiled_ms(1, 4) / cost.profiled_ms(0, 4)
    assert cost.step_ms(1, 4) == pytest.approx(k0 * profile_excess * widening)
    # One draft accepted 40% of the time pays at the profile's excess (1.33x) but not at
    # the served one (1.78x).
    feed_acceptance(chooser, [0.4, 0.2, 0.1], steps=200)
    assert chooser.best(4) == 0
    narrower = AdaptiveK(PROFILE, max_k=3, settings=FAST)
    for _ in range(30):
        narrower.observe_step(0, 1, 1.0 * narrower.cost.profiled_ms(0, 1))
        narrower.observe_step(1, 1, 0.8 * narrower.cost.profiled_ms(1, 1))
        narrower.observe_step(0, 16, 1.0 * narrower.cost.profiled_ms(0, 16))
    assert narrower.cost.step_ms(1, 4) == pytest.approx(
        narrower.cost.step_ms(0, 4) * profile_excess
    )


@pytest.mark.parametrize(
    ("values", "weights", "fitted"),
    [
        ([1.0, 2.0, 3.0], [1, 1, 1], [1.0, 2.0, 3.0]),  # already non-decreasing
        ([2.0, 1.0], [1, 1], [1.5, 1.5]),
        ([2.0, 1.0], [1, 3], [1.25, 1.25]),  # the better-measured value weighs more
        ([1.0, 3.0, 2.0, 0.0], [1, 1, 1, 1], [1.0, 5 / 3, 5 / 3, 5 / 3]),
    ],
)
def test_the_monotone_fit_pools_what_falls(
    values: list[float], weights: list[float], fitted: list[float]
) -> None:
    assert monotone_fit(values, weights) == pytest.approx(fitted)


def eagle3_at_one_sequence_after_k1(served: list[float]) -> AdaptiveK:
    """Eagle3 at one sequence on the repeat prompts: K = 0 and K = 1 measured at length
    (at `served[k]` of the profile), the acceptance of that traffic, K = 1 chosen."""
    chooser = AdaptiveK(EAGLE3_SMALL_BATCHES, max_k=3)
    for k, steps in ((0, 200), (1, 300)):
        for _ in range(steps):
            chooser.observe_step(k, 1, served[k] * chooser.cost.profiled_ms(k, 1))
    feed_acceptance(chooser, [0.3, 0.15, 0.07], steps=400, batch=100)
    return chooser


def test_a_probed_k_whose_own_steps_pay_goes_on_until_it_is_chosen() -> None:
    """Seen with Eagle3 at one sequence on the repeat prompts: K = 1 measured at length,
    K = 2 served at 0.68x the profile, cheaper than K = 1, but ran only in upward probes
    (two measured steps in a hundred) and stayed held to the profile's excess over K = 0:
    adaptive served 0.93x what the profiled K = 3 did. A probe whose K pays at its own
    measured time now goes on, each step measured, until its floor has given way."""
    served = [0.96, 0.94, 0.68, 0.7]
    chooser = eagle3_at_one_sequence_after_k1(served)
    assert chooser.best(1) == 1
    chosen = serve_steps(chooser, 1, served, 400)
    assert chooser.best(1) >= 2
    assert sum(k >= 2 for k in chosen[-100:]) >= 80


def test_a_probed_k_whose_own_steps_do_not_pay_is_not_continued() -> None:
    """The same, K = 2 served dear (1.3x the profile): after its UPWARD_STEPS the batch
    goes back to K = 1 at once, and K = 2 runs only in its probes."""
    served = [0.96, 0.94, 1.3, 1.3]
    chooser = eagle3_at_one_sequence_after_k1(served)
    chosen = serve_steps(chooser, 1, served, 400)
    assert chooser.best(1) == 1
    assert chosen.count(2) <= 4 * UPWARD_STEPS
