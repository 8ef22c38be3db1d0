"""`dynamo.llm.acceptance`: the one definition of acceptance length, rate and per-position
rates, and that every counter of the project reports through it."""

from __future__ import annotations

import pytest

from dynamo.llm.acceptance import acceptance_length, acceptance_rate, per_position_rates
from dynamo.llm.protocols import SpecDecodeStats
from dynamo.mocker.counters import EngineCounters
from dynamo.testing.spec_counters import SpecCounters
from dynamo.vllm.serving.engine_stats import SpecDecodeTotals


def test_the_three_figures_from_vllms_counts() -> None:
    # 4 verification steps of 3 drafts each: 6 of 12 draft tokens accepted, position 0
    # accepted in 3 steps, position 1 in 2, position 2 in 1.
    assert acceptance_length(6, 4) == pytest.approx(2.5)
    assert acceptance_rate(6, 12) == pytest.approx(0.5)
    assert per_position_rates([3, 2, 1], 4) == pytest.approx([0.75, 0.5, 0.25])


def test_nothing_drafted_is_one_token_a_step_and_no_acceptance() -> None:
    assert acceptance_length(0, 0) == 1.0
    assert acceptance_rate(0, 0) == 0.0
    assert per_position_rates([0, 0], 0) == [0.0, 0.0]


def test_every_counter_reports_the_same_figures_for_the_same_counts() -> None:
    request = SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6)
    worker = SpecDecodeTotals(
        num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6, accepted_per_pos=[3, 2, 1]
    )
    mocker = EngineCounters(
        spec_drafts=4,
        spec_draft_tokens=12,
        spec_accepted_tokens=6,
        spec_accepted_per_position=[3, 2, 1],
    )
    scraped = SpecCounters(drafts=4, accepted=6, per_position=(3, 2, 1))
    lengths = {
        request.mean_acceptance_length,
        worker.mean_acceptance_length,
        mocker.mean_acceptance_length,
        scraped.mean_acceptance_length,
    }
    assert lengths == {2.5}
    assert worker.acceptance_rate == mocker.acceptance_rate == 0.5
    rates = [0.75, 0.5, 0.25]
    assert worker.per_position_rate() == mocker.per_position_rate() == rates
    assert list(scraped.acceptance_per_position) == rates
