"""How a process authenticates to NATS and secures the connection: one set of flags and
environment variables for every component, checked before anything connects.

Every command line (frontend, vLLM worker, mocker, `python -m dynamo.runtime`) calls
`add_nats_arguments`, so the flags are spelled, documented and validated the same way
everywhere, and every process reads the same environment variables (a flag wins over its
variable). What nats-py supports is offered, mapped to its own `connect` keywords:

| flag | variable | nats-py |
| --- | --- | --- |
| `--nats-creds FILE` | `NATS_CREDS` | `user_credentials` (JWT + NKey seed file) |
| `--nats-nkey-seed FILE` | `NATS_NKEY_SEED` | `nkeys_seed` |
| `--nats-user` / `--nats-password` | `NATS_USER` / `NATS_PASSWORD` | `user` / `password` |
| `--nats-token` | `NATS_TOKEN` | `token` |
| `--nats-tls-ca` / `--nats-tls-cert` / `--nats-tls-key` | `NATS_TLS_CA` / `_CERT` / `_KEY` | `tls` (an `ssl.SSLContext`) |
| `--nats-tls-hostname` | `NATS_TLS_HOSTNAME` | `tls_hostname` |

One more setting says how the process uses a cluster, not how it connects:
`--nats-replicas N` (`$DYN_NATS_REPLICAS`, default 1) is the replica count of every
JetStream bucket and stream the runtime creates (3 on a three-node cluster, so losing one
node loses nothing). The server list itself is `--nats-server`, comma-separated.

Secrets never reach a log: `NatsConnectOptions`' repr leaves out the password and the
token, `describe()` says only which method is in use, and `redact_url` masks the userinfo
of a URL that carries credentials (`nats://user:pass@host` still works as before).
Contradictory settings (a token and a user, a certificate without its key, a file that
does not exist) raise `ConfigError` before any connection is attempted.
"""

from __future__ import annotations

import argparse
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dynamo.runtime.cli import ConfigError

REDACTED = "***"

ENV_NATS_REPLICAS = "DYN_NATS_REPLICAS"
MAX_REPLICAS = 5
"""JetStream's own limit on a stream's replica count."""

NKEYS_HINT = "pip install 'nats-py[nkeys]'"


class ArgumentContainer(Protocol):
    """An `argparse.ArgumentParser` or one of its argument groups."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


@dataclass(frozen=True)
class _Setting:
    """One connection setting: its field, flag, variable and help text (the one table
    that flags, environment lookup and error messages are built from)."""

    name: str
    env: str
    help: str
    metavar: str
    is_file: bool = False

    @property
    def flag(self) -> str:
        return "--nats-" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return f"nats_{self.name}"

    @property
    def label(self) -> str:
        """How errors name the setting: both of its sources."""
        return f"{self.flag} (${self.env})"


_SETTINGS: tuple[_Setting, ...] = (
    _Setting(
        "creds",
        "NATS_CREDS",
        "NATS credentials file (user JWT and NKey seed, as `nsc` writes it).",
        "FILE",
        is_file=True,
    ),
    _Setting(
        "nkey_seed",
        "NATS_NKEY_SEED",
        "File holding an NKey seed (SU...) whose public key the server lists as a user.",
        "FILE",
        is_file=True,
    ),
    _Setting("user", "NATS_USER", "User name for user/password authentication.", "NAME"),
    _Setting(
        "password",
        "NATS_PASSWORD",
        "Password for --nats-user. Prefer the environment variable: a flag is visible to "
        "every user of the machine in the process list.",
        "SECRET",
    ),
    _Setting(
        "token",
        "NATS_TOKEN",
        "Authentication token. Prefer the environment variable (see --nats-password).",
        "SECRET",
    ),
    _Setting(
        "tls_ca",
        "NATS_TLS_CA",
        "CA certificate (PEM) that signed the server's certificate; turns TLS on.",
        "FILE",
        is_file=True,
    ),
    _Setting(
        "tls_cert",
        "NATS_TLS_CERT",
        "Client certificate (PEM) for servers that verify clients; needs --nats-tls-key.",
        "FILE",
        is_file=True,
    ),
    _Setting(
        "tls_key",
        "NATS_TLS_KEY",
        "Private key (PEM) of --nats-tls-cert.",
        "FILE",
        is_file=True,
    ),
    _Setting(
        "tls_hostname",
        "NATS_TLS_HOSTNAME",
        "Name the server's certificate must carry, when it differs from the URL's host "
        "(e.g. connecting by IP address).",
        "NAME",
    ),
)
_BY_NAME = {setting.name: setting for setting in _SETTINGS}


def setting_label(name: str) -> str:
    """`--nats-<name> ($NATS_<NAME>)`, for messages that point at one setting."""
    return _BY_NAME[name].label


@dataclass(frozen=True)
class NatsConnectOptions:
    """Authentication and TLS settings of one NATS connection (empty: neither).

    Build it with `from_args` / `from_env`, which validate; `connect_kwargs()` gives
    nats-py's keywords. The password and the token are left out of `repr`.
    """

    creds: Path | None = None
    nkey_seed: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_hostname: str | None = None
    replicas: int = 1
    """Replica count of the JetStream buckets and streams this process creates."""

    # ------------------------------------------------------------------ building

    @classmethod
    def from_values(
        cls, given: Mapping[str, str | None], env: Mapping[str, str] | None = None
    ) -> NatsConnectOptions:
        """Settings by field name (`given`, e.g. parsed flags), each falling back to its
        environment variable; validated (raises ConfigError)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for setting in _SETTINGS:
            text = given.get(setting.name) or env.get(setting.env, "").strip() or None
            if text is not None:
                values[setting.name] = Path(text).expanduser() if setting.is_file else text
        values["replicas"] = _replicas(given.get("replicas"), env)
        options = cls(**values)
        options.validate()
        return options

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NatsConnectOptions:
        """The settings of the `NATS_*` environment variables alone (validated)."""
        return cls.from_values({}, env)

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ConfigError for contradictory settings, missing files, an unusable
        certificate or key, or NKey authentication without the `nkeys` package."""
        methods = [
            name
            for name, present in (
                ("creds", self.creds),
                ("nkey_seed", self.nkey_seed),
                ("user", self.user or self.password),
                ("token", self.token),
            )
            if present
        ]
        if len(methods) > 1:
            named = " and ".join(setting_label(name) for name in methods)
            raise ConfigError(f"{named} are different authentication methods: give only one")
        if bool(self.user) != bool(self.password):
            missing = "password" if self.user else "user"
            raise ConfigError(
                f"user/password authentication needs both: {setting_label(missing)} is missing"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            missing = "tls_key" if self.tls_cert else "tls_cert"
            raise ConfigError(f"a TLS client certificate needs its key: {setting_label(missing)}")
        for name, path in self._files().items():
            if not path.is_file():
                raise ConfigError(f"{setting_label(name)}: no such file: {path}")
        if (self.creds or self.nkey_seed) and not _nkeys_available():
            name = "creds" if self.creds else "nkey_seed"
            raise ConfigError(f"{setting_label(name)} needs the `nkeys` package ({NKEYS_HINT})")
        if self.uses_tls:
            self.ssl_context()

    def check_url(self, url: str) -> None:
        """Raise ConfigError when `url` carries credentials and these options do too
        (nats-py would silently ignore the URL's)."""
        if self.has_auth and url_has_credentials(url):
            raise ConfigError(
                f"the NATS URL {redact_url(url)} carries credentials and so do the "
                f"{self.auth_method} settings: give them in one place"
            )

    # ------------------------------------------------------------------ use

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_key)

    @property
    def has_auth(self) -> bool:
        return bool(self.creds or self.nkey_seed or self.user or self.password or self.token)

    @property
    def auth_method(self) -> str:
        """`creds`, `nkey`, `user/password`, `token` or `none`: safe to log."""
        if self.creds:
            return "creds"
        if self.nkey_seed:
            return "nkey"
        if self.user or self.password:
            return "user/password"
        return "token" if self.token else "none"

    def describe(self, url: str | None = None) -> str:
        """What a log line may say about these settings (and `url`'s scheme and
        credentials): the method, the user name and the TLS files, never a secret."""
        auth = self.auth_method
        if self.user:
            auth += f" (user {self.user!r})"
        elif auth == "none" and url is not None and url_has_credentials(url):
            auth = "from the URL"
        tls = "off"
        if url is not None and is_tls_url(url):
            tls = "on, system CAs"
        if self.uses_tls:
            parts = [f"CA {self.tls_ca}" if self.tls_ca else "system CAs"]
            if self.tls_cert:
                parts.append(f"client certificate {self.tls_cert}")
            tls = "on, " + ", ".join(parts)
        return f"auth {auth}, TLS {tls}"

    def ssl_context(self) -> ssl.SSLContext:
        """A client context verifying the server against `tls_ca` (else the system's
        CAs), presenting `tls_cert` when given; ConfigError when a file is unusable."""
        try:
            context = ssl.create_default_context(
                ssl.Purpose.SERVER_AUTH, cafile=str(self.tls_ca) if self.tls_ca else None
            )
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"{setting_label('tls_ca')}: not a usable CA file: {exc}") from None
        if self.tls_cert and self.tls_key:
            try:
                context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    f"{setting_label('tls_cert')} / {setting_label('tls_key')}: "
                    f"not a usable certificate and key: {exc}"
                ) from None
        return context

    def connect_kwargs(self) -> dict[str, Any]:
        """nats-py `connect` keywords for these settings (only those that are set)."""
        kwargs: dict[str, Any] = {}
        if self.creds:
            kwargs["user_credentials"] = str(self.creds)
        if self.nkey_seed:
            kwargs["nkeys_seed"] = str(self.nkey_seed)
        if self.user:
            kwargs["user"] = self.user
            kwargs["password"] = self.password
        if self.token:
            kwargs["token"] = self.token
        if self.uses_tls:
            kwargs["tls"] = self.ssl_context()
        if self.tls_hostname:
            kwargs["tls_hostname"] = self.tls_hostname
        return kwargs

    def _files(self) -> dict[str, Path]:
        """The file settings that are set, by setting name."""
        files = {
            "creds": self.creds,
            "nkey_seed": self.nkey_seed,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
        }
        return {name: path for name, path in files.items() if path is not None}


def _replicas(given: str | int | None, env: Mapping[str, str]) -> int:
    """The replica count from the flag, else `$DYN_NATS_REPLICAS`, else 1; ConfigError
    for anything but a whole number from 1 to JetStream's limit."""
    source = "--nats-replicas" if given is not None else f"${ENV_NATS_REPLICAS}"
    text = str(given) if given is not None else env.get(ENV_NATS_REPLICAS, "").strip()
    if not text:
        return 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_REPLICAS:
        raise ConfigError(
            f"{source}: the replica count must be a whole number from 1 to {MAX_REPLICAS} "
            f"(JetStream's limit), got {text!r}"
        )
    return value


def _nkeys_available() -> bool:
    try:
        import nkeys  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------- command lines


def add_nats_arguments(container: ArgumentContainer) -> None:
    """Add the `--nats-*` authentication, TLS and replica flags (not `--nats-server`, which each
    component documents with its own default). A flag not given is absent from the
    parsed namespace (no default), so `--help` never prints a value taken from the
    environment, a secret included; `nats_options_from_args` applies the variables."""
    for setting in _SETTINGS:
        container.add_argument(
            setting.flag,
            dest=setting.dest,
            metavar=setting.metavar,
            default=argparse.SUPPRESS,
            help=f"{setting.help} Default: ${setting.env}.",
        )
    container.add_argument(
        "--nats-replicas",
        dest="nats_replicas",
        metavar="N",
        default=argparse.SUPPRESS,
        help="Replica count of every JetStream bucket and stream this process creates "
        "(registrations, model cards, tokenizer files, KV events): 3 on a three-node NATS "
        "cluster, so losing one node loses nothing; at most the cluster's size. A bucket "
        "that already exists keeps its own count (a warning says so). "
        f"Default: ${ENV_NATS_REPLICAS}, else 1.",
    )


def nats_options_from_args(
    args: argparse.Namespace | Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    *,
    url: str | None = None,
) -> NatsConnectOptions:
    """The options from flags added by `add_nats_arguments` (a flag wins over its
    variable), validated, also against `url` when given; raises ConfigError."""
    parsed = vars(args) if isinstance(args, argparse.Namespace) else args
    given = {setting.name: parsed.get(setting.dest) for setting in _SETTINGS}
    given["replicas"] = parsed.get("nats_replicas")
    options = NatsConnectOptions.from_values(given, env)
    if url is not None:
        options.check_url(url)
    return options


# ---------------------------------------------------------------------- URLs


def split_urls(url: str) -> list[str]:
    """The servers of a comma-separated NATS URL list (`nats://a:4222,nats://b:4222`),
    blanks dropped: a cluster's clients are given all of them."""
    return [part.strip() for part in url.split(",") if part.strip()]


# The user information is everything before the *last* `@` of the authority (which ends
# at the first `/`, `?` or `#`): that is where `urllib.parse`, and so nats-py, splits it,
# so a password containing `@` is redacted whole.
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?(?P<userinfo>[^/?#]*)@")


def is_tls_url(url: str) -> bool:
    """Whether `url` names its server with the `tls://` scheme (TLS asked for by the URL)."""
    return url.strip().lower().startswith("tls://")


def url_has_credentials(url: str) -> bool:
    """True when any server of `url` (comma-separated) carries a user, password or token."""
    return any(_USERINFO.match(part.strip()) for part in url.split(","))


def redact_url(url: str) -> str:
    """`url` as a log line may show it: `nats://user:pass@host` → `nats://user:***@host`,
    a token (`nats://token@host`) → `nats://***@host`; every server of a comma-separated
    list; URLs without credentials unchanged."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(part: str) -> str:
    match = _USERINFO.match(part.strip())
    if match is None:
        return part
    user, sep, _secret = match["userinfo"].partition(":")
    shown = f"{user}:{REDACTED}" if sep else REDACTED
    return f"{match['scheme'] or ''}{shown}@{part.strip()[match.end() :]}"
