"""The command line and the router factory it selects."""

from __future__ import annotations

import pytest
from frontend_support import make_card

from dynamo.frontend.__main__ import build_parser, config_from_args
from dynamo.frontend.engine.routing import RouterMode, RouterSettings, make_router_factory
from dynamo.llm.router import RandomRouter, RoundRobinRouter


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_SERVER", raising=False)
    config = config_from_args(build_parser().parse_args([]))
    assert (config.http.host, config.http.port, config.namespace) == ("0.0.0.0", 8000, "dynamo")
    assert config.nats_server == "nats://127.0.0.1:4222"
    assert config.router.mode is RouterMode.ROUND_ROBIN
    assert (config.router.kv_overlap_score_weight, config.router.temperature) == (2.0, 0.0)


def test_nats_server_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER", "nats://nats.example:4222")
    assert config_from_args(build_parser().parse_args([])).nats_server == "nats://nats.example:4222"


def test_flags_are_parsed() -> None:
    args = build_parser().parse_args(
        "--http-host 127.0.0.1 --http-port 9000 --namespace ns --nats-server nats://h:1 "
        "--router-mode kv --kv-overlap-score-weight 0.5 --router-temperature 0.2 "
        "--prefill-timeout 7.5 --worker-wait-timeout 0 --log-level DEBUG".split()
    )
    config = config_from_args(args)
    assert (config.http.host, config.http.port, config.namespace) == ("127.0.0.1", 9000, "ns")
    assert config.nats_server == "nats://h:1"
    assert config.router.mode is RouterMode.KV
    assert (config.router.kv_overlap_score_weight, config.router.temperature) == (0.5, 0.2)
    assert (config.prefill_timeout_s, config.http.worker_wait_s) == (7.5, 0.0)
    assert args.log_level == "DEBUG"


def test_every_flag_has_help() -> None:
    for action in build_parser()._actions:
        assert action.help, action.dest


def test_bad_router_mode_is_rejected() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--router-mode", "fastest"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker-wait-timeout", "-1"],
        ["--worker-wait-timeout", "soon"],
        ["--prefill-timeout", "0"],
        ["--http-port", "70000"],
        ["--max-request-bytes", "0"],
        ["--kv-overlap-score-weight", "-1"],
        ["--router-temperature", "nan"],
    ],
)
def test_bad_numbers_are_rejected(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mode", "router_type"),
    [(RouterMode.ROUND_ROBIN, RoundRobinRouter), (RouterMode.RANDOM, RandomRouter)],
)
async def test_router_factories(mode: RouterMode, router_type: type) -> None:
    """The stateless routers need neither the runtime nor the client (the KV router,
    built over a real runtime, is tested in tests/integration/kv_router)."""
    unused = object()
    router = await make_router_factory(RouterSettings(mode=mode), unused)(make_card(), unused)
    assert isinstance(router, router_type)
    assert await router.select(None, [7, 9]) in (7, 9)
