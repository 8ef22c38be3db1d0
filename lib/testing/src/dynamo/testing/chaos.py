"""A chaos soak: mixed traffic through a whole stack while faults are injected at random.

The stack (every address on this machine): a three-node NATS cluster, a frontend of two
HTTP worker processes in kv mode, two mocker workers and, unless `vllm=False`, one real
vLLM worker on the embedded model; each worker runs under the launch scripts'
supervisor (`python -m dynamo.runtime.supervise`), so a killed worker comes back as it
would for a user of `launch/`. The migration limit is the default.

Traffic: `clients` loops, each sending one request after another, drawn from a mix of
streamed and plain completions and chats, `n` = 2, cancellations (the client goes away
after three chunks) and, on the vLLM worker, structured output, tool calls, seeded
sampling and long prompts. Completions to the mocker use token-id prompts, `ignore_eos`
and a fixed length, so their text can be checked token for token against what the
mocker produces, migrations included (`dynamo.testing.mocker_tokens`).

Faults, one at a time, each after the stack is whole again: a worker SIGKILLed (the
supervisor restarts it), a worker SIGSTOPped for a few seconds then SIGCONTed, a NATS node
killed and restarted, a frontend child SIGKILLed (the frontend starts another).

Each request ends as: completed (whole, and for checked completions the right tokens),
failed (a clean error: an HTTP error status or an SSE error event), connection lost
(reset: expected only when its frontend child was killed), hung (no end within
`request_deadline_s`: must be 0), wrong (completed with tokens lost or repeated: must be
0), or cancelled (by the client, on purpose). Requests are counted under every fault whose
window (injection to recovery, plus `SETTLE_S`) they overlap, or under "none". At the end:
the KV routers' bookings must fall back to 0, and the frontend's memory before and after
is reported.

`benchmarks/chaos_soak.py` is the command line; tests/integration/test_chaos_soak.py runs
a short version in `make test`.

This module runs the soak and sums it up (`run_soak`); its parts have a module each:
`chaos_records` (the config, the records and the report), `chaos_stack` (the processes),
`chaos_faults` (the injections) and `chaos_traffic` (the client loops).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import asdict

from dynamo.testing.chaos_faults import FaultInjector
from dynamo.testing.chaos_records import Fault, Record, SoakConfig, SoakReport
from dynamo.testing.chaos_stack import MOCK_MODEL, SoakStack
from dynamo.testing.chaos_traffic import Traffic
from dynamo.testing.mocker_tokens import ExpectedTokens
from dynamo.testing.waiting import wait_until

SETTLE_S = 5.0


def _tabulate(records: list[Record], faults: list[Fault]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for record in records:
        ended = record.ended or float("inf")
        kinds = {
            f.kind
            for f in faults
            if record.started <= f.recovered + SETTLE_S and ended >= f.started
        } or {"none"}
        for kind in kinds:
            table.setdefault(kind, Counter())[record.outcome] += 1
    return {kind: dict(counts) for kind, counts in table.items()}


async def _soak(stack: SoakStack, config: SoakConfig) -> SoakReport:
    rng = random.Random(config.seed)
    expected = await asyncio.to_thread(ExpectedTokens, config.model_dir, MOCK_MODEL)
    traffic = Traffic(stack, config, expected)
    injector = FaultInjector(stack, rng)
    faults: list[Fault] = []
    clients = asyncio.create_task(traffic.run())
    await asyncio.sleep(config.warmup_s)
    rss_before = stack.frontend_rss_mib()
    deadline = time.monotonic() + config.duration_s
    order = rng.sample(list(config.faults), len(config.faults))
    # Every kind once per round, in a random order; the first round is finished whatever
    # the duration, so each kind is injected at least once.
    while (time.monotonic() < deadline or order) and not clients.done():
        if not order:
            order = rng.sample(list(config.faults), len(config.faults))
        fault = await asyncio.to_thread(injector.inject, order.pop())
        faults.append(fault)
        if not fault.recovered_in_time:
            break  # later faults would pile onto a broken stack: the report says so
        pause = rng.uniform(0.5, 1.5) * config.fault_every_s
        await asyncio.sleep(pause if order else min(pause, deadline - time.monotonic()))
    traffic.stop.set()
    await asyncio.wait_for(clients, config.request_deadline_s + 30)
    bookings: dict[str, int] = {}

    def released() -> bool:
        bookings.update(stack.bookings())
        return not any(bookings.values())

    try:
        wait_until(released, timeout=30, interval=0.5, what="the routers' bookings to reach 0")
    except Exception as exc:  # reported, not raised: the report says what was left
        print(f"chaos soak: {exc}", file=sys.stderr)
    records = traffic.records
    return SoakReport(
        config={k: str(v) for k, v in asdict(config).items()},
        faults=faults,
        table=_tabulate(records, faults),
        totals=dict(Counter(r.outcome for r in records)),
        bookings_after=bookings,
        frontend_rss_mib=(rss_before, stack.frontend_rss_mib()),
        problems=[
            *(f"{f.kind}: {f.detail}" for f in faults if not f.recovered_in_time),
            *(_problem(r, records, faults) for r in records if r.outcome in ("hung", "wrong")),
        ],
        failures=dict(Counter(r.detail[:120] for r in records if r.outcome == "failed")),
        losses=dict(Counter(r.detail[:120] for r in records if r.outcome == "connection_lost")),
    )


def _problem(record: Record, records: list[Record], faults: list[Fault]) -> str:
    """One line on a hung or wrong request: what, when it was sent and which faults came
    before its end, in seconds from the first request (to find it in the workers' logs)."""
    origin = min(r.started for r in records)
    until = record.ended or float("inf")
    during = ", ".join(
        f"{f.kind} at +{f.started - origin:.1f}s" for f in faults if f.started < until
    )
    return (
        f"{record.outcome} {record.kind}: {record.detail} (sent at +{record.started - origin:.1f}s; "
        f"faults before its end: {during or 'none'})"
    )


def run_soak(config: SoakConfig) -> SoakReport:
    """Start the stack, run the soak, stop everything; the report."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    stack = SoakStack(config)
    try:
        return asyncio.run(_soak(stack, config))
    finally:
        stack.close()
