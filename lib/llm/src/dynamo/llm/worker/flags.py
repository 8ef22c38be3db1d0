"""The runtime flags every worker takes (the vLLM worker, the mocker), defined once.

Where a worker registers (`--namespace`, `--endpoint`), how it reaches NATS
(`--nats-server`), how long its registration outlives it (`--lease-ttl`), how many
requests it takes at once (`--max-inflight-requests`) and how it leaves
(`--drain-timeout`) mean the same for every backend; these land in its
`WorkerRegistration`. Flags whose defaults differ by backend (`--component`,
`--migration-limit`, `--system-port`) stay with the backend.
"""

from __future__ import annotations

from dynamo.llm.worker.backend import DEFAULT_DRAIN_TIMEOUT_S
from dynamo.llm.worker.inflight import MAX_INFLIGHT_HELP
from dynamo.runtime.cli import TakesArguments, non_negative_float, non_negative_int, positive_float
from dynamo.runtime.lease_ttl import CLUSTER_LEASE_TTL_S, DEFAULT_LEASE_TTL_S
from dynamo.runtime.nats_address import DEFAULT_NATS_URL

DEFAULT_NAMESPACE = "dynamo"
DEFAULT_ENDPOINT = "generate"


def add_worker_runtime_arguments(group: TakesArguments, *, default_in_words: str = "") -> None:
    """Add the shared worker flags to `group`. `default_in_words` ends the help of the
    flags whose default depends on the environment (a parser that must not print
    "(default: None)" passes an empty format field)."""
    group.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="Dynamo namespace to register in."
    )
    group.add_argument(
        "--endpoint", default=DEFAULT_ENDPOINT, help="Name of the endpoint serving generation."
    )
    group.add_argument(
        "--nats-server",
        default=None,  # read from the environment later: --help must not show credentials
        help=f"NATS URL (default: $NATS_SERVER, else {DEFAULT_NATS_URL}); logs show it "
        "redacted." + default_in_words,
    )
    group.add_argument(
        "--lease-ttl",
        type=positive_float,
        default=None,
        help="Seconds a registration outlives a silent worker (default: $DYN_LEASE_TTL, else "
        f"{DEFAULT_LEASE_TTL_S:g}, or {CLUSTER_LEASE_TTL_S:g} with --nats-replicas above 1: a "
        "lease must outlive a JetStream leader election)." + default_in_words,
    )
    group.add_argument(
        "--max-inflight-requests",
        type=non_negative_int,
        default=None,
        help=MAX_INFLIGHT_HELP + default_in_words,
    )
    group.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="On SIGTERM/SIGINT: seconds in-flight requests get to finish after the worker "
        "deregisters; what is still running then is aborted.",
    )
