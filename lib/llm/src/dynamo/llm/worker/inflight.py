"""How many requests a worker accepts at once (`--max-inflight-requests`).

Every accepted request costs the worker a task, its buffers and a place in the engine's
queue. Beyond a bound the worker refuses a request at once (the runtime answers with an
`OVERLOADED` error frame, no task is created), and the frontend places it on another
worker, or answers 503 when every worker refuses. The bound is per worker's `generate`
endpoint.

The default scales with the engine: `INFLIGHT_PER_SEQUENCE` x `max_num_seqs`, i.e. a full
running batch plus three batches' worth waiting in the engine's queue. A fixed number
would be wrong one way or the other: vLLM runs 256 to 1024 sequences at once depending on
the GPU, and a queue much deeper than a few batches only adds latency a client could
spend on a less loaded worker.
"""

from __future__ import annotations

import os

from dynamo.runtime.cli import ConfigError

ENV_MAX_INFLIGHT_REQUESTS = "DYN_WORKER_MAX_INFLIGHT_REQUESTS"
"""Not `DYN_MAX_INFLIGHT_REQUESTS`: that is the frontend's per-model bound, and launch
scripts often give every process one environment."""
INFLIGHT_PER_SEQUENCE = 4

MAX_INFLIGHT_HELP = (
    "Most requests this worker accepts at once; beyond it a request is refused at once "
    "and the frontend places it on another worker (503 when all refuse). 0: no bound. "
    f"Default: ${ENV_MAX_INFLIGHT_REQUESTS}, else {INFLIGHT_PER_SEQUENCE} x --max-num-seqs."
)


def max_inflight_or_env(given: int | None) -> int | None:
    """`--max-inflight-requests` when given, else `$DYN_WORKER_MAX_INFLIGHT_REQUESTS`, else None
    (the engine-derived default). A bad variable raises ConfigError naming it."""
    if given is not None:
        return given
    text = os.environ.get(ENV_MAX_INFLIGHT_REQUESTS, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"${ENV_MAX_INFLIGHT_REQUESTS} must be an integer >= 0 "
            f"(the default of --max-inflight-requests), got {text!r}"
        )
    return value


def inflight_bound(configured: int | None, max_num_seqs: int) -> int | None:
    """The bound to serve `generate` with: `configured` (0 turns it off: None), or by
    default `INFLIGHT_PER_SEQUENCE` x the engine's `max_num_seqs`."""
    if configured is None:
        return INFLIGHT_PER_SEQUENCE * max(1, max_num_seqs)
    if configured < 0:
        raise ValueError(f"max_inflight_requests must be >= 0, got {configured}")
    return configured or None
