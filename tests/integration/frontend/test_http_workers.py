"""`python -m dynamo.frontend --http-workers 2`: two processes on one port, supervised.

Claims, over a real nats-server and a mocker worker: the parent starts two children that
both take requests on the one port (each child's KV router is a replica of its own, and
each routed some of them), the children's routers share their bookings (each knows the
other), and `/metrics` from either child counts every request of both, in the shape one
process gives (help texts, unobserved families declared); SIGTERM to the
parent stops both children and the parent exits 0 (a frontend per test costs seconds,
so serving and stopping share one); a child killed from outside is started again while
the other keeps serving, with a log line naming the dead child (when the parent gives up
instead is in tests/unit/frontend/test_frontend_http_workers.py), and the new child
answers no client before it knows the models that already exist (it would answer 404 for
them: its sibling shares the port, so the kernel hands it clients as soon as it listens).
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from dynamo.testing.http import http_get, http_post_json, metric_values
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running
from dynamo.testing.waiting import wait_until

MODEL = "smollm2-http-workers"
REQUESTS = 30
STOP_TIMEOUT_S = 40.0


class Stack:
    def __init__(self, nats_url: str, logs: Path, namespace: str) -> None:
        self.nats_url = nats_url
        self.logs = logs
        self.namespace = namespace

    @property
    def key(self) -> str:
        return f"{self.namespace}/backend/generate"

    @contextmanager
    def frontend(self, name: str) -> Iterator[FrontendProcess]:
        """A kv-mode frontend of two processes, serving the model with both, stopped when
        the block exits."""
        frontend = FrontendProcess(
            name,
            self.nats_url,
            self.logs,
            namespace=self.namespace,
            extra=["--http-workers", "2", "--router-mode", "kv"],
        )
        try:
            frontend.wait_for_model(MODEL, timeout=90)
            wait_until(
                lambda: both_children_route(frontend, self.key),
                timeout=60,
                what="both http workers to route with a peer",
                retry_on=(OSError, ValueError, KeyError),
            )
            yield frontend
        finally:
            frontend.stop()


@pytest.fixture(scope="module")
def stack(
    nats_url: str, embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("http-workers")
    namespace = "hw" + uuid.uuid4().hex[:8]
    argv = mocker_argv(
        embedded_model, nats_url, namespace,
        "--speed-up", "1000",
        served_model_name=MODEL,
    )  # fmt: skip
    with running([ManagedProcess("mocker", argv, logs)]):
        yield Stack(nats_url, logs, namespace)


def children(frontend: FrontendProcess) -> list[psutil.Process]:
    return psutil.Process(frontend.pid).children()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def killed_and_started_again(
    frontend: FrontendProcess,
) -> tuple[psutil.Process, psutil.Process, psutil.Process]:
    """SIGKILL one of `frontend`'s two children; returns it, the other one and the child
    the supervisor starts in its place. (A killed child stays listed, as a zombie, until
    the supervisor reaps it: a count of children cannot tell.)"""
    victim, other = children(frontend)
    victim.kill()

    def new_child() -> psutil.Process | None:
        started = [c for c in children(frontend) if c.pid not in (victim.pid, other.pid)]
        return started[0] if started else None

    wait_until(
        lambda: new_child() is not None,
        timeout=STOP_TIMEOUT_S,
        interval=0.02,
        what="the supervisor to start a new child",
    )
    new = new_child()
    assert new is not None
    return victim, other, new


def router_view(frontend: FrontendProcess, key: str) -> dict:
    """The KV router's debug view of whichever child answers this connection."""
    _, body = http_get(f"{frontend.base_url}/debug/kv")
    return json.loads(body)["models"][MODEL][key]


def both_children_route(frontend: FrontendProcess, key: str) -> bool:
    """Two children, and the (random) one answering knows one worker and one peer."""
    view = router_view(frontend, key)
    return (
        len(children(frontend)) == 2
        and len(view["feed"]["live_workers"]) == 1
        and len(view["replica_sync"]["replicas"]) == 1
    )


def complete(frontend: FrontendProcess, i: int) -> None:
    status, body = http_post_json(
        f"{frontend.base_url}/v1/completions",
        {"model": MODEL, "prompt": f"request {i}: say something", "max_tokens": 4},
        timeout=30,
    )
    assert status == 200, body


def test_two_processes_serve_one_port_and_stop_on_sigterm(stack: Stack) -> None:
    with stack.frontend("frontend-serve") as frontend:
        pids = [child.pid for child in children(frontend)]
        assert len(pids) == 2
        for i in range(REQUESTS):  # a new connection each: the kernel spreads them
            complete(frontend, i)
        routed: dict[str, int] = {}
        peers: dict[str, list[str]] = {}
        for _ in range(40):  # new connections: both children answer some
            view = router_view(frontend, stack.key)
            replica = view["replica_sync"]["replica_id"]
            routed[replica] = view["routing"]["requests"]
            peers[replica] = list(view["replica_sync"]["replicas"])
            if len(routed) == 2:
                break
        assert len(routed) == 2, routed
        assert sum(routed.values()) == REQUESTS and min(routed.values()) > 0, routed
        first, second = routed
        assert peers == {first: [second], second: [first]}
        for _ in range(4):  # whichever child answers, /metrics counts both
            _, text = http_get(f"{frontend.base_url}/metrics")
            counted = metric_values(text, "dynamo_frontend_requests_total", {"model": MODEL})
            assert sum(counted) == REQUESTS, counted
        # The single-process shape: own help texts, and families no request moved yet.
        assert "Multiprocess metric" not in text
        assert "# TYPE dynamo_frontend_migrations_total counter" in text
        frontend.popen.send_signal(signal.SIGTERM)
        assert frontend.popen.wait(STOP_TIMEOUT_S) == 0
        assert all(gone(pid) for pid in pids), pids


def test_a_killed_child_is_started_again_while_the_other_serves(stack: Stack) -> None:
    with stack.frontend("frontend-child-killed") as frontend:
        victim, other, _ = killed_and_started_again(frontend)
        assert frontend.alive() and other.is_running()
        wait_until(
            lambda: both_children_route(frontend, stack.key),
            timeout=60,
            what="the new child to route with its peer",
            retry_on=(OSError, ValueError, KeyError),
        )
        for _ in range(10):  # the kernel spreads these over both children
            status, text = http_post_json(
                f"{frontend.base_url}/v1/completions",
                {"model": MODEL, "prompt": "Hello there", "max_tokens": 4},
            )
            assert status == 200, text
        log = frontend.log_path.read_text()
        assert f"(pid {victim.pid}) exited with signal SIGKILL; starting it again" in log


def test_a_child_started_again_knows_the_models_before_it_answers(stack: Stack) -> None:
    with stack.frontend("frontend-child-answers-late") as frontend:
        _, _, new = killed_and_started_again(frontend)
        # Fresh connections, spread over both children by the kernel, from the moment the
        # new child exists: the first answer it gives must already list the model.
        first_answer = None

        def new_child_answered() -> bool:
            nonlocal first_answer
            _, body = http_get(f"{frontend.base_url}/debug/kv")
            view = json.loads(body)
            if view["http_worker"]["pid"] == new.pid:
                first_answer = view
            return first_answer is not None

        wait_until(
            new_child_answered,
            timeout=60,
            interval=0.02,
            what="the new child to answer",
            retry_on=(OSError, ValueError, KeyError),
        )
        assert first_answer is not None and MODEL in first_answer["models"], first_answer
