"""Names of everything the runtime puts on NATS: subjects, KV buckets and keys.

One place so that a server, a client and the debugging CLI always agree. Namespace,
component and endpoint names are restricted to `[A-Za-z0-9_-]` because they become NATS
subject tokens and KV key segments, where `.`, `*`, `>` and spaces have meaning.
"""

from __future__ import annotations

import re
from typing import Protocol

INSTANCES_BUCKET = "dyn_instances"
"""KV bucket of live endpoint instances, one leased key per (endpoint, instance)."""

SUBJECT_ROOT = "dyn"
INBOX_ROOT = "_INBOX.dyn"

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class EndpointAddress(Protocol):
    """An endpoint's name parts and path (`runtime.Endpoint`). Here, next to the names it
    is built from, so that the client and the serving side describe an endpoint alike
    without importing each other."""

    @property
    def namespace(self) -> str: ...

    @property
    def component(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...


def check_name(kind: str, value: str) -> str:
    """Return `value` if it is a valid namespace/component/endpoint name, else ValueError."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"invalid {kind} name {value!r}: use letters, digits, '_' and '-'")
    return value


def instance_hex(instance_id: int) -> str:
    """The fixed-width hex form of an instance id used in subjects, keys and logs."""
    return f"{instance_id:016x}"


def endpoint_prefix(namespace: str, component: str, endpoint: str) -> str:
    return f"{namespace}.{component}.{endpoint}"


def instance_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """KV key of one instance of an endpoint in `INSTANCES_BUCKET`."""
    return f"{endpoint_prefix(namespace, component, endpoint)}.{instance_hex(instance_id)}"


def instance_key_filter(namespace: str, component: str, endpoint: str) -> str:
    """Watch filter matching every instance key of an endpoint."""
    return f"{endpoint_prefix(namespace, component, endpoint)}.*"


def request_subject(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """Core-NATS subject on which one instance receives its requests."""
    return f"{SUBJECT_ROOT}.{endpoint_prefix(namespace, component, endpoint)}.{instance_hex(instance_id)}"


def control_subject(instance_id: int) -> str:
    """Core-NATS subject carrying cancellations to every endpoint of one process."""
    return f"{SUBJECT_ROOT}._ctl.{instance_hex(instance_id)}"


def inbox_prefix(runtime_token: str) -> str:
    """Prefix of the reply subjects of one runtime's response streams."""
    return f"{INBOX_ROOT}.{runtime_token}."


MUX_TOKEN = "mux"
"""The inbox token of MUX messages (frames of several streams); stream tokens are hex
counters, so it names no stream."""


def inbox_of(reply: str) -> str | None:
    """The inbox prefix of a reply subject one of our runtimes opened, None for any other
    reply subject (a plain NATS request's)."""
    if not reply.startswith(INBOX_ROOT + "."):
        return None
    return reply[: reply.rfind(".") + 1]
