"""The HTTP server's settings, each with its command-line flag (`dynamo.runtime.settings`).

`HttpService` takes one `HttpSettings`; `python -m dynamo.frontend` derives its HTTP flags
from these fields, so a setting is declared here once and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo.frontend.http.admission import AdmissionLimits
from dynamo.frontend.http.listener import ConnectionTimeouts
from dynamo.runtime.cli import non_negative_float, port, positive_int
from dynamo.runtime.settings import Flag, nested, setting

HTTP_GROUP = "HTTP server"
LIMITS_GROUP = "HTTP authentication and limits"

# Large enough for a prompt at the full context of any current model; a bigger body is
# rejected with 413 before it is parsed. (aiohttp then reads and drops the rest of the
# body for a few seconds, "lingering", so the client gets to read the 413.)
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# How long a request for a known model waits for a ready worker before it gets 503. A
# model can be momentarily without one: a worker restarting, a heartbeat that arrived
# late on a loaded host, the first instance of an endpoint still being discovered.
DEFAULT_WORKER_WAIT_S = 5.0
# Longest a streamed response waits for a client that stopped reading before the
# connection is dropped and the request cancelled (nginx's `send_timeout` default).
DEFAULT_WRITE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HttpSettings:
    """Where the frontend listens and the bounds it puts on clients and requests."""

    host: str = setting(
        "0.0.0.0", Flag("--http-host", "Address the HTTP server binds to.", group=HTTP_GROUP)
    )
    port: int = setting(
        8000, Flag("--http-port", "TCP port of the HTTP server.", type=port, group=HTTP_GROUP)
    )
    max_request_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BYTES,
        Flag(
            "--max-request-bytes",
            "Largest accepted request body; larger ones get HTTP 413.",
            type=positive_int,
            group=LIMITS_GROUP,
        ),
    )
    worker_wait_s: float = setting(
        DEFAULT_WORKER_WAIT_S,
        Flag(
            "--worker-wait-timeout",
            "Seconds a request for a served model waits for a ready worker (one restarting, "
            "a late lease heartbeat) before it fails with 503; 0 fails at once.",
            type=non_negative_float,
            group=LIMITS_GROUP,
        ),
    )
    # None or "": no authentication. Its flag is hand-made (`--api-key` is never shown by
    # --help), and it is kept out of repr so that no log of the settings shows it.
    api_key: str | None = field(default=None, repr=False)
    admission: AdmissionLimits = nested(AdmissionLimits, group=LIMITS_GROUP)
    timeouts: ConnectionTimeouts = nested(ConnectionTimeouts, group=LIMITS_GROUP)
    write_timeout_s: float = setting(
        DEFAULT_WRITE_TIMEOUT_S,
        Flag(
            "--write-timeout",
            "Seconds a streamed response waits for a client that stopped reading before "
            "the connection is dropped and the request cancelled; 0 waits for ever. "
            "$DYN_HTTP_WRITE_TIMEOUT overrides the default.",
            type=non_negative_float,
            env="DYN_HTTP_WRITE_TIMEOUT",
            group=LIMITS_GROUP,
        ),
    )
    return_spec_stats: bool = setting(
        False,
        Flag(
            "--return-spec-stats",
            "Add each request's speculative decoding statistics (`metrics.speculative_"
            "decoding`, beside usage) to every response, as a request's own "
            '`"return_spec_stats": true` does. $DYN_RETURN_SPEC_STATS=1 turns it on.',
            env="DYN_RETURN_SPEC_STATS",
            negatable=True,
        ),
    )
