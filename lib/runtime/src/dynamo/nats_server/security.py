"""What a managed nats-server demands of its clients, and how that reaches the server.

`ServerSecurity` holds the authentication method (user/password, token or NKey users) and
the TLS files; `config_text()` renders them as nats-server configuration, and
`private_config_file` puts that text where only this user can read it, for as long as the
server needs to read it: it may carry a password. `NatsServer(security=...)` and
`python -m dynamo.nats_server --user ...` use both.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServerSecurity:
    """What a managed nats-server demands of its clients: at most one of user/password,
    token or NKey users, and TLS when `tls_cert`/`tls_key` are given (`tls_ca` plus
    `verify_clients`: clients must present a certificate signed by that CA). The
    password and the token are left out of `repr`."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkeys: tuple[str, ...] = ()
    """Public NKeys (U...) allowed to connect, each proving itself with its seed."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    verify_clients: bool = False

    def __post_init__(self) -> None:
        methods = sum(bool(m) for m in (self.user or self.password, self.token, self.nkeys))
        if methods > 1:
            raise ValueError("give one of user/password, token or nkeys, not several")
        if bool(self.user) != bool(self.password):
            raise ValueError("user/password authentication needs both a user and a password")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate and its key")
        if (self.tls_ca or self.verify_clients) and not self.tls_cert:
            raise ValueError("a TLS CA or client verification needs --tls-cert/--tls-key")
        if self.verify_clients and not self.tls_ca:
            raise ValueError("verifying client certificates needs the CA that signs them")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def configured(self) -> bool:
        return bool(self.user or self.token or self.nkeys or self.tls)

    def config_text(self) -> str:
        """The nats-server configuration for these settings (strings JSON-quoted, which
        the server's parser reads back verbatim, escapes included)."""
        q = json.dumps
        lines: list[str] = []
        if self.user:
            lines += ["authorization {", f"  user: {q(self.user)}"]
            lines += [f"  password: {q(self.password)}", "}"]
        elif self.token:
            lines += ["authorization {", f"  token: {q(self.token)}", "}"]
        elif self.nkeys:
            users = ", ".join(f"{{nkey: {q(key)}}}" for key in self.nkeys)
            lines += ["authorization {", f"  users: [{users}]", "}"]
        if self.tls:
            lines += ["tls {", f"  cert_file: {q(str(self.tls_cert))}"]
            lines += [f"  key_file: {q(str(self.tls_key))}"]
            if self.tls_ca:
                lines.append(f"  ca_file: {q(str(self.tls_ca))}")
            if self.verify_clients:
                lines.append("  verify: true")
            lines += ["  timeout: 5", "}"]
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def private_config_file(security: ServerSecurity) -> Iterator[Path | None]:
    """A nats-server config file readable only by us, for as long as the server needs to
    read it (it may hold a password); None when there is nothing to configure."""
    if not security.configured:
        yield None
        return
    directory = tempfile.mkdtemp(prefix="dyn-nats-conf-")  # mode 0700
    try:
        path = Path(directory) / "nats-server.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(security.config_text())
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
