"""OpenAI-shaped errors: the one place that decides status codes and error bodies.

Every failure the frontend reports, whether raised by validation, routing or the engine,
becomes `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status,
so OpenAI client libraries raise their usual typed exceptions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()


@dataclass(eq=False, repr=False)  # keeps an exception's identity equality and its repr
class OpenAIError(Exception):
    """An error the client should see: HTTP status plus OpenAI's error fields."""

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    # HTTP headers the response must carry (`Retry-After`, `WWW-Authenticate`); None: none.
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)  # what str() of the exception says
        self.headers = self.headers or {}

    def detail(self) -> ErrorDetail:
        return ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)

    def body(self) -> bytes:
        """The JSON body of a plain (non-streaming) error response."""
        return _encoder.encode(ErrorBody(error=self.detail()))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
    )


def no_workers(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No worker is serving model `{model}` right now; retry later.",
        type="service_unavailable",
        code="no_instances",
    )


def overloaded(model: str, what: str, retry_after_s: int) -> OpenAIError:
    """The model has as many requests as the frontend admits (`what` says which bound):
    503 with `Retry-After`, which OpenAI clients honour when they retry."""
    return OpenAIError(
        503,
        f"Model `{model}` is overloaded ({what}); retry after {retry_after_s} s.",
        type="service_unavailable",
        code="overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def unauthorized() -> OpenAIError:
    """A missing or wrong API key. The message never repeats what the client sent."""
    return OpenAIError(
        401,
        "Missing or incorrect API key: send it as `Authorization: Bearer <key>`.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def engine_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, type="internal_error", code="engine_error")


def internal_error() -> OpenAIError:
    """An unexpected bug in the frontend: the details go to the log, not to the client."""
    return OpenAIError(500, "Internal server error", type="internal_error", code="internal_error")


def payload_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"Request body is larger than the limit of {limit} bytes.",
        code="request_too_large",
    )


def request_timeout() -> OpenAIError:
    return OpenAIError(408, "The request body did not arrive in time.", code="request_timeout")


def http_error(status: int, reason: str) -> OpenAIError:
    """Wrap an HTTP-level failure (unknown route, wrong method) in OpenAI's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return OpenAIError(status, reason, code=code)


def error_event(error: OpenAIError) -> bytes:
    """The SSE event that reports an error after a stream has started (the status line
    is already sent), as vLLM and OpenAI do: `data: {"error": {...}}`."""
    return b"data: " + error.body() + b"\n\n"


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> OpenAIError:
    """Turn msgspec's decode error into a 400 that names the offending field.

    msgspec reports the location as a JSON path (`... - at `$.messages[0].role``); the
    top-level field name becomes OpenAI's `param`.
    """
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _PATH_RE.search(text)
        path = match.group(1) if match else ""
        param = re.split(r"[.\[]", path, maxsplit=1)[0] or None
        if param and match:
            message = f"Invalid value for `{path}`: {text[: match.start()].rstrip(' -')}"
        else:
            message = f"Invalid request: {text}"
        if "missing required field" in text.lower():
            found = re.search(r"`([^`]+)`", text)
            field = found.group(1) if found else "?"
            param = param or field
            message = f"Missing required field `{field}`" + (f" in `{path}`" if path else "")
        return bad_request(message, param=param)
    return bad_request(f"Request body is not valid JSON: {text}", code="invalid_json")
