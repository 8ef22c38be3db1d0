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
from pathlib import Path

import prometheus_client
import uvloop

from dynamo.frontend.engine.client import (
    DEFAULT_ACCEPT_TIMEOUT_S,
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_INTER_TOKEN_TIMEOUT_S,
)
from dynamo.frontend.engine.disagg import DEFAULT_PREFILL_TIMEOUT_S
from dynamo.frontend.engine.routing import RouterMode
from dynamo.frontend.http.admission import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_WAITING
from dynamo.frontend.http.listener import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S
from dynamo.frontend.http.server import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WORKER_WAIT_S,
    DEFAULT_WRITE_TIMEOUT_S,
)
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
from dynamo.frontend.service import FrontendConfig, default_tokenizer_cache, run_frontend
from dynamo.llm.kv_router.scheduler import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.runtime.cli import (
    ConfigError,
    add_log_level_argument,
    configure_logging,
    fraction,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from dynamo.runtime.gc_tuning import tune_for_serving
from dynamo.runtime.nats_address import nats_url_from_env
from dynamo.runtime.nats_options import add_nats_arguments, nats_options_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.frontend",
        description=(
            "OpenAI-compatible HTTP frontend: tokenizes requests with each model's own "
            "tokenizer and chat template and routes them to the workers registered in NATS."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--http-host", default="0.0.0.0", help="Address the HTTP server binds to.")
    parser.add_argument("--http-port", type=port, default=8000, help="TCP port of the HTTP server.")
    parser.add_argument(
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
    parser.add_argument(
        WORKER_INDEX_FLAG,
        type=non_negative_int,
        default=None,
        help=argparse.SUPPRESS,  # given by the --http-workers supervisor to its children
    )
    parser.add_argument(
        WORKER_COUNT_FLAG,
        type=positive_int,
        default=None,
        help=argparse.SUPPRESS,  # given by the --http-workers supervisor to its children
    )
    parser.add_argument(
        "--namespace",
        default="dynamo",
        help="Dynamo namespace whose model cards (workers) this frontend serves.",
    )
    parser.add_argument(
        "--nats-server",
        default=argparse.SUPPRESS,  # not shown by --help: it may carry credentials
        help="NATS URL used for discovery and requests (default: $NATS_SERVER, else "
        "nats://127.0.0.1:4222). Credentials in it (nats://user:pass@host) work, but are "
        "better given with the flags or variables below; logs show it redacted.",
    )
    add_nats_arguments(parser.add_argument_group("NATS authentication and TLS"))
    parser.add_argument(
        "--router-mode",
        choices=[m.value for m in RouterMode],
        default=RouterMode.ROUND_ROBIN.value,
        help=(
            "How a worker is chosen per request: round-robin, random, or kv (KV-cache aware: "
            "prefers workers that already hold the prompt's prefix, weighted by load)."
        ),
    )
    parser.add_argument(
        "--kv-overlap-score-weight",
        type=non_negative_float,
        default=DEFAULT_OVERLAP_SCORE_WEIGHT,
        help=(
            "kv mode: weight of the prompt blocks a worker would still have to prefill, "
            "against its active blocks, in the routing cost (higher favours cache hits, "
            "lower favours balance)."
        ),
    )
    parser.add_argument(
        "--router-temperature",
        type=non_negative_float,
        default=0.0,
        help="kv mode: softmax temperature over worker costs; 0 always picks the cheapest.",
    )
    parser.add_argument(
        "--no-kv-events",
        action="store_true",
        help="kv mode: read no KV events (for engines or deployments that publish none); "
        "the router assumes a worker caches the prompts it sent there for --router-ttl "
        "seconds (approximate mode). With events, a prompt routed to a worker also counts "
        "as cached there until its events confirm it.",
    )
    parser.add_argument(
        "--router-ttl",
        type=positive_float,
        default=None,
        help="kv mode: seconds a routed prompt's blocks count as cached on the worker "
        "without an event confirming them (default: 10 with events, 120 with "
        "--no-kv-events).",
    )
    parser.add_argument(
        "--router-replica-sync",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("DYN_ROUTER_REPLICA_SYNC", "1").lower() not in ("0", "false", "no"),
        help="kv mode: share this router's bookings of requests in flight with the other "
        "frontends' routers of the same endpoint (--http-workers processes, replicas on "
        "other hosts) over core NATS, so that replicas behind one load balancer see every "
        "worker's whole load and do not all send a burst to the same idle worker. Cheap: a "
        "lone replica only sends a heartbeat a second. --no-router-replica-sync keeps each "
        "router's books to itself; $DYN_ROUTER_REPLICA_SYNC=0 sets that default.",
    )
    parser.add_argument(
        "--busy-kv-usage",
        type=fraction,
        default=os.environ.get("DYN_BUSY_KV_USAGE") or None,
        help="kv mode: a worker whose KV cache is at least this full (0-1, from its load "
        "reports and this router's bookings) gets no new requests; when every worker is "
        "busy the request gets 503 with Retry-After. Default: $DYN_BUSY_KV_USAGE, else off.",
    )
    parser.add_argument(
        "--busy-waiting-requests",
        type=positive_int,
        default=os.environ.get("DYN_BUSY_WAITING_REQUESTS") or None,
        help="kv mode: a worker reporting at least this many waiting requests gets no new "
        "requests (503 with Retry-After when all are busy). "
        "Default: $DYN_BUSY_WAITING_REQUESTS, else off.",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest accepted request body; larger ones get HTTP 413.",
    )
    parser.add_argument(
        "--tokenizer-cache",
        type=Path,
        default=default_tokenizer_cache(),
        help="Directory where tokenizer files fetched from the model cards are kept.",
    )
    parser.add_argument(
        "--prefill-timeout",
        type=positive_float,
        default=DEFAULT_PREFILL_TIMEOUT_S,
        help="Seconds a disaggregated request waits for its prefill worker before the decode "
        "worker prefills it itself (counted in dynamo_frontend_prefill_fallbacks_total).",
    )
    parser.add_argument(
        "--worker-wait-timeout",
        type=non_negative_float,
        default=DEFAULT_WORKER_WAIT_S,
        help="Seconds a request for a served model waits for a ready worker (one restarting, "
        "a late lease heartbeat) before it fails with 503; 0 fails at once.",
    )
    parser.add_argument(
        "--first-token-timeout",
        type=non_negative_float,
        default=os.environ.get("DYN_FIRST_TOKEN_TIMEOUT", str(DEFAULT_FIRST_TOKEN_TIMEOUT_S)),
        help="Seconds a worker may take to send a request's first output (a long prefill "
        "under load) before it counts as lost: the request is cancelled there and placed "
        "on another worker, or fails. 0 disables; $DYN_FIRST_TOKEN_TIMEOUT overrides the "
        "default.",
    )
    parser.add_argument(
        "--inter-token-timeout",
        type=non_negative_float,
        default=os.environ.get("DYN_INTER_TOKEN_TIMEOUT", str(DEFAULT_INTER_TOKEN_TIMEOUT_S)),
        help="Seconds a worker may go between two outputs of a request before it counts as "
        "lost (it holds its lease but stopped producing): the request is cancelled there "
        "and migrated (the workers' --migration-limit) or fails with an error event. "
        "0 disables; $DYN_INTER_TOKEN_TIMEOUT overrides the default.",
    )
    parser.add_argument(
        "--accept-timeout",
        type=non_negative_float,
        default=os.environ.get("DYN_ACCEPT_TIMEOUT", str(DEFAULT_ACCEPT_TIMEOUT_S)),
        help="Seconds a worker may take to confirm that a request reached it (it does so "
        "at once, before any compute) before the request counts as lost on its way (a NATS "
        "node failing while routing it) or the worker as frozen: the request is cancelled "
        "there and placed on another worker. 0 disables; $DYN_ACCEPT_TIMEOUT overrides "
        "the default.",
    )
    add_http_hardening_arguments(parser)
    parser.add_argument(
        "--return-spec-stats",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("DYN_RETURN_SPEC_STATS", "").lower() in ("1", "true", "yes"),
        help="Add each request's speculative decoding statistics (`metrics.speculative_"
        "decoding`, beside usage) to every response, as a request's own "
        '`"return_spec_stats": true` does. $DYN_RETURN_SPEC_STATS=1 turns it on.',
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=os.environ.get("DYN_CHAT_TEMPLATE") or None,
        help="Jinja chat template used instead of the model's own, e.g. one with a tools "
        "section (examples/chat_templates/smollm2_tools.jinja); checked at start-up. "
        "$DYN_CHAT_TEMPLATE sets the default.",
    )
    parser.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        default=os.environ.get("DYN_TOOL_CALL_PARSER") or None,
        help="vLLM tool parser (e.g. `hermes`) that reads tool calls from the model's text "
        "when `tool_choice` is `auto` (the default with `tools`); without it such requests "
        "are refused. $DYN_TOOL_CALL_PARSER sets the default.",
    )
    parser.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        default=os.environ.get("DYN_REASONING_PARSER") or None,
        help="vLLM reasoning parser (e.g. `deepseek_r1`, `qwen3`) that moves a reasoning "
        "model's thinking out of `content` into `reasoning_content`; unknown names are a "
        "start-up error listing the valid ones. $DYN_REASONING_PARSER sets the default.",
    )
    add_log_level_argument(parser)
    return parser


def add_http_hardening_arguments(parser: argparse.ArgumentParser) -> None:
    """API key, admission bounds and connection timeouts (docs/frontend.md, "Authentication"
    and "Limits and overload"); each also read from a `DYN_*` variable."""
    group = parser.add_argument_group("HTTP authentication and limits")
    group.add_argument(
        "--api-key",
        default=argparse.SUPPRESS,  # never shown by --help, nor in the process's defaults
        help="Require `Authorization: Bearer <key>` on every route except /health, /live and "
        "/metrics (401 otherwise). Default: $DYN_API_KEY; unset or empty serves without "
        "authentication. Prefer the variable: a flag is visible in the process list.",
    )
    group.add_argument(
        "--max-inflight-requests",
        type=positive_int,
        default=os.environ.get("DYN_MAX_INFLIGHT_REQUESTS", str(DEFAULT_MAX_INFLIGHT)),
        help="Per model, the most requests admitted at once (streams included); more get "
        "503 with Retry-After at once. $DYN_MAX_INFLIGHT_REQUESTS overrides the default.",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=non_negative_int,
        default=os.environ.get("DYN_MAX_WAITING_REQUESTS", str(DEFAULT_MAX_WAITING)),
        help="Per model, the most requests waiting for a ready worker (see "
        "--worker-wait-timeout); more get 503 with Retry-After at once. "
        "$DYN_MAX_WAITING_REQUESTS overrides the default.",
    )
    group.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=os.environ.get("DYN_HTTP_KEEP_ALIVE_TIMEOUT", str(DEFAULT_KEEP_ALIVE_TIMEOUT_S)),
        help="Seconds an idle client connection is kept open (from its opening or its last "
        "response until a complete request head). $DYN_HTTP_KEEP_ALIVE_TIMEOUT overrides "
        "the default.",
    )
    group.add_argument(
        "--header-timeout",
        type=positive_float,
        default=os.environ.get("DYN_HTTP_HEADER_TIMEOUT", str(DEFAULT_HEADER_TIMEOUT_S)),
        help="Seconds a client has, from the first byte of a request, to send the complete "
        "request head; the connection is closed otherwise (slow-header clients). "
        "$DYN_HTTP_HEADER_TIMEOUT overrides the default.",
    )
    group.add_argument(
        "--write-timeout",
        type=non_negative_float,
        default=os.environ.get("DYN_HTTP_WRITE_TIMEOUT", str(DEFAULT_WRITE_TIMEOUT_S)),
        help="Seconds a streamed response waits for a client that stopped reading before "
        "the connection is dropped and the request cancelled; 0 waits for ever. "
        "$DYN_HTTP_WRITE_TIMEOUT overrides the default.",
    )


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """The frontend's settings; ConfigError for contradictory NATS settings."""
    nats_server = vars(args).get("nats_server") or nats_url_from_env()
    return FrontendConfig(
        http_host=args.http_host,
        http_port=args.http_port,
        namespace=args.namespace,
        nats_server=nats_server,
        nats_options=nats_options_from_args(args, url=nats_server),
        router_mode=RouterMode(args.router_mode),
        kv_overlap_score_weight=args.kv_overlap_score_weight,
        router_temperature=args.router_temperature,
        busy_kv_usage=args.busy_kv_usage,
        busy_waiting_requests=args.busy_waiting_requests,
        kv_events=not args.no_kv_events,
        router_ttl_s=args.router_ttl,
        router_replica_sync=args.router_replica_sync,
        max_request_bytes=args.max_request_bytes,
        tokenizer_cache=args.tokenizer_cache,
        prefill_timeout_s=args.prefill_timeout,
        worker_wait_s=args.worker_wait_timeout,
        first_token_timeout_s=args.first_token_timeout,
        inter_token_timeout_s=args.inter_token_timeout,
        accept_timeout_s=args.accept_timeout,
        api_key=vars(args).get("api_key") or os.environ.get("DYN_API_KEY") or None,
        max_inflight_requests=args.max_inflight_requests,
        max_waiting_requests=args.max_waiting_requests,
        keep_alive_timeout_s=args.keep_alive_timeout,
        header_timeout_s=args.header_timeout,
        write_timeout_s=args.write_timeout,
        return_spec_stats=args.return_spec_stats,
        chat_template=_chat_template(args.chat_template),
        chat_parsing=ChatParsingOptions(
            tool_call_parser=_tool_call_parser(args.tool_call_parser),
            reasoning_parser=_reasoning_parser(args.reasoning_parser),
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
