"""`speculation_opt_out`: the scheduler drops the drafts of requests that turned
speculation off, and a speculating worker runs it (unless told to run another)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.v1.outputs import DraftTokenIds

from dynamo.vllm.config.speculative_resolution import configure_opt_out
from dynamo.vllm.speculative.opt_out import (
    OPT_OUT_KEY,
    SCHEDULER_CLS,
    SpeculationOptOutScheduler,
)


def scheduler_with(**requests: bool) -> SpeculationOptOutScheduler:
    """The scheduler's own method on its request table, without an engine behind it:
    `name=True` is a request that turned speculation off."""
    scheduler = object.__new__(SpeculationOptOutScheduler)
    scheduler.requests = {
        name: SimpleNamespace(
            sampling_params=SamplingParams(extra_args={OPT_OUT_KEY: True} if off else None)
        )
        for name, off in requests.items()
    }
    return scheduler


def test_opted_out_requests_get_no_drafts_and_the_others_keep_theirs() -> None:
    scheduler = scheduler_with(bulk=True, chat=False)
    drafts = DraftTokenIds(["bulk", "chat", "gone"], [[1, 2, 3], [4, 5, 6], [7]])
    kept = scheduler.without_opted_out(drafts)
    assert kept.req_ids == ["bulk", "chat", "gone"]
    # A request the scheduler no longer holds keeps its drafts: vLLM skips it itself.
    assert kept.draft_token_ids == [[], [4, 5, 6], [7]]


def test_a_speculating_worker_runs_the_opt_out_scheduler() -> None:
    values: dict[str, object] = {"speculative_config": {"method": "ngram"}}
    configure_opt_out(values)
    assert values["scheduler_cls"] == SCHEDULER_CLS
    plain: dict[str, object] = {"speculative_config": None}
    configure_opt_out(plain)
    assert "scheduler_cls" not in plain


def test_a_scheduler_named_by_the_user_is_kept_and_the_loss_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = "vllm.v1.core.sched.scheduler.Scheduler"
    values: dict[str, object] = {"speculative_config": {"method": "ngram"}, "scheduler_cls": own}
    with caplog.at_level(logging.WARNING, logger="dynamo.vllm"):
        configure_opt_out(values)
    assert values["scheduler_cls"] == own
    assert '"speculative_decoding": false' in caplog.text and json.dumps(own)[1:-1] in caplog.text
