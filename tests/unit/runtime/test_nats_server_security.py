"""`python -m dynamo.nats_server`'s authentication and TLS settings
(`ServerSecurity`): one method at most, TLS files that go together, flags over the
variables the clients read, and a configuration text that carries secrets verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.nats_server import ServerSecurity
from dynamo.nats_server.cli import build_parser, main, security_from_args


def parse(*argv: str, env: dict[str, str] | None = None) -> ServerSecurity:
    return security_from_args(build_parser().parse_args(list(argv)), env or {})


def test_nothing_configured_means_no_config_file() -> None:
    security = parse()
    assert not security.configured and not security.tls


def test_variables_are_the_clients_and_flags_win() -> None:
    env = {"NATS_USER": "u", "NATS_PASSWORD": "p", "NATS_TOKEN": ""}
    assert parse(env=env) == ServerSecurity(user="u", password="p")
    assert parse("--user", "other", env=env).user == "other"


def test_tls_files_from_variables(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for path in (cert, key, ca):
        path.write_text("x")
    env = {
        "NATS_SERVER_TLS_CERT": str(cert),
        "NATS_SERVER_TLS_KEY": str(key),
        "NATS_SERVER_TLS_CA": str(ca),
        "NATS_SERVER_TLS_VERIFY": "1",
    }
    security = parse(env=env)
    assert (security.tls_cert, security.tls_key, security.tls_ca) == (cert, key, ca)
    assert security.verify_clients and security.tls
    text = security.config_text()
    assert f'cert_file: "{cert}"' in text and "verify: true" in text


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"user": "u", "password": "p", "token": "t"}, "one of"),
        ({"token": "t", "nkeys": ("UABC",)}, "one of"),
        ({"user": "u"}, "both a user and a password"),
        ({"tls_cert": Path("c")}, "certificate and its key"),
        ({"tls_ca": Path("ca")}, "needs --tls-cert"),
        ({"tls_cert": Path("c"), "tls_key": Path("k"), "verify_clients": True}, "the CA"),
    ],
)
def test_contradictions_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ServerSecurity(**kwargs)  # type: ignore[arg-type]


def test_missing_file_and_bad_combinations_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("NATS_USER", "NATS_PASSWORD", "NATS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", "x"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["--user", "u", "--password", "p", "--token", "t"]) == 2
    assert "error: give one of" in capsys.readouterr().err


def test_secrets_are_quoted_verbatim_and_kept_out_of_repr() -> None:
    password = 'p"a{s}s$w\\o rd#'
    security = ServerSecurity(user="u", password=password)
    assert password not in repr(security)
    assert 'password: "p\\"a{s}s$w\\\\o rd#"' in security.config_text()
    users = ServerSecurity(nkeys=("UA", "UB")).config_text()
    assert 'users: [{nkey: "UA"}, {nkey: "UB"}]' in users
