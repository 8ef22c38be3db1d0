"""NATS authentication and TLS settings: flags over variables, contradictions and missing
files refused before connecting, secrets kept out of reprs, help texts and logged URLs.

Claims: the same flags in every component (frontend, mocker, `python -m dynamo.runtime`);
a flag wins over its variable; user+token, user without password, certificate without
key, a missing or unusable file, and credentials in both the URL and the settings are
`ConfigError`s naming the settings; the options map to nats-py's own keywords; the
password and the token never appear in `repr`, `describe()`, `--help` or a redacted URL.
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.parse
from pathlib import Path

import pytest

from dynamo.frontend.__main__ import build_parser as frontend_parser
from dynamo.frontend.__main__ import config_from_args
from dynamo.frontend.__main__ import main as frontend_main
from dynamo.mocker.args import build_parser as mocker_parser
from dynamo.mocker.args import parse_args as mocker_parse_args
from dynamo.runtime.__main__ import build_parser as runtime_cli_parser
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.nats_options import (
    NatsConnectOptions,
    add_nats_arguments,
    nats_options_from_args,
    redact_url,
    url_has_credentials,
)
from dynamo.testing.environment import unset_variables_fixture
from dynamo.testing.tls import make_test_pki

SECRET = "s3cr3t-Pa55"
NATS_VARIABLES = (
    "NATS_SERVER",
    "NATS_CREDS",
    "NATS_NKEY_SEED",
    "NATS_USER",
    "NATS_PASSWORD",
    "NATS_TOKEN",
    "NATS_TLS_CA",
    "NATS_TLS_CERT",
    "NATS_TLS_KEY",
    "NATS_TLS_HOSTNAME",
)

_clean_env = unset_variables_fixture(*NATS_VARIABLES)


def parse(*argv: str, env: dict[str, str] | None = None) -> NatsConnectOptions:
    parser = argparse.ArgumentParser()
    add_nats_arguments(parser)
    return nats_options_from_args(parser.parse_args(list(argv)), env or {})


# --------------------------------------------------------------------------- sources


def test_nothing_given_is_no_auth_and_no_tls() -> None:
    options = parse()
    assert options == NatsConnectOptions()
    assert options.connect_kwargs() == {}
    assert options.describe() == "auth none, TLS off"


def test_variables_apply_and_a_flag_wins() -> None:
    env = {"NATS_USER": "env-user", "NATS_PASSWORD": SECRET}
    assert parse(env=env) == NatsConnectOptions(user="env-user", password=SECRET)
    flagged = parse("--nats-user", "flag-user", env=env)
    assert (flagged.user, flagged.password) == ("flag-user", SECRET)


def test_empty_variables_count_as_unset() -> None:
    assert parse(env={"NATS_TOKEN": "  ", "NATS_USER": ""}) == NatsConnectOptions()


def test_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_TOKEN", SECRET)
    assert NatsConnectOptions.from_env().token == SECRET


def test_options_map_to_nats_py_keywords(tmp_path: Path) -> None:
    seed = tmp_path / "user.nk"
    seed.write_text("SU...")
    assert parse("--nats-user", "u", "--nats-password", SECRET).connect_kwargs() == {
        "user": "u",
        "password": SECRET,
    }
    assert parse("--nats-token", SECRET).connect_kwargs() == {"token": SECRET}
    assert parse("--nats-nkey-seed", str(seed)).connect_kwargs() == {"nkeys_seed": str(seed)}
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----")
    assert parse("--nats-creds", str(creds)).connect_kwargs() == {"user_credentials": str(creds)}


def test_tls_files_build_a_verifying_context(tmp_path: Path) -> None:
    pki = make_test_pki(tmp_path)
    options = parse(
        "--nats-tls-ca",
        str(pki.ca),
        "--nats-tls-cert",
        str(pki.client_cert),
        "--nats-tls-key",
        str(pki.client_key),
        "--nats-tls-hostname",
        "localhost",
    )
    kwargs = options.connect_kwargs()
    context = kwargs["tls"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert kwargs["tls_hostname"] == "localhost"
    assert options.uses_tls and f"CA {pki.ca}" in options.describe()


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (
            ["--nats-token", SECRET, "--nats-user", "u", "--nats-password", SECRET],
            {},
            ["token", "user"],
        ),
        (["--nats-user", "u"], {"NATS_TOKEN": SECRET}, ["$NATS_TOKEN", "--nats-user"]),
        (["--nats-user", "u"], {}, ["--nats-password ($NATS_PASSWORD)", "missing"]),
        (["--nats-password", SECRET], {}, ["--nats-user", "missing"]),
    ],
)
def test_contradictory_auth_is_a_config_error(
    argv: list[str], env: dict[str, str], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse(*argv, env=env)
    for word in words:
        assert word in str(info.value)
    assert SECRET not in str(info.value)


def test_missing_files_are_named_before_connecting(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    for flag in ("--nats-creds", "--nats-nkey-seed", "--nats-tls-ca"):
        with pytest.raises(ConfigError, match=f"{flag}.*no such file: {missing}"):
            parse(flag, str(missing))


def test_certificate_and_key_come_together(tmp_path: Path) -> None:
    pki = make_test_pki(tmp_path)
    with pytest.raises(ConfigError, match="needs its key: --nats-tls-key"):
        parse("--nats-tls-cert", str(pki.client_cert))
    with pytest.raises(ConfigError, match="--nats-tls-cert"):
        parse("--nats-tls-key", str(pki.client_key))


def test_unusable_tls_files_are_config_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"--nats-tls-ca.*not a usable CA file"):
        parse("--nats-tls-ca", str(junk))
    with pytest.raises(ConfigError, match="not a usable certificate and key"):
        parse("--nats-tls-cert", str(junk), "--nats-tls-key", str(junk))


def test_nkey_authentication_without_the_nkeys_package_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = tmp_path / "user.nk"
    seed.write_text("SU...")
    monkeypatch.setitem(sys.modules, "nkeys", None)  # `import nkeys` now fails
    with pytest.raises(ConfigError, match=r"needs the `nkeys` package \(pip install"):
        parse("--nats-nkey-seed", str(seed))


def test_credentials_in_the_url_and_in_the_settings_contradict() -> None:
    parser = argparse.ArgumentParser()
    add_nats_arguments(parser)
    args = parser.parse_args(["--nats-token", SECRET])
    with pytest.raises(ConfigError) as info:
        nats_options_from_args(args, {}, url="nats://u:pw@h:4222")
    assert "nats://u:***@h:4222" in str(info.value) and "pw@" not in str(info.value)
    # Either place alone is fine.
    nats_options_from_args(args, {}, url="nats://h:4222")
    nats_options_from_args(parser.parse_args([]), {}, url="nats://u:pw@h:4222")


# --------------------------------------------------------------------------- secrets


def test_secrets_stay_out_of_repr_and_describe() -> None:
    for options in (
        NatsConnectOptions(user="alice", password=SECRET),
        NatsConnectOptions(token=SECRET),
    ):
        assert SECRET not in repr(options)
        assert SECRET not in options.describe()
    assert "user 'alice'" in NatsConnectOptions(user="alice", password=SECRET).describe()
    described = NatsConnectOptions().describe(f"nats://u:{SECRET}@h:4222")
    assert described == "auth from the URL, TLS off"
    assert NatsConnectOptions().describe("tls://h:4222") == "auth none, TLS on, system CAs"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:pw@h:4222", "nats://alice:***@h:4222"),
        ("nats://tok@h:4222", "nats://***@h:4222"),
        ("tls://alice:pw@h", "tls://alice:***@h"),
        ("alice:pw@h:4222", "alice:***@h:4222"),
        (
            "nats://a:x@h1:1,nats://h2:2,nats://t@h3:3",
            "nats://a:***@h1:1,nats://h2:2,nats://***@h3:3",
        ),
        ("nats://h:4222", "nats://h:4222"),
        ("nats://h:4222/path@odd", "nats://h:4222/path@odd"),
        ("nats://u:p@ss@127.0.0.1:4222", "nats://u:***@127.0.0.1:4222"),
        ("nats://to@k@en@h:1", "nats://***@h:1"),
        ("nats://u:p@s:s@h:1?x=@", "nats://u:***@h:1?x=@"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert url_has_credentials(url) == (shown != url)


@pytest.mark.parametrize(
    "url", ["nats://u:p@ss@127.0.0.1:4222", "nats://u:p@s:s@h:1", "tls://t@o@ken@h:4222"]
)
def test_redaction_hides_what_nats_py_sends_as_the_secret(url: str) -> None:
    """nats-py takes the user and password (or token) from `urllib.parse`, which splits the
    authority at its last `@`: none of that secret may survive redaction."""
    parsed = urllib.parse.urlparse(url)
    secret = parsed.password if parsed.password is not None else parsed.username
    assert secret
    shown_user = f"{parsed.username}:***" if parsed.password is not None else "***"
    host = parsed.netloc.rpartition("@")[2]
    assert redact_url(url) == f"{parsed.scheme}://{shown_user}@{host}"


@pytest.mark.parametrize("build", [frontend_parser, mocker_parser, runtime_cli_parser])
def test_every_component_has_the_flags_and_help_shows_no_secret(
    build, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_PASSWORD", SECRET)
    monkeypatch.setenv("NATS_SERVER", f"nats://alice:{SECRET}@h:4222")
    text = build().format_help()
    for flag in ("--nats-user", "--nats-password", "--nats-token", "--nats-creds",
                 "--nats-nkey-seed", "--nats-tls-ca", "--nats-tls-cert", "--nats-tls-key"):  # fmt: skip
        assert flag in text
    assert SECRET not in text


def test_frontend_takes_options_and_refuses_contradictions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NATS_PASSWORD", SECRET)
    config = config_from_args(frontend_parser().parse_args(["--nats-user", "alice"]))
    assert config.nats_options == NatsConnectOptions(user="alice", password=SECRET)
    assert frontend_main(["--nats-user", "alice", "--nats-token", "t"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--nats-token" in err and SECRET not in err


def test_mocker_takes_options_and_refuses_contradictions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_TOKEN", SECRET)
    assert mocker_parse_args([]).worker.nats_options == NatsConnectOptions(token=SECRET)
    with pytest.raises(ConfigError, match="different authentication methods"):
        mocker_parse_args(["--nats-user", "u", "--nats-password", "p"])
