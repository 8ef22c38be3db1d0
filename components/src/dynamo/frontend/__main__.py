"""`python -m dynamo.frontend`: the OpenAI-compatible HTTP frontend.

Connects to NATS, discovers the models workers register, and serves them over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import prometheus_client
import uvloop

from dynamo.frontend.http.settings import HTTP_GROUP, LIMITS_GROUP, HttpSettings
from dynamo.frontend.http.workers import (
    HTTP_WORKERS_ENV,
    WORKER_COUNT_FLAG,
    WORKER_INDEX_FLAG,
    HttpWorkers,
    HttpWorkerSlot,
    check_http_workers,
    claim_port,
    metrics_dir_of_child,
)
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions
from dynamo.frontend.parsing.reasoning import UnknownReasoningParser, check_reasoning_parser_name
from dynamo.frontend.parsing.tool_calls import tool_parser_class
from dynamo.frontend.preprocess.chat_template_file import ChatTemplateError, load_chat_template
from dynamo.frontend.service import FrontendConfig, run_frontend
from dynamo.runtime.cli import (
    ConfigError,
    TakesArguments,
    add_log_level_argument,
    configure_logging,
    non_negative_int,
    positive_int,
)
from dynamo.runtime.gc_tuning import tune_for_serving
from dynamo.runtime.nats_address import nats_url_from_env
from dynamo.runtime.nats_options import add_nats_arguments, nats_options_from_args
from dynamo.runtime.settings import Flag, add_setting_arguments, setting, settings_from_args


def build_parser() -> argparse.ArgumentParser:
    """The command line: every flagged field of `FrontendConfig` (its nested HTTP and
    routing settings included), plus the flags that are not one field's value."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.frontend",
        description=(
            "OpenAI-compatible HTTP frontend: tokenizes requests with each model's own "
            "tokenizer and chat template and routes them to the workers registered in NATS."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--nats-server",
        default=argparse.SUPPRESS,  # not shown by --help: it may carry credentials
        help="NATS URL used for discovery and requests (default: $NATS_SERVER, else "
        "nats://127.0.0.1:4222). Credentials in it (nats://user:pass@host) work, but are "
        "better given with the flags or variables below; logs show it redacted.",
    )
    add_nats_arguments(parser.add_argument_group("NATS authentication and TLS"))
    groups = add_setting_arguments(parser, FrontendConfig)
    add_http_workers_arguments(groups[HTTP_GROUP])
    groups[LIMITS_GROUP].add_argument(
        "--api-key",
        default=argparse.SUPPRESS,  # never shown by --help, nor in the process's defaults
        help="Require `Authorization: Bearer <key>` on every route except /health, /live and "
        "/metrics (401 otherwise). Default: $DYN_API_KEY; unset or empty serves without "
        "authentication. Prefer the variable: a flag is visible in the process list.",
    )
    add_setting_arguments(parser, ChatFlags)
    add_log_level_argument(parser)
    return parser


def add_http_workers_arguments(group: TakesArguments) -> None:
    """`--http-workers` and the hidden flags its supervisor gives each child."""
    group.add_argument(
        "--http-workers",
        type=positive_int,
        default=os.environ.get(HTTP_WORKERS_ENV, "1"),
        help="Frontend processes serving the HTTP port (SO_REUSEPORT; Linux). Above 1, a "
        "supervisor starts N complete frontends (each its own NATS connection and router), "
        "stops them all on SIGTERM/SIGINT, and stops all and exits 1 when one dies. /metrics "
        "sums every process (prometheus_client multiprocess mode); --max-inflight-requests, "
        "--max-waiting-requests and GET /debug/kv are per process. kv mode keeps routing "
        "consistent across them with --router-replica-sync. $DYN_HTTP_WORKERS sets the "
        "default.",
    )
    for flag, kind in ((WORKER_INDEX_FLAG, non_negative_int), (WORKER_COUNT_FLAG, positive_int)):
        group.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)


CHAT_GROUP = "Chat templates and output parsers"


@dataclass(frozen=True)
class ChatFlags:
    """The chat flags as given: a file and parser names, which `config_from_args` checks
    (the template read and parsed, the names looked up in vLLM's registries)."""

    chat_template: str | None = setting(
        None,
        Flag(
            "--chat-template",
            "Jinja chat template used instead of the model's own, e.g. one with a tools "
            "section (examples/chat_templates/smollm2_tools.jinja); checked at start-up. "
            "$DYN_CHAT_TEMPLATE sets the default.",
            env="DYN_CHAT_TEMPLATE",
            metavar="FILE",
            group=CHAT_GROUP,
        ),
    )
    tool_call_parser: str | None = setting(
        None,
        Flag(
            "--tool-call-parser",
            "vLLM tool parser (e.g. `hermes`) that reads tool calls from the model's text "
            "when `tool_choice` is `auto` (the default with `tools`); without it such "
            "requests are refused. $DYN_TOOL_CALL_PARSER sets the default.",
            env="DYN_TOOL_CALL_PARSER",
            metavar="NAME",
            group=CHAT_GROUP,
        ),
    )
    reasoning_parser: str | None = setting(
        None,
        Flag(
            "--reasoning-parser",
            "vLLM reasoning parser (e.g. `deepseek_r1`, `qwen3`) that moves a reasoning "
            "model's thinking out of `content` into `reasoning_content`; unknown names are "
            "a start-up error listing the valid ones. $DYN_REASONING_PARSER sets the default.",
            env="DYN_REASONING_PARSER",
            metavar="NAME",
            group=CHAT_GROUP,
        ),
    )


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """The frontend's settings; ConfigError for contradictory NATS settings, a bad chat
    template or an unknown parser."""
    nats_server = vars(args).get("nats_server") or nats_url_from_env()
    api_key = vars(args).get("api_key") or os.environ.get("DYN_API_KEY") or None
    chat = settings_from_args(ChatFlags, args)
    return settings_from_args(
        FrontendConfig,
        args,
        http=settings_from_args(HttpSettings, args, api_key=api_key),
        nats_server=nats_server,
        nats_options=nats_options_from_args(args, url=nats_server),
        chat_template=_chat_template(chat.chat_template),
        chat_parsing=ChatParsingOptions(
            tool_call_parser=_tool_call_parser(chat.tool_call_parser),
            reasoning_parser=_reasoning_parser(chat.reasoning_parser),
        ),
        http_worker=_http_worker_slot(args),
        metrics_dir=metrics_dir_of_child() if args.http_worker_index is not None else None,
    )


def _http_worker_slot(args: argparse.Namespace) -> HttpWorkerSlot | None:
    """Which child of an `--http-workers` supervisor this process is (None: not one)."""
    if args.http_worker_index is None:
        return None
    count = args.http_worker_count or args.http_worker_index + 1
    return HttpWorkerSlot(args.http_worker_index, count)


def _chat_template(path: str | None) -> str | None:
    """The `--chat-template` file's source; ConfigError if it is missing or not Jinja."""
    if path is None:
        return None
    try:
        return load_chat_template(path)
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from None


def _tool_call_parser(name: str | None) -> str | None:
    """`--tool-call-parser`, checked against vLLM's registered parsers."""
    if name is None:
        return None
    try:
        tool_parser_class(name)
    except ValueError as exc:
        raise ConfigError(f"--tool-call-parser: {exc}") from None
    return name


def _reasoning_parser(name: str | None) -> str | None:
    """`--reasoning-parser`, checked against vLLM's registered reasoning parsers."""
    if name is None:
        return None
    try:
        return check_reasoning_parser_name(name)
    except UnknownReasoningParser as exc:
        raise ConfigError(f"--reasoning-parser: {exc}") from None


async def _serve(config: FrontendConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await run_frontend(config, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    worker = "" if args.http_worker_index is None else f"[http worker {args.http_worker_index}] "
    configure_logging(args.log_level, prefix=worker)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # prometheus_client adds a `<name>_created` timestamp series next to every counter,
    # histogram and labelled child: noise that doubles /metrics and that Prometheus
    # itself does not need. The switch is process-wide, so it is set here, not in the
    # library code that tests embed.
    prometheus_client.disable_created_metrics()
    try:
        config = config_from_args(args)
        check_http_workers(args.http_workers)
        port = claim_port(args.http_host, args.http_port) if args.http_workers > 1 else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.http_workers > 1:  # a supervisor of N frontends (http_workers.py)
        own_argv = sys.argv[1:] if argv is None else argv
        return HttpWorkers(args.http_workers, own_argv, port).run()
    tune_for_serving()
    try:
        uvloop.run(_serve(config))  # faster socket I/O than asyncio's loop for many streams
    except ConnectionError as exc:  # no NATS server, or one that refuses our credentials
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
