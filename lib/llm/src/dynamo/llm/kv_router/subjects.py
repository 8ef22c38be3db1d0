"""Where the KV router's inputs travel on NATS: one place for the names both sides use.

* KV events: one JetStream stream, `KV_EVENTS_STREAM`, capturing ``dyn_kv.>``; each worker
  publishes on ``dyn_kv.<namespace>.<component>.<instance_hex>``. A stream (not a core
  subject) so a frontend started after the workers replays what they cached.
* Load metrics: core NATS, ``dyn_load.<namespace>.<component>.<instance_hex>``: periodic
  snapshots where only the latest value matters, so nothing is stored.
* Router replica sync: core NATS, ``dyn_router_sync.<namespace>.<component>.<endpoint>``:
  every frontend replica's KV router of that endpoint publishes its booking changes,
  heartbeats and snapshots there and applies the others' (`replica_sync`). Core, not a
  stream: bookings live as long as requests, and a late joiner asks for a snapshot.

The roots are deliberately *not* under the runtime's ``dyn.`` tree: request subjects are
``dyn.<namespace>.<component>.<endpoint>.<instance>``, and a stream capturing
``dyn.kv.>`` would swallow (and acknowledge!) the requests of a namespace named ``kv``.

Pure string functions: no NATS import, usable by the worker, the frontend and the mocker.
"""

from __future__ import annotations

from dynamo.runtime.naming import check_name, instance_hex

KV_EVENTS_STREAM = "dyn_kv_events"
"""JetStream stream holding every worker's KV events."""

KV_EVENTS_ROOT = "dyn_kv"
LOAD_METRICS_ROOT = "dyn_load"
ROUTER_SYNC_ROOT = "dyn_router_sync"

KV_EVENTS_MAX_AGE_S = 3600.0
"""Events older than this are dropped by the stream. Safe: a store is always older than its
removal, so age-based expiry can forget a cached block (a lost hit) but never keep a
removed one."""


def _component_prefix(root: str, namespace: str, component: str) -> str:
    return f"{root}.{check_name('namespace', namespace)}.{check_name('component', component)}"


def kv_events_subject(namespace: str, component: str, instance_id: int) -> str:
    """The JetStream subject one worker publishes its `RouterEvent`s on."""
    return f"{_component_prefix(KV_EVENTS_ROOT, namespace, component)}.{instance_hex(instance_id)}"


def kv_events_filter(namespace: str, component: str) -> str:
    """Subject filter matching the KV events of every worker of a component."""
    return f"{_component_prefix(KV_EVENTS_ROOT, namespace, component)}.*"


def kv_events_stream_subjects() -> tuple[str, ...]:
    """What `KV_EVENTS_STREAM` captures: every namespace and component."""
    return (f"{KV_EVENTS_ROOT}.>",)


def load_metrics_subject(namespace: str, component: str, instance_id: int) -> str:
    """The core subject one worker publishes its `LoadMetrics` on."""
    prefix = _component_prefix(LOAD_METRICS_ROOT, namespace, component)
    return f"{prefix}.{instance_hex(instance_id)}"


def load_metrics_filter(namespace: str, component: str) -> str:
    """Subject filter matching the load metrics of every worker of a component."""
    return f"{_component_prefix(LOAD_METRICS_ROOT, namespace, component)}.*"


def router_sync_subject(namespace: str, component: str, endpoint: str) -> str:
    """The core subject the KV routers of one worker endpoint share their bookings on."""
    prefix = _component_prefix(ROUTER_SYNC_ROOT, namespace, component)
    return f"{prefix}.{check_name('endpoint', endpoint)}"


def instance_of_subject(subject: str) -> int:
    """The instance id in the last token of a KV-event or load subject."""
    return int(subject.rsplit(".", 1)[-1], 16)
