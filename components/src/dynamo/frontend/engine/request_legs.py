"""One request's life across the workers it is placed on: `RequestLegs` decides whether a
lost or refusing worker means placing the request again, migrating it, or failing it, and
`continuation` builds the request that resumes it elsewhere.

Separate from `client.py`, which talks to the runtime and the router: this is the
placement and migration policy alone, pure bookkeeping over a `PreprocessedRequest` and
the outputs streamed so far, testable without any transport.
"""

from __future__ import annotations

import logging
import time

import msgspec

from dynamo.frontend.engine.errors import EngineFailedError, EngineOverloadedError, lost_message
from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest
from dynamo.runtime import (
    ConnectionLostError,
    DynamoRuntimeError,
    InstanceGoneError,
    InstanceOverloadedError,
    NoResponderError,
    StreamTimeoutError,
)

log = logging.getLogger(__name__)


# Attempts to place a request when its worker vanishes before producing any output.
MAX_PLACEMENT_ATTEMPTS = 3


class RequestLegs:
    """Where one request stands across its legs: the tokens streamed so far, the instances
    it was lost on, and the placements and migrations used. It decides what a lost or
    refusing worker means: place the request again (nothing streamed yet), migrate it
    (tokens streamed, migrations left), or fail it."""

    def __init__(
        self,
        request: PreprocessedRequest,
        migration_limit: int,
        *,
        unreachable_patience_s: float = 0.0,
    ) -> None:
        self.request = request
        self.leg = request  # what the next placement sends
        self.migration_limit = migration_limit
        self.generated: list[int] = []  # streamed to the caller, over all legs
        self.failed: set[int] = set()  # instances this request was lost on or refused by
        self.placements = 0
        self.migrations = 0
        self.lost: DynamoRuntimeError | None = None  # why the last placement failed
        self._first_of_leg = True
        # How long "no responders" is waited out (see RuntimeEngineClient), from the first.
        self.unreachable_patience_s = unreachable_patience_s
        self._unreachable_since: float | None = None

    @property
    def resuming(self) -> bool:
        return bool(self.generated)

    def record(self, output: LLMEngineOutput, already: int) -> bool:
        """Note `output` of the current leg (restating a continuation's usage); True for
        the leg's first output."""
        first, self._first_of_leg = self._first_of_leg, False
        self.generated.extend(output.token_ids)
        if already:
            _account_for_migration(output, len(self.request.token_ids), already)
        return first

    def lost_on(self, target: int, exc: InstanceGoneError | StreamTimeoutError) -> bool:
        """The worker `target` was lost (or went silent): prepare the next leg, or raise.
        True when the next leg is a migration."""
        migrating = self._next_leg(target, exc)
        if isinstance(exc, ConnectionLostError):
            # The worker may still run the old leg until our STOP reaches it; under its
            # own id the new leg would be refused there as a duplicate.
            attempt = self.placements + self.migrations
            self.leg = msgspec.structs.replace(
                self.leg, request_id=f"{self.request.request_id}-r{attempt}"
            )
        return migrating

    def _next_leg(self, target: int, exc: InstanceGoneError | StreamTimeoutError) -> bool:
        if isinstance(exc, NoResponderError) and self._waits_out(exc):
            return False
        self._exclude(target, exc)
        request_id = self.request.request_id
        if not self.generated and self.placements + 1 < MAX_PLACEMENT_ATTEMPTS:
            self.placements += 1
            log.warning(
                "request %s: worker lost before first output (%s), placing it again",
                request_id, exc,
            )  # fmt: skip
            return False
        unresumable = unresumable_reason(self.request)
        if self.generated and unresumable is not None:
            raise EngineFailedError(f"{lost_message(exc)}; not migrated: {unresumable}") from exc
        if self.generated and self.migrations < self.migration_limit:
            self.migrations += 1
            self.leg = continuation(self.request, self.generated)
            log.warning(
                "request %s: worker lost after %d tokens (%s); migrating (%d of %d)",
                request_id, len(self.generated), exc, self.migrations, self.migration_limit,
            )  # fmt: skip
            return True
        raise EngineFailedError(lost_message(exc)) from exc

    def _waits_out(self, exc: NoResponderError) -> bool:
        """Whether this "no responders" is sent again as it is (same leg, no placement
        charged, the instance not excluded): until `unreachable_patience_s` has passed
        since the first one."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        if now - self._unreachable_since >= self.unreachable_patience_s:
            return False
        self._note_lost(exc)
        log.debug("request %s: %s; sending it again", self.request.request_id, exc)
        return True

    def refused_by(self, target: int, exc: InstanceOverloadedError) -> None:
        """`target` refused before running anything (full): safe to send elsewhere, up to
        the placement limit."""
        self._exclude(target, exc)
        if self.placements + 1 >= MAX_PLACEMENT_ATTEMPTS:
            if self.generated:
                raise EngineFailedError(lost_message(exc)) from exc
            raise EngineOverloadedError(str(exc)) from exc
        self.placements += 1
        log.debug("request %s: %s; placing it again", self.request.request_id, exc)

    def _exclude(self, target: int, exc: DynamoRuntimeError) -> None:
        if not isinstance(exc, ConnectionLostError):  # our connection failed, not the worker
            self.failed.add(target)
        self._note_lost(exc)

    def _note_lost(self, exc: DynamoRuntimeError) -> None:
        """The placement failed with `exc`: the next output starts a new leg."""
        self.lost = exc
        self._first_of_leg = True


def unresumable_reason(request: PreprocessedRequest) -> str | None:
    """Why `request` cannot continue on another worker once tokens were streamed (None: it
    can). A continuation is one prompt extended by the tokens so far, so:

    * n > 1: the tokens streamed belong to n interleaved sequences, which one prompt
      cannot carry on;
    * structured output: the engine applies the grammar to the new leg's output only, so
      the continuation would start a second document after the first one's prefix.
    """
    if (request.sampling_options.n or 1) > 1:
        return "the request generates n > 1 sequences"
    if request.structured_output is not None:
        return "its output is constrained (structured output), which cannot resume mid-document"
    return None


def continuation(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request that resumes `request` on another worker after `generated` tokens.
    The prompt's logprobs came with the first leg's first output: not asked again (the
    continuation's prompt is longer, its logprobs would not be the client's)."""
    stop = request.stop_conditions
    done = len(generated)
    new_stop = msgspec.structs.replace(
        stop,
        max_tokens=None if stop.max_tokens is None else max(1, stop.max_tokens - done),
        min_tokens=None if stop.min_tokens is None else max(0, stop.min_tokens - done),
    )
    return msgspec.structs.replace(
        request,
        token_ids=[*request.token_ids, *generated],
        stop_conditions=new_stop,
        prefill_result=None,
        output_options=msgspec.structs.replace(request.output_options, prompt_logprobs=None),
    )


def _account_for_migration(output: LLMEngineOutput, prompt_len: int, carried: int) -> None:
    """A continuation leg reports usage against its extended prompt; restate it against
    the client's request (the carried tokens were generated, not prompted)."""
    usage = output.completion_usage
    if usage is None:
        return
    usage.prompt_tokens = prompt_len
    usage.completion_tokens += carried
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    details = usage.prompt_tokens_details
    if details is not None:
        details.cached_tokens = min(details.cached_tokens, prompt_len)
