"""`python -m dynamo.frontend`: the OpenAI-compatible HTTP frontend.

Connects to NATS, discovers the models workers register, and serves them over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import prometheus_client
import uvloop

from dynamo.frontend.disagg import DEFAULT_PREFILL_TIMEOUT_S
from dynamo.frontend.frontend import FrontendConfig, default_tokenizer_cache, run_frontend
from dynamo.frontend.http_server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_WORKER_WAIT_S
from dynamo.frontend.routing import RouterMode
from dynamo.runtime.cli import non_negative_float, port, positive_float, positive_int


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
        "--namespace",
        default="dynamo",
        help="Dynamo namespace whose model cards (workers) this frontend serves.",
    )
    parser.add_argument(
        "--nats-server",
        default=os.environ.get("NATS_SERVER", "nats://127.0.0.1:4222"),
        help="NATS URL used for discovery and requests; $NATS_SERVER overrides the default.",
    )
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
        default=1.0,
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
        "--log-level",
        default=os.environ.get("DYN_LOG", "INFO").upper(),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Log verbosity; $DYN_LOG overrides the default.",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        http_host=args.http_host,
        http_port=args.http_port,
        namespace=args.namespace,
        nats_server=args.nats_server,
        router_mode=RouterMode(args.router_mode),
        kv_overlap_score_weight=args.kv_overlap_score_weight,
        router_temperature=args.router_temperature,
        max_request_bytes=args.max_request_bytes,
        tokenizer_cache=args.tokenizer_cache,
        prefill_timeout_s=args.prefill_timeout,
        worker_wait_s=args.worker_wait_timeout,
    )


async def _serve(config: FrontendConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await run_frontend(config, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # prometheus_client adds a `<name>_created` timestamp series next to every counter,
    # histogram and labelled child: noise that doubles /metrics and that Prometheus
    # itself does not need. The switch is process-wide, so it is set here, not in the
    # library code that tests embed.
    prometheus_client.disable_created_metrics()
    config = config_from_args(args)
    uvloop.run(_serve(config))  # faster socket I/O than asyncio's loop for many streams
    return 0


if __name__ == "__main__":
    sys.exit(main())
