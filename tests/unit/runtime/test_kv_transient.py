"""JetStream answers that mean "not now" are retried; the others are raised at once.

A replicated bucket created while the metadata leader still holds a peer offline (a
cluster just formed, a node restarting) is refused with "no suitable peers for placement"
(10005). That used to end a worker at once (seen once in ten runs of the cluster test on
a loaded host); it is now retried like a leader election, and reported as a replica
shortage (naming `--nats-replicas`) once the budget is spent.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from nats.js.errors import BadRequestError, NotFoundError

import dynamo.runtime.kv as kv
from dynamo.runtime.kv import is_replica_shortage, is_transient, retry_transient

NO_PEERS = {"code": 400, "err_code": 10005, "description": "no suitable peers for placement"}
NAME_IN_USE = {"code": 400, "err_code": 10058, "description": "stream name already in use"}


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv, "_RETRY_S", 0.001)


class Flaky:
    """Raises `errors` in turn, then answers "created"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "created"


async def test_no_peers_for_placement_is_retried_until_it_succeeds() -> None:
    action = Flaky(BadRequestError(**NO_PEERS), BadRequestError(**NO_PEERS))
    assert await retry_transient(action, what="creating a bucket") == "created"
    assert action.calls == 3


async def test_no_peers_for_placement_past_the_budget_is_a_replica_shortage() -> None:
    action = Flaky(*[BadRequestError(**NO_PEERS) for _ in range(3)])
    with pytest.raises(BadRequestError) as info:
        await retry_transient(action, what="creating a bucket", budget_s=0.0)
    assert is_replica_shortage(info.value)
    assert action.calls == 1


async def test_another_bad_request_is_raised_at_once() -> None:
    action = Flaky(BadRequestError(**NAME_IN_USE))
    with pytest.raises(BadRequestError):
        await retry_transient(action, what="creating a bucket")
    assert action.calls == 1
    assert not is_transient(BadRequestError(**NAME_IN_USE))
    assert is_transient(TimeoutError())


class ClusterStreams:
    """`stream_info` of a stream another client has just created: "stream not found" a
    few times (the server asked does not list it yet), then without a leader, then led."""

    def __init__(self, not_found: int) -> None:
        self.answers: list[object] = [NotFoundError(**STREAM_NOT_FOUND)] * not_found
        self.answers += [_info(leader=None), _info(leader="n2")]
        self.calls = 0

    async def stream_info(self, name: str) -> object:
        self.calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


STREAM_NOT_FOUND = {"code": 404, "err_code": 10059, "description": "stream not found"}


def _info(leader: str | None) -> object:
    return SimpleNamespace(cluster=SimpleNamespace(leader=leader))


async def test_a_stream_not_listed_yet_is_waited_for_until_it_has_a_leader() -> None:
    streams = ClusterStreams(not_found=3)
    await kv.wait_for_stream_leader(streams, "KV_models", replicas=3)  # type: ignore[arg-type]
    assert streams.calls == 5


async def test_a_stream_that_never_appears_is_reported_after_the_timeout() -> None:
    streams = ClusterStreams(not_found=10_000)
    with pytest.raises(NotFoundError):
        await kv.wait_for_stream_leader(streams, "KV_models", 3, timeout=0.1)  # type: ignore[arg-type]
