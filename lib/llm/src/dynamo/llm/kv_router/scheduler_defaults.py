"""Default values of the KV router's tuning knobs, each with the reason for its value.

`KvScheduler` takes them as keyword defaults, and so do the router factories
(`router.build_kv_router`, `nats_feed.create_kv_router`), the frontend's command line and
the routing benchmark. They live apart from the scheduler so those callers can name a
default without importing the scheduler, and so the measured rationale of each value is
in one place.
"""

from __future__ import annotations

DEFAULT_OVERLAP_SCORE_WEIGHT = 2.0
"""Prefill blocks weigh twice an active block. At 1.0 (Dynamo's default) a tenant's home
worker busy with one other request ties with an idle worker that lacks the prefix, and
half the time loses it: on the mocker-scale workload of benchmarks/kv_routing_bench.py
(16 workers, 24 tenants) 2.0 raised the hit rate from 0.64 to 0.88 of a best possible 0.89
at 16 in flight, with no worse time to first token (docs/kv_router.md, "Cost")."""
DEFAULT_LOAD_METRICS_TTL_S = 5.0
"""Worker-reported load older than this is ignored (the worker may be gone or stalled)."""
DEFAULT_LOAD_REPORT_HOLD_OFF_S = 0.5
"""After the router releases a request on a worker, that worker's reports received within
this long are ignored: they may still count the released request's blocks (the engine's
stats lag a step, a report may be in flight, and workers publish every 250 ms), and
would charge the worker for load this router knows is gone."""
