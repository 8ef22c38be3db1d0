"""Per-request speculative decoding statistics through the frontend, against the worker's
own Prometheus counters.

Claims (issue 18): a request sent with `"return_spec_stats": true` to a frontend over a
real vLLM worker with n-gram speculation gets `metrics.speculative_decoding` beside its
usage (unary: in the body; streaming: in the final usage chunk), and for that request run
alone its numbers equal the change of the worker's `vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos{position=i}` counters; without the field the response
carries no `metrics`.

The session's n-gram worker behind the session's frontend (no other traffic reaches them
while a test runs: the e2e tests run one at a time).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_engines import NGRAM_K

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.http import http_get, http_post_json, metric_values
from dynamo.testing.processes import FrontendProcess, WorkerProcess
from dynamo.testing.waiting import wait_until

K = NGRAM_K
# A prompt that invites repetition, so the n-gram proposer finds drafts.
PROMPT = "Repeat this list exactly three times: apple, banana, cherry, apple, banana, cherry."


@pytest.fixture(scope="module")
def served(
    ngram_worker: WorkerProcess, frontend: FrontendProcess
) -> tuple[WorkerProcess, FrontendProcess]:
    """The session's n-gram worker (K=3, `NGRAM_SPEC`) and the frontend over it alone."""
    return ngram_worker, frontend


def counters(worker: WorkerProcess) -> dict[str, Any]:
    """The worker's speculation counters now."""
    _, text = http_get(worker.metrics_url)

    def total(name: str, **labels: str) -> int:
        return round(sum(metric_values(text, f"vllm:spec_decode_{name}_total", labels)))

    return {
        "num_spec_steps": total("num_drafts"),
        "num_draft_tokens": total("num_draft_tokens"),
        "num_accepted_draft_tokens": total("num_accepted_tokens"),
        "acceptance_per_position": [
            total("num_accepted_tokens_per_pos", position=str(i)) for i in range(K)
        ],
    }


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_spec_steps": after["num_spec_steps"] - before["num_spec_steps"],
        "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
        "num_accepted_draft_tokens": after["num_accepted_draft_tokens"]
        - before["num_accepted_draft_tokens"],
        "acceptance_per_position": [
            a - b
            for a, b in zip(
                after["acceptance_per_position"], before["acceptance_per_position"], strict=True
            )
        ],
    }


def request_body(**fields: Any) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 64,
        "temperature": 0.0,
        **fields,
    }


def final_usage_chunk(sse: str) -> dict[str, Any]:
    events = [e[len("data: ") :] for e in sse.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"] == [] and "usage" in final, final
    return final


def check_against_counters(
    worker: WorkerProcess, before: dict[str, Any], stats: dict[str, Any]
) -> None:
    """The request's own statistics equal the change of the worker's counters. The
    counters are updated from the engine's stats, which may land just after the response:
    wait (bounded) for the step counter to reach the request's, then compare all."""
    wait_until(
        lambda: delta(before, counters(worker))["num_spec_steps"] >= stats["num_spec_steps"],
        timeout=10,
        interval=0.1,
        what="the worker's spec_decode counters to include the request",
    )
    changed = delta(before, counters(worker))
    mine = {key: stats[key] for key in changed}
    assert mine == changed


def check_shape(stats: dict[str, Any], completion_tokens: int) -> None:
    assert stats["num_spec_tokens"] == K
    assert stats["num_spec_steps"] > 0 and stats["num_accepted_draft_tokens"] > 0
    histogram = stats["acceptance_histogram"]
    assert len(histogram) == K + 1 and sum(histogram) == stats["num_spec_steps"]
    assert sum(j * n for j, n in enumerate(histogram)) == stats["num_accepted_draft_tokens"]
    per_position = stats["acceptance_per_position"]
    assert per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == stats["num_accepted_draft_tokens"]
    steps = stats["num_spec_steps"]
    assert stats["mean_acceptance_length"] == pytest.approx(
        1 + stats["num_accepted_draft_tokens"] / steps
    )
    assert stats["draft_acceptance_rate"] == pytest.approx(
        stats["num_accepted_draft_tokens"] / stats["num_draft_tokens"]
    )
    # Every accepted draft is a completion token; each step adds one more of the target's.
    assert completion_tokens >= steps + stats["num_accepted_draft_tokens"]


@pytest.mark.parametrize(
    "stream", [False, True], ids=["unary-in-the-body", "streamed-on-the-final-usage-chunk"]
)
def test_stats_equal_the_change_of_the_worker_counters(
    served: tuple[WorkerProcess, FrontendProcess], stream: bool
) -> None:
    """Unary, the statistics are in the body; streamed, they ride on the final usage chunk."""
    worker, frontend = served
    before = counters(worker)
    streaming = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    status, text = http_post_json(
        f"{frontend.base_url}/v1/chat/completions",
        request_body(return_spec_stats=True, **streaming),
        timeout=120,
    )
    assert status == 200, text
    reply = final_usage_chunk(text) if stream else json.loads(text)
    stats = reply["metrics"]["speculative_decoding"]
    check_shape(stats, reply["usage"]["completion_tokens"])
    check_against_counters(worker, before, stats)


def test_without_the_field_no_metrics_are_returned(
    served: tuple[WorkerProcess, FrontendProcess],
) -> None:
    _, frontend = served
    status, text = http_post_json(
        f"{frontend.base_url}/v1/chat/completions", request_body(max_tokens=8), timeout=120
    )
    assert status == 200, text
    assert "metrics" not in json.loads(text)


def test_a_request_that_turns_speculation_off_is_never_drafted_for(
    served: tuple[WorkerProcess, FrontendProcess],
) -> None:
    """`"speculative_decoding": false` (issue 30): the worker's scheduler drops that
    request's drafts, so its statistics show no draft and the worker's counters move by
    exactly what the next, speculated, request of the same prompt reports."""
    worker, frontend = served
    url = f"{frontend.base_url}/v1/chat/completions"
    before = counters(worker)
    status, text = http_post_json(
        url, request_body(return_spec_stats=True, speculative_decoding=False), timeout=120
    )
    assert status == 200, text
    off = json.loads(text)
    stats_off = off["metrics"]["speculative_decoding"]
    assert (stats_off["num_spec_steps"], stats_off["num_draft_tokens"]) == (0, 0)
    assert off["usage"]["completion_tokens"] > 0
    status, text = http_post_json(url, request_body(return_spec_stats=True), timeout=120)
    assert status == 200, text
    stats_on = json.loads(text)["metrics"]["speculative_decoding"]
    assert stats_on["num_draft_tokens"] > 0  # the same prompt is drafted for when allowed
    check_against_counters(worker, before, stats_on)
