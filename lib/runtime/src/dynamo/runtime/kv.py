"""JetStream KV buckets used as leased registries.

Every registry bucket (instances, model cards) has the same configuration, created on
first use by whichever process comes first (creation is idempotent for an identical
config). Leases are per key: each put carries a `Nats-TTL` header, and the bucket keeps a
delete marker when a key expires (`limit_marker_ttl`), so a watcher sees a crashed
process's key vanish without any timer of our own. Re-putting the key is the heartbeat.

Buckets live in memory: they describe live processes only, and after a broker restart
every process puts its keys again (`LeaseKeeper.restore`). On a NATS cluster they are
replicated (`--nats-replicas`): a memory stream with three replicas survives the loss of
any one node, which a single in-memory copy would not.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    APIError,
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from dynamo.runtime.cli import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_ERRORS = (TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError)
"""What JetStream answers while it cannot yet (a replicated stream electing its leader,
the metadata leader being elected, a server catching up): no answer in time, no
responder, or 503 "temporarily unavailable". Worth retrying for a while."""

_NO_PEERS_FOR_PLACEMENT = 10005
"""JetStream's code for "no suitable peers for placement": a replicated stream cannot be
placed *now* because a peer is offline (a node restarting, or a cluster whose metadata
leader has not yet heard from every peer just after it formed). Transient until the
budget is spent; then it is a replica shortage like `_INSUFFICIENT_RESOURCES`."""


def is_transient(exc: BaseException) -> bool:
    """Whether a JetStream call that raised `exc` may succeed if tried again soon."""
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    return isinstance(exc, APIError) and exc.err_code == _NO_PEERS_FOR_PLACEMENT


TRANSIENT_BUDGET_S = 15.0
"""How long a JetStream call is retried through transient errors: longer than a leader
election (nats-server takes 4 to 9 s, a little more on a loaded machine)."""

_RETRY_S = 0.5


async def retry_transient(
    action: Callable[[], Awaitable[T]], *, what: str, budget_s: float = TRANSIENT_BUDGET_S
) -> T:
    """`await action()`, retried every 0.5 s through transient errors (`is_transient`) for
    up to `budget_s` seconds; the last error is raised when the budget is spent."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    attempt = 0
    while True:
        try:
            return await action()
        except Exception as exc:
            if not is_transient(exc) or loop.time() >= deadline:
                raise
            attempt += 1
            # The first wait of a call is worth a line (a slow start is explained by it);
            # the retries after it would flood the log during an election.
            level = logging.WARNING if attempt == 1 else logging.DEBUG
            log.log(level, "%s: JetStream not ready (%r); retrying for up to %.0fs",
                    what, exc, budget_s)  # fmt: skip
            await asyncio.sleep(_RETRY_S)


# How long the server keeps the marker of an expired key (watchers read it as a PURGE).
_MARKER_TTL_S = 2.0


def registry_config(bucket: str, replicas: int = 1) -> KeyValueConfig:
    """The one configuration of a leased registry bucket."""
    return KeyValueConfig(
        bucket=bucket,
        history=1,
        storage=StorageType.MEMORY,
        limit_marker_ttl=_MARKER_TTL_S,
        replicas=replicas,
    )


async def ensure_registry(js: JetStreamContext, bucket: str, replicas: int) -> KeyValue:
    """Bind to `bucket`, creating it with `replicas` copies if missing; ConfigError when
    the NATS servers cannot hold that many."""
    try:
        kv = await retry_transient(
            lambda: js.create_key_value(registry_config(bucket, replicas)),
            what=f"creating bucket {bucket}",
        )
        await wait_for_stream_leader(js, f"KV_{bucket}", replicas)
        return kv
    except APIError as exc:
        if is_replica_shortage(exc):
            raise replica_error(f"bucket {bucket}", replicas, exc) from None
        if not isinstance(exc, BadRequestError):
            raise
        log.debug("bucket %s not created (%s); binding to the existing one", bucket, exc)
        # Exists with another configuration (another replica count, or created by an
        # older version): use it as is.
        kv = await retry_transient(lambda: js.key_value(bucket), what=f"binding {bucket}")
        status = await kv.status()
        warn_replicas(f"bucket {bucket}", status.stream_info.config.num_replicas or 1, replicas)
        return kv


async def wait_for_stream_leader(
    js: JetStreamContext, stream: str, replicas: int, timeout: float = 30.0
) -> None:
    """Wait until a replicated stream just created has elected its leader: until then a
    publish to it finds no responder. A single replica is ready at once. The timeout is
    generous: an election takes under a second on an idle cluster, but a process that
    gives up here exits, and on a host busy loading engines the nodes' heartbeats, and so
    the election, can run late.

    "Stream not found" is waited out too: in a cluster, a stream another client has just
    created (two workers starting together, each creating the bucket) may not be listed
    yet by the server this client asks (seen once in a fresh-clone run: a mocker failed
    to start on it)."""
    if replicas <= 1:
        return
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            info = await retry_transient(lambda: js.stream_info(stream), what=f"reading {stream}")
        except NotFoundError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        if info.cluster is not None and info.cluster.leader:
            return
        if asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError(f"stream {stream} elected no leader within {timeout:g}s")
        await asyncio.sleep(0.05)


# JetStream's error codes for a replica count the servers cannot place: more replicas
# than JetStream servers in the cluster, or any replication on a single server (and
# `_NO_PEERS_FOR_PLACEMENT` once retrying it has not helped).
_INSUFFICIENT_RESOURCES = 10023
_REPLICAS_WITHOUT_CLUSTER = 10074


def is_replica_shortage(exc: APIError) -> bool:
    """Whether JetStream refused a stream because it cannot place its replicas."""
    return exc.err_code in (
        _INSUFFICIENT_RESOURCES,
        _REPLICAS_WITHOUT_CLUSTER,
        _NO_PEERS_FOR_PLACEMENT,
    )


def replica_error(what: str, replicas: int, exc: APIError) -> ConfigError:
    """The message a process dies with when `--nats-replicas` exceeds the cluster."""
    return ConfigError(
        f"NATS cannot create {what} with {replicas} replicas ({exc.description}): "
        "--nats-replicas ($DYN_NATS_REPLICAS) must be at most the number of JetStream "
        "servers running in the NATS cluster (1 for a single server)"
    )


def warn_replicas(what: str, actual: int, wanted: int) -> None:
    """Say so when an existing bucket or stream has another replica count than this
    process asks for: it is used as is (changing it is an operator's decision)."""
    if actual != wanted:
        log.warning(
            "%s exists with %d replica(s), not the %d asked for (--nats-replicas); using it "
            "as is (`nats stream edit` changes it)",
            what,
            actual,
            wanted,
        )


def ttl_header(ttl_s: float) -> dict[str, str]:
    """`Nats-TTL` header for a leased put; the server counts whole seconds (min 1)."""
    return {"Nats-TTL": f"{max(1, math.ceil(ttl_s))}s"}


def key_subject(bucket: str, key: str) -> str:
    """The stream subject under which JetStream stores `key` of `bucket`."""
    return f"$KV.{bucket}.{key}"
