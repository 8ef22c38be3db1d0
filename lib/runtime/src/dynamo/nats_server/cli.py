"""`python -m dynamo.nats_server`: a nats-server with JetStream in the foreground, or a
local cluster of them, optionally with authentication and TLS (docs/runtime.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from dynamo.nats_server.cluster import NatsCluster
from dynamo.nats_server.security import ServerSecurity
from dynamo.nats_server.server import (
    NatsServer,
    NatsServerError,
)

log = logging.getLogger(__name__)

ENV_SERVER_TLS_CERT = "NATS_SERVER_TLS_CERT"
ENV_SERVER_TLS_KEY = "NATS_SERVER_TLS_KEY"
ENV_SERVER_TLS_CA = "NATS_SERVER_TLS_CA"
ENV_SERVER_TLS_VERIFY = "NATS_SERVER_TLS_VERIFY"
_TRUE = {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.nats_server",
        description=(
            "Run a nats-server with JetStream in the foreground (Ctrl-C stops it). The "
            "authentication flags default to the variables the components read "
            "($NATS_USER, $NATS_PASSWORD, $NATS_TOKEN), so one environment configures the "
            "server and its clients alike; see docs/runtime.md, Securing NATS."
        ),
    )
    parser.add_argument(
        "--port",
        type=int,
        default=4222,
        help="client port (0 = ephemeral); with --cluster-size N, node i listens on PORT+i",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--store-dir", type=Path, default=None,
        help="JetStream store directory (default: a temporary one, removed on exit); with "
        "--cluster-size, one subdirectory per node",
    )  # fmt: skip
    parser.add_argument(
        "--cluster-size",
        type=int,
        default=1,
        metavar="N",
        help="run a local JetStream cluster of N nodes instead of one server (3 tolerates "
        "the loss of any one node); prints the comma-separated URL list to give components "
        "as --nats-server, with --nats-replicas N",
    )
    auth = parser.add_argument_group("authentication (at most one method)")
    auth.add_argument("--user", default=None, help="require this user (default: $NATS_USER)")
    auth.add_argument(
        "--password",
        default=None,
        help="password of --user (default: $NATS_PASSWORD; prefer the variable: flags show "
        "in the process list)",
    )
    auth.add_argument("--token", default=None, help="require this token (default: $NATS_TOKEN)")
    auth.add_argument(
        "--nkey",
        action="append",
        default=[],
        metavar="PUBLIC_KEY",
        help="allow the user with this public NKey (U...); repeatable",
    )
    tls = parser.add_argument_group("TLS")
    tls.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        help=f"server certificate (PEM); turns TLS on (default: ${ENV_SERVER_TLS_CERT})",
    )
    tls.add_argument(
        "--tls-key", type=Path, default=None, help=f"its key (default: ${ENV_SERVER_TLS_KEY})"
    )
    tls.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        help=f"CA that signs client certificates (default: ${ENV_SERVER_TLS_CA})",
    )
    tls.add_argument(
        "--tls-verify",
        action="store_true",
        default=None,
        help="require clients to present a certificate signed by --tls-ca "
        f"(default: ${ENV_SERVER_TLS_VERIFY}=1)",
    )
    return parser


def security_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ServerSecurity:
    """The server's security settings, flags over variables; ValueError when they
    contradict each other or name a missing file."""
    env = os.environ if env is None else env

    def pick(given: str | None, variable: str) -> str | None:
        return given or env.get(variable, "").strip() or None

    def pick_path(given: Path | None, variable: str) -> Path | None:
        text = str(given) if given else env.get(variable, "").strip()
        if not text:
            return None
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"no such file: {path} (from {'a flag' if given else '$' + variable})")
        return path

    verify = args.tls_verify or env.get(ENV_SERVER_TLS_VERIFY, "").strip().lower() in _TRUE
    return ServerSecurity(
        user=pick(args.user, "NATS_USER"),
        password=pick(args.password, "NATS_PASSWORD"),
        token=pick(args.token, "NATS_TOKEN"),
        nkeys=tuple(args.nkey),
        tls_cert=pick_path(args.tls_cert, ENV_SERVER_TLS_CERT),
        tls_key=pick_path(args.tls_key, ENV_SERVER_TLS_KEY),
        tls_ca=pick_path(args.tls_ca, ENV_SERVER_TLS_CA),
        verify_clients=verify,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        security = security_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cluster_size < 1:
        print("error: --cluster-size must be at least 1", file=sys.stderr)
        return 2
    server: NatsServer | NatsCluster
    if args.cluster_size == 1:
        server = NatsServer(
            args.port or None, host=args.host, store_dir=args.store_dir, security=security
        )
    else:
        ports = [args.port + i for i in range(args.cluster_size)] if args.port else None
        server = NatsCluster(
            args.cluster_size,
            host=args.host,
            ports=ports,
            store_root=args.store_dir,
            security=security,
        )
    try:
        server.start()
    except NatsServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if isinstance(server, NatsCluster):
        print(
            f"nats cluster of {args.cluster_size} ready at {server.url} (stores under "
            f"{server.store_root}); give components --nats-server {server.url} "
            f"--nats-replicas {min(args.cluster_size, 3)}",
            flush=True,
        )
    else:
        print(f"nats-server ready at {server.url} (store {server.store_dir})", flush=True)
    stop = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop and _alive(server):
            time.sleep(0.2)
    finally:
        server.close()
    return 0


def _alive(server: NatsServer | NatsCluster) -> bool:
    """A lone server while it runs; a cluster while any node does."""
    if isinstance(server, NatsCluster):
        return any(node.running for node in server.nodes)
    return server.running
