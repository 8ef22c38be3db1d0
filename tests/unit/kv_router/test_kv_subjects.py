"""Subject names of the KV router's NATS feeds."""

from __future__ import annotations

import pytest

from dynamo.llm.kv_router.subjects import (
    instance_of_subject,
    kv_events_filter,
    kv_events_stream_subjects,
    kv_events_subject,
    load_metrics_filter,
    load_metrics_subject,
)
from dynamo.runtime.naming import SUBJECT_ROOT, request_subject


def test_per_worker_subjects_carry_the_instance_id() -> None:
    subject = kv_events_subject("ns", "backend", 0xABC)
    assert subject == "dyn_kv.ns.backend.0000000000000abc"
    assert instance_of_subject(subject) == 0xABC
    assert instance_of_subject(load_metrics_subject("ns", "backend", 5)) == 5


def test_filters_match_exactly_one_component() -> None:
    assert kv_events_filter("ns", "backend") == "dyn_kv.ns.backend.*"
    assert load_metrics_filter("ns", "backend") == "dyn_load.ns.backend.*"


def test_the_event_stream_never_captures_request_subjects() -> None:
    """A stream on `dyn.kv.>` would store and ack requests of a namespace named `kv`."""
    request = request_subject("kv", "backend", "generate", 1)
    for pattern in kv_events_stream_subjects():
        assert not request.startswith(pattern.removesuffix(">"))
    assert not kv_events_subject("kv", "c", 1).startswith(SUBJECT_ROOT + ".")


@pytest.mark.parametrize("bad", ["a.b", "a*", ">", "", "a b"])
def test_names_that_would_break_subjects_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        kv_events_subject(bad, "backend", 1)
    with pytest.raises(ValueError):
        load_metrics_filter("ns", bad)


def test_router_replicas_of_one_endpoint_share_one_sync_subject() -> None:
    from dynamo.llm.kv_router.subjects import router_sync_subject

    assert router_sync_subject("ns", "backend", "generate") == "dyn_router_sync.ns.backend.generate"
    with pytest.raises(ValueError):
        router_sync_subject("ns", "backend", "gen.erate")
