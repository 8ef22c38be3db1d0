"""The vLLM worker's `generate` handler (aggregated / decode / prefill), an async
generator served by the runtime, and the request counters it keeps.

Cancellation: when the client goes away the runtime closes the handler's generator and
sets `ctx.is_stopped()`; both paths abort the request in vLLM so its KV blocks are freed.

Refusals: vLLM says which failures are the request's fault (`VLLMClientError`, e.g. a
`top_p` of 0 or more logprobs than `--max-logprobs`) and which mean "not now" (its queue
bounds, `QueueOverflowError` / `MaxQueuedTokensError`). The handler turns them into the
runtime's typed refusals, so the client gets HTTP 400 with vLLM's one-line reason, or the
frontend tries another worker, instead of a 500 carrying vLLM's internals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, VLLMClientError
from vllm.v1.engine.exceptions import EngineDeadError

from dynamo.llm.protocols import (
    FinishReason,
    KvStorageProbe,
    LLMEngineOutput,
    PreprocessedRequest,
    WorkerType,
)
from dynamo.runtime import Context, InvalidRequestError, WorkerOverloadedError
from dynamo.vllm.kv_transfer.janitor import KvTransferJanitor
from dynamo.vllm.kv_transfer.layout import KV_LAYOUT_PARAM, KvLayoutCheck
from dynamo.vllm.kv_transfer.storage_check import KvStorageNotSharedError, SharedStorageCheck
from dynamo.vllm.serving.conversion import (
    OutputTracker,
    to_prompt,
    to_sampling_params,
    unapplied_while_speculating,
)
from dynamo.vllm.serving.engine import VllmEngine

log = logging.getLogger(__name__)

REJECTED = "rejected"
"""Finish reason counted for requests refused before running (bad parameters, full queue)."""
MAX_REASON_CHARS = 500
"""A refusal's reason reaches the HTTP client: one line, bounded."""


class RequestCounters:
    """Worker-level request counters exposed on /metrics."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.remote_prefill_used = 0
        self.remote_prefill_refused = 0  # transferred KV laid out unlike this engine's

    def finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


@dataclass(eq=False)
class GenerateHandler:
    """Serves `generate` for one worker type.

    - aggregated / decode: streams every step's accepted tokens (1..K+1 with speculation);
      a decode worker passes the prefill worker's `kv_transfer_params` to the connector
      when the KV they describe is laid out like its own (`kv_transfer.layout`).
    - prefill: runs the prompt with max_tokens=1 and `do_remote_decode`, returning the
      connector's `kv_transfer_params`, and its KV layout, as `disaggregated_params`.
    """

    engine: VllmEngine
    worker_type: WorkerType
    on_engine_dead: Callable[[BaseException], None] = field(kw_only=True)
    counters: RequestCounters = field(default_factory=RequestCounters, kw_only=True)
    """Shared with the worker's /metrics; by default (or given None) the handler's own."""
    kv_janitor: KvTransferJanitor | None = field(default=None, kw_only=True)
    """Decode side of the disk-based (CPU) connector: deletes consumed KV entries."""
    kv_probe: KvStorageProbe | None = field(default=None, kw_only=True)
    storage_check: SharedStorageCheck | None = field(default=None, kw_only=True)
    """Disk-based connector: the prefill side names its directory's probe (`kv_probe`) in
    each result, the decode side refuses results from a directory it cannot see."""
    layout_check: KvLayoutCheck = field(init=False)

    def __post_init__(self) -> None:
        if self.counters is None:  # callers may pass None for "its own"
            self.counters = RequestCounters()
        # Each side keeps only what it uses.
        if self.worker_type is WorkerType.PREFILL:
            self.kv_janitor = self.storage_check = None
        else:
            self.kv_probe = None
        facts = self.engine.facts
        self.layout_check = KvLayoutCheck(facts.kv_layout if facts else "")

    def _kv_transfer_params(self, request: PreprocessedRequest) -> dict[str, Any] | None:
        if self.worker_type is WorkerType.PREFILL:
            params = dict(request.kv_transfer_params or {})
            params.setdefault("do_remote_decode", True)
            return params
        if request.prefill_result is not None and request.prefill_result.disaggregated_params:
            if self.storage_check is not None:
                try:
                    self.storage_check.check(request.prefill_result.kv_storage)
                except KvStorageNotSharedError:
                    self.counters.remote_prefill_refused += 1
                    raise
            params = dict(request.prefill_result.disaggregated_params)
            if not self.layout_check.admits(params, request.request_id):
                self.counters.remote_prefill_refused += 1
                if self.kv_janitor is not None:  # keyed by prompt: it would load it anyway
                    self.kv_janitor.discard(request.token_ids)
                return None
            params.pop(KV_LAYOUT_PARAM, None)
            self.counters.remote_prefill_used += 1
            return params
        return request.kv_transfer_params

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        facts = self.engine.facts
        assert facts is not None, "handler served before the engine started"
        prefill = self.worker_type is WorkerType.PREFILL
        if facts.speculative is not None:
            unapplied = unapplied_while_speculating(request)
            if unapplied is not None:
                self.counters.finish(REJECTED)
                raise InvalidRequestError(
                    f"`{unapplied}` is not applied by this worker: it speculates "
                    f"({facts.speculative.method}), and vLLM does not honour {unapplied} "
                    "while it speculates; send the request without it, or to a model served "
                    "without speculation"
                )
        try:
            transfer = self._kv_transfer_params(request)
            params = to_sampling_params(
                request,
                model_defaults=facts.sampling_defaults,
                max_model_len=facts.max_model_len,
                force_max_tokens=1 if prefill else None,
                kv_transfer_params=transfer,
            )
        except VLLMClientError as exc:  # vLLM's SamplingParams refused a value
            self.counters.finish(REJECTED)
            raise InvalidRequestError(refusal_reason(exc)) from None
        except KvStorageNotSharedError:  # a deployment error: fail clearly, not silently
            self.counters.finish(FinishReason.ERROR.value)
            raise
        request_id = ctx.id or request.request_id
        tracker = OutputTracker(len(request.token_ids))
        llm = self.engine.engine
        finished = False
        entry = self.kv_janitor.acquire(request.token_ids) if self.kv_janitor else None
        # Only the request a prefill wrote the entry for consumes it (see kv_transfer).
        consumes_entry = transfer is not None and request.prefill_result is not None
        self.counters.in_flight += 1
        self.counters.prompt_tokens += len(request.token_ids)
        try:
            async for ro in llm.generate(
                to_prompt(request), params, request_id, priority=request.priority
            ):
                outs = tracker.convert_all(ro)
                if ro.finished:  # every sequence is done (n > 1: the last one just now)
                    # Counted before the yields: the consumer may close the stream on them.
                    finished = True
                    self._count_finished(outs)
                for out in outs:
                    if prefill and out.finish_reason is not None:
                        out.token_ids = []  # the decode worker produces the first token
                        out.disaggregated_params = self._transfer_params(out.disaggregated_params)
                        out.kv_storage = self.kv_probe
                    yield out
                if finished:
                    return
                if ctx.is_stopped():
                    break
            if not finished:
                # The client cancelled (or vLLM ended the stream without a finish reason).
                # Counted before the yields: the consumer may close the stream on them.
                finished = True
                await self._abort(request_id)
                self.counters.finish(FinishReason.CANCELLED.value)
                for index in tracker.unfinished(params.n):
                    yield LLMEngineOutput(
                        index=index,
                        finish_reason=FinishReason.CANCELLED,
                        completion_usage=tracker.usage(0, index),
                    )
        except EngineDeadError as exc:
            finished = True
            log.error("vLLM engine died while serving %s: %s", request_id, exc)
            self.counters.finish(FinishReason.ERROR.value)
            self.on_engine_dead(exc)
            yield LLMEngineOutput(finish_reason=FinishReason.ERROR, error=f"engine dead: {exc}")
        except VLLMClientError as exc:  # the request's fault: HTTP 400, not the engine's
            finished = True
            self.counters.finish(REJECTED)
            await self._abort(request_id)
            raise InvalidRequestError(refusal_reason(exc)) from None
        except (QueueOverflowError, MaxQueuedTokensError) as exc:  # vLLM's queue is full
            finished = True
            self.counters.finish(REJECTED)
            await self._abort(request_id)
            raise WorkerOverloadedError(refusal_reason(exc)) from None
        except Exception:
            # vLLM failed the request: an error, not a cancel; the runtime reports it to
            # the client as the handler's error.
            finished = True
            self.counters.finish(FinishReason.ERROR.value)
            await self._abort(request_id)
            raise
        finally:
            self.counters.in_flight -= 1
            if not finished:  # the client went away: the runtime closed this generator
                self.counters.finish(FinishReason.CANCELLED.value)
                await self._abort(request_id)
            if entry is not None and self.kv_janitor is not None:
                self.kv_janitor.release(entry, consumed=consumes_entry)

    def _count_finished(self, outs: list[LLMEngineOutput]) -> None:
        """Count a finished request once (n sequences or one), by the finish reason of
        its last sequence, and its prompt tokens found in the prefix cache."""
        final = next((o for o in reversed(outs) if o.finish_reason is not None), None)
        reason = final.finish_reason if final is not None else FinishReason.CANCELLED
        self.counters.finish((reason or FinishReason.CANCELLED).value)
        usage = final.completion_usage if final is not None else None
        if usage is not None and usage.prompt_tokens_details is not None:
            self.counters.cached_prompt_tokens += usage.prompt_tokens_details.cached_tokens

    def _transfer_params(self, from_engine: dict[str, Any] | None) -> dict[str, Any]:
        """What the decode worker needs to find this prefill's KV: the connector's own
        parameters (NIXL: remote engine, block ids, ...), or for connectors that key the
        KV by the prompt itself (ExampleConnector) a marker naming the connector, so the
        frontend can tell a completed prefill from a failed one."""
        facts = self.engine.facts
        layout = {KV_LAYOUT_PARAM: facts.kv_layout} if facts and facts.kv_layout else {}
        if from_engine:
            return {**from_engine, **layout}
        return {"kv_connector": facts.kv_connector if facts else None, "by_prompt": True, **layout}

    async def _abort(self, request_id: str) -> None:
        try:
            await asyncio.shield(self.engine.engine.abort(request_id))
        except Exception as exc:  # the engine may be gone during shutdown
            log.debug("abort of %s failed: %s", request_id, exc)


def refusal_reason(exc: BaseException) -> str:
    """vLLM's reason for refusing a request, as the client should read it: the text it was
    raised with (without the `(parameter=..., value=...)` repr `VLLMValidationError`
    appends), its first line, bounded."""
    text = str(exc.args[0]).strip() if exc.args else ""
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."
