"""Which first-connection failures end the attempt at once (`is_refusal`): the server
refusing our credentials or a certificate; not a slow handshake, a reset connection or a
TLS connection cut mid-handshake, which a retry may cure."""

from __future__ import annotations

import ssl

import pytest
from nats import errors

from dynamo.runtime.nats_connect import is_refusal


@pytest.mark.parametrize(
    ("exc", "refusal"),
    [
        (errors.Error("nats: 'Authorization Violation'"), True),
        (errors.AuthorizationError(), True),
        (errors.Error("nats: 'User Authentication Expired'"), True),
        (ssl.SSLCertVerificationError("certificate verify failed"), True),
        (ssl.SSLError("tlsv13 alert certificate required"), True),
        (errors.Error("nats: 'Authentication Timeout'"), False),
        (ConnectionResetError(104, "Connection reset by peer"), False),
        (ssl.SSLEOFError("EOF occurred in violation of protocol"), False),
        (TimeoutError(), False),
    ],
)
def test_is_refusal(exc: BaseException, refusal: bool) -> None:
    assert is_refusal(exc) is refusal
