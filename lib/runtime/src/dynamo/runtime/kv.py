"""JetStream KV buckets used as leased registries.

Every registry bucket (instances, model cards) has the same configuration, created on
first use by whichever process comes first (creation is idempotent for an identical
config). Leases are per key: each put carries a `Nats-TTL` header, and the bucket keeps a
delete marker when a key expires (`limit_marker_ttl`), so a watcher sees a crashed
process's key vanish without any timer of our own. Re-putting the key is the heartbeat.

Buckets live in memory: they describe live processes only, and after a broker restart
every process puts its keys again (`LeaseKeeper.restore`).
"""

from __future__ import annotations

import math

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

# How long the server keeps the marker of an expired key (watchers read it as a PURGE).
_MARKER_TTL_S = 2.0


def registry_config(bucket: str) -> KeyValueConfig:
    """The one configuration of a leased registry bucket."""
    return KeyValueConfig(
        bucket=bucket,
        history=1,
        storage=StorageType.MEMORY,
        limit_marker_ttl=_MARKER_TTL_S,
    )


async def ensure_registry(js: JetStreamContext, bucket: str) -> KeyValue:
    """Bind to `bucket`, creating it if missing."""
    try:
        return await js.create_key_value(registry_config(bucket))
    except BadRequestError:
        # Exists with another configuration (created by an older version): use it as is.
        return await js.key_value(bucket)


def ttl_header(ttl_s: float) -> dict[str, str]:
    """`Nats-TTL` header for a leased put; the server counts whole seconds (min 1)."""
    return {"Nats-TTL": f"{max(1, math.ceil(ttl_s))}s"}


def key_subject(bucket: str, key: str) -> str:
    """The stream subject under which JetStream stores `key` of `bucket`."""
    return f"$KV.{bucket}.{key}"
