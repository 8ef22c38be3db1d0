"""Shared fixtures: a real nats-server per test session and the embedded model.

Tests are marked by folder: tests/unit → `unit`, tests/integration → `integration`,
tests/e2e → `e2e`, so `pytest -m unit` is the fast subset.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dynamo.nats_server import NatsServer
from dynamo.testing.leftovers import finish_leftovers

_FOLDER_MARKS = {
    "unit": pytest.mark.unit,
    "integration": pytest.mark.integration,
    "e2e": pytest.mark.e2e,
}

# Small, CPU-friendly defaults for every vLLM engine a test starts (inherited by children).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


ENGINE_LANE = pytest.mark.xdist_group("engines")
"""`make test` runs two pytest workers (`-n 2 --dist loadgroup`): every e2e test goes to
one of them, in file order, so the session's shared vLLM engines start once and each
module's engines start while the other worker runs the unit and integration tests. vLLM
pins an engine's compute threads to one core and leaves the other to its server, so the
two lanes share the machine's two cores rather than fight over one."""

OFF_ENGINE_LANE = frozenset({"test_model_prepare.py"})
"""e2e modules that start no engine (the model's preparation converts weights only): they
run beside the engine lane, with the unit and integration tests, instead of lengthening it."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marks by folder, as each test is collected: pytest-xdist reads `xdist_group` marks
    in its own `pytest_collection_modifyitems`, which may run before any of ours."""
    parts = Path(str(item.fspath)).parts
    for folder, mark in _FOLDER_MARKS.items():
        if folder in parts:
            item.add_marker(mark)
    if "e2e" in parts and parts[-1] not in OFF_ENGINE_LANE:
        item.add_marker(ENGINE_LANE)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse to run when pytest-xdist's `loadgroup` ignores the lane (it does, silently,
    under pytest 9.2: pytest-xdist issue 1386): each pytest worker would then start the
    session's engines of its own and the suite would take far longer."""
    if not getattr(session.config.option, "loadgroup", False):
        return  # not a pytest-xdist worker with --dist loadgroup
    ungrouped = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") and not item.nodeid.endswith("@engines")
    ]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest-xdist does not group the e2e tests in one lane ({ungrouped[0]}); "
            "run with a pytest it supports (pyproject.toml pins one) or TEST_WORKERS=0"
        )


_module_seconds: dict[str, float] = defaultdict(float)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-durations",
        type=int,
        default=0,
        metavar="N",
        help="list the N slowest test modules (setup, call and teardown summed) at the end",
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _module_seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The time each module took and its share of the run: where a slow suite's time goes
    (module-scoped engines start in their module's first test, so per-test durations
    scatter it)."""
    shown = config.getoption("--module-durations")
    if not shown or not _module_seconds:
        return
    total = sum(_module_seconds.values())
    slowest = sorted(_module_seconds.items(), key=lambda item: -item[1])[:shown]
    terminalreporter.write_sep("=", f"slowest {len(slowest)} modules ({total:.0f} s in all)")
    for module, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {module}")


LEFTOVERS_TIMEOUT_S = 20.0


@pytest_asyncio.fixture(scope="session", loop_scope="session", autouse=True)
async def no_leftovers_at_the_end(request: pytest.FixtureRequest) -> None:
    """At the session's end, finish what tests left on the shared event loop, bounded,
    and fail naming whatever would make the loop's close hang (dynamo.testing.leftovers).
    A finalizer, not the code after a `yield`: that would run inside this fixture's own
    async generator, which the loop's generators must not include while it runs."""
    loop = asyncio.get_running_loop()

    def finish() -> None:
        leftovers = loop.run_until_complete(finish_leftovers(LEFTOVERS_TIMEOUT_S))
        if leftovers.stuck:
            pytest.fail(
                f"the session's event loop would not close: {leftovers.describe()}",
                pytrace=False,
            )

    request.addfinalizer(finish)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A real nats-server with JetStream on an ephemeral port, for the whole session."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """Path of the prepared embedded model (prepared by `make setup`; prepared here if missing)."""
    from dynamo.llm.models import DEFAULT_MODEL, prepare_model

    return prepare_model(DEFAULT_MODEL)
