"""NATS with authentication and TLS, against real nats-servers started with
`ServerSecurity` (the same code path as `python -m dynamo.nats_server --user ...`).

Claims: a client without (or with wrong) credentials is refused at once with an error
naming the redacted URL, never a hang; user/password, token, NKey and credentials in the
URL are accepted; a TLS server is probed and reached with its CA (and with a client
certificate where the server verifies clients), and refused without; a mocker worker and a
frontend given credentials (variables and URL) serve a completion end to end, while the
password appears in neither process's log and a client without credentials exits with a
clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nkeys
import psutil
import pytest
import pytest_asyncio

from dynamo.nats_server import NatsServer, ServerSecurity
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.nats_address import is_reachable
from dynamo.runtime.nats_connect import NatsRefusedError
from dynamo.runtime.nats_options import NatsConnectOptions
from dynamo.testing.http import http_post_json
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running
from dynamo.testing.tls import TestPki, make_test_pki

USER = "dynamo"
PASSWORD = "pw-" + uuid.uuid4().hex  # unique: its presence in a log can only be a leak
HANG_GUARD_S = 30.0
"""nats-py alone retries a refused connect forever; a refusal reported within this bound is
not a retry loop. Generous on purpose: a shared CI machine can stall a handshake for seconds,
and the claim is "refused, not retried until the test gives up"."""


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server that requires USER / PASSWORD."""
    security = ServerSecurity(user=USER, password=PASSWORD)
    log_dir = tmp_path_factory.mktemp("nats-auth")
    server = NatsServer(security=security, log_file=log_dir / "nats.log").start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture
async def connected() -> AsyncIterator[list[DistributedRuntime]]:
    """Runtimes a test connected; shut down afterwards."""
    runtimes: list[DistributedRuntime] = []
    yield runtimes
    for runtime in runtimes:
        await runtime.shutdown(drain_timeout=0)


async def _refused(url: str, options: NatsConnectOptions, **kwargs: float) -> str:
    """Connect, expecting a refusal (not a retry loop, see HANG_GUARD_S); return its message."""
    with pytest.raises(ConnectionError) as info:
        await asyncio.wait_for(
            DistributedRuntime.connect(url, options=options, **kwargs), HANG_GUARD_S
        )
    return str(info.value)


# --------------------------------------------------------------------------- user/password


async def test_without_credentials_the_server_refuses_at_once(secured_server: NatsServer) -> None:
    message = await _refused(secured_server.url, NatsConnectOptions())
    assert "Authorization Violation" in message and secured_server.url in message
    wrong = NatsConnectOptions(user=USER, password="not-the-password")
    message = await _refused(secured_server.url, wrong)
    assert "not-the-password" not in message and "user 'dynamo'" in message


async def test_refusal_is_its_own_error_type(secured_server: NatsServer) -> None:
    with pytest.raises(NatsRefusedError):
        await asyncio.wait_for(
            DistributedRuntime.connect(secured_server.url, options=NatsConnectOptions()),
            HANG_GUARD_S,
        )


async def test_with_credentials_the_runtime_works(
    secured_server: NatsServer, connected: list[DistributedRuntime]
) -> None:
    options = NatsConnectOptions(user=USER, password=PASSWORD)
    runtime = await DistributedRuntime.connect(secured_server.url, options=options)
    connected.append(runtime)
    await runtime.put_leased("dyn_auth_test", "k", b"v")  # JetStream KV works too
    entry = await (await runtime.key_value("dyn_auth_test")).get("k")
    assert entry.value == b"v"


async def test_credentials_in_the_url_work_and_are_logged_redacted(
    secured_server: NatsServer,
    connected: list[DistributedRuntime],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = secured_server.url.replace("nats://", f"nats://{USER}:{PASSWORD}@")
    with caplog.at_level("DEBUG"):
        connected.append(await DistributedRuntime.connect(url, options=NatsConnectOptions()))
    assert f"{USER}:***@" in caplog.text
    assert PASSWORD not in caplog.text


async def test_a_password_with_an_at_sign_in_the_url_is_logged_redacted_whole(
    tmp_path: Path, connected: list[DistributedRuntime], caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py splits a URL's credentials at the last `@`, so the password here is
    `p@ss-...`: the log must show none of it (it used to show the part after the `@`)."""
    tail = "ss-" + uuid.uuid4().hex
    password = "p@" + tail
    with NatsServer(
        security=ServerSecurity(user=USER, password=password), store_dir=tmp_path
    ) as server:
        url = server.url.replace("nats://", f"nats://{USER}:{password}@")
        with caplog.at_level("DEBUG"):
            connected.append(await DistributedRuntime.connect(url, options=NatsConnectOptions()))
            await connected.pop().shutdown(drain_timeout=0)
    assert f"{USER}:***@127.0.0.1" in caplog.text
    assert tail not in caplog.text


async def test_credentials_from_the_environment_are_the_default(
    secured_server: NatsServer,
    connected: list[DistributedRuntime],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NATS_USER", USER)
    monkeypatch.setenv("NATS_PASSWORD", PASSWORD)
    connected.append(await DistributedRuntime.connect(secured_server.url))


async def test_a_password_with_quotes_braces_and_dollars_survives_the_config_file(
    tmp_path: Path, connected: list[DistributedRuntime]
) -> None:
    password = 'p"a{s}s$w\\o rd#' + uuid.uuid4().hex[:6]
    security = ServerSecurity(user=USER, password=password)
    with NatsServer(security=security, store_dir=tmp_path) as server:
        await _refused(server.url, NatsConnectOptions(user=USER, password=password[:-1]))
        options = NatsConnectOptions(user=USER, password=password)
        connected.append(await DistributedRuntime.connect(server.url, options=options))
        await connected.pop().shutdown(drain_timeout=0)
        # The file that carried the password to nats-server is gone once it is up.
        (proc,) = [
            p
            for p in psutil.Process().children()
            if f"--port {server.port}" in " ".join(p.cmdline())
        ]
        argv = proc.cmdline()
        config = Path(argv[argv.index("--config") + 1])
        assert not config.exists() and not config.parent.exists()


# --------------------------------------------------------------------------- token, NKey


async def test_token_server(tmp_path: Path, connected: list[DistributedRuntime]) -> None:
    token = "tok-" + uuid.uuid4().hex
    with NatsServer(security=ServerSecurity(token=token), store_dir=tmp_path) as server:
        message = await _refused(server.url, NatsConnectOptions(token="wrong"))
        assert "wrong" not in message
        connected.append(
            await DistributedRuntime.connect(server.url, options=NatsConnectOptions(token=token))
        )
        await connected.pop().shutdown(drain_timeout=0)


async def test_nkey_server(tmp_path: Path, connected: list[DistributedRuntime]) -> None:
    seed = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    security = ServerSecurity(nkeys=(public,))
    with NatsServer(security=security, store_dir=tmp_path / "js") as server:
        await _refused(server.url, NatsConnectOptions())
        options = NatsConnectOptions(nkey_seed=seed_file)
        connected.append(await DistributedRuntime.connect(server.url, options=options))
        await connected.pop().shutdown(drain_timeout=0)


# --------------------------------------------------------------------------- TLS


async def test_tls_server_needs_its_ca_and_a_client_certificate(
    pki: TestPki, tmp_path: Path, connected: list[DistributedRuntime]
) -> None:
    security = ServerSecurity(
        tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca, verify_clients=True
    )
    with NatsServer(security=security, store_dir=tmp_path) as server:
        assert server.url.startswith("tls://")
        assert is_reachable(server.url)  # the INFO probe works before the handshake
        # The server's certificate is not signed by a CA the system trusts.
        message = await _refused(server.url, NatsConnectOptions(), connect_timeout=1)
        assert "CERTIFICATE_VERIFY_FAILED" in message
        # Right CA, but no client certificate: the server hangs up (bounded, not a hang).
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(
                DistributedRuntime.connect(
                    server.url, options=NatsConnectOptions(tls_ca=pki.ca), connect_timeout=1
                ),
                10,
            )
        options = NatsConnectOptions(
            tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key
        )
        runtime = await DistributedRuntime.connect(server.url, options=options)
        connected.append(runtime)
        await runtime.put_leased("dyn_tls_test", "k", b"v")
        await connected.pop().shutdown(drain_timeout=0)


class FakeServer:
    """A TCP server that speaks NATS's plaintext INFO without asking for TLS (a fake
    server, or anyone on the path who rewrote INFO) and records every byte it receives."""

    INFO = (
        b'INFO {"server_id":"fake","version":"2.10.0","proto":1,"max_payload":1048576,'
        b'"auth_required":true}\r\n'
    )

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.write(self.INFO)
        await writer.drain()
        with contextlib.suppress(Exception):
            while data := await asyncio.wait_for(reader.read(4096), 3):
                self.received.extend(data)
        writer.close()


async def test_tls_options_refuse_a_server_that_does_not_ask_for_tls(pki: TestPki) -> None:
    """nats-py upgrades only when INFO says `tls_required`: with TLS configured, a server
    that does not say so is refused at once, and it never sees CONNECT or the password."""
    fake = FakeServer()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    options = NatsConnectOptions(
        user=USER,
        password=PASSWORD,
        tls_ca=pki.ca,
        tls_cert=pki.client_cert,
        tls_key=pki.client_key,
    )
    try:
        for url in (f"nats://127.0.0.1:{port}", f"tls://127.0.0.1:{port}"):
            message = await _refused(url, options, connect_timeout=1)
            assert "did not ask for TLS" in message
        tls_url_only = NatsConnectOptions(user=USER, password=PASSWORD)
        message = await _refused(f"tls://127.0.0.1:{port}", tls_url_only, connect_timeout=1)
        assert "did not ask for TLS" in message
    finally:
        server.close()
        await server.wait_closed()
    assert fake.connections >= 3  # a retry nats-py had begun before the refusal may add some
    assert b"CONNECT" not in fake.received and PASSWORD.encode() not in fake.received


# --------------------------------------------------------------------------- end to end


def test_mocker_and_frontend_with_credentials_serve_and_never_log_the_password(
    secured_server: NatsServer, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = "auth" + uuid.uuid4().hex[:8]
    credentials = {"NATS_USER": USER, "NATS_PASSWORD": PASSWORD}
    url_with_password = secured_server.url.replace("nats://", f"nats://{USER}:{PASSWORD}@")
    mocker_command = mocker_argv(
        embedded_model, secured_server.url, namespace,
        "--speed-up", "50",
        "--log-level", "DEBUG",
        served_model_name="auth-model",
    )  # fmt: skip
    with running([]) as procs:
        procs.append(ManagedProcess("mocker", mocker_command, tmp_path, env=credentials))
        frontend = FrontendProcess(
            "frontend",
            url_with_password,
            tmp_path,
            namespace=namespace,
            extra=["--log-level", "DEBUG"],
        )
        procs.append(frontend)
        frontend.wait_for_model("auth-model", timeout=60)
        status, body = http_post_json(
            f"{frontend.base_url}/v1/completions",
            {"model": "auth-model", "prompt": "hello there", "max_tokens": 4},
        )
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 4
    for proc in procs:
        text = proc.log_path.read_text(errors="replace")
        assert PASSWORD not in text, f"{proc.name} logged the password"
    assert f"{USER}:***@" in (tmp_path / "frontend.log").read_text()


@pytest.mark.parametrize("component", ["dynamo.runtime", "dynamo.frontend", "dynamo.mocker"])
def test_a_component_without_credentials_exits_with_a_clear_error(
    secured_server: NatsServer, embedded_model: Path, component: str
) -> None:
    argv = {
        "dynamo.runtime": ["--nats-server", secured_server.url, "instances"],
        "dynamo.frontend": ["--nats-server", secured_server.url, "--http-port", "0"],
        "dynamo.mocker": ["--nats-server", secured_server.url, "--model", str(embedded_model)],
    }[component]
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", component, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("NATS_")},
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "refused this client" in result.stderr and "Authorization Violation" in result.stderr
    assert time.monotonic() - began < 30
