"""Disaggregated serving as an `EngineClient`: prefill on one worker, decode on another.

The prefill leg is the request with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`; the prefill worker computes the prompt's
KV cache, hands it to its KV connector and answers with `disaggregated_params`. Those go
into `prefill_result` of the same request sent to a decode worker, whose connector loads
the cache instead of recomputing it. When no prefill worker is up or the prefill leg fails,
the decode worker prefills itself: slower, but the request still succeeds.

The prompt's logprobs (`prompt_logprobs`) are computed where the prompt is: the prefill
worker's. The decode leg is sent without the request for them (it loads the prompt's KV,
it does not run the prompt), and they ride on its first output to the client.

Not every prompt takes the prefill leg: `prefill_policy.DisaggSettings.decide` chooses per
request, from the routers' previews of both pools, whether the decode worker prefills it
(a short or mostly cached prompt, a saturated prefill pool). Each decision goes to the
`on_decision` hook (the frontend's metric) and is tallied for `GET /debug/kv`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamo.frontend.engine.client import EndpointClient
from dynamo.frontend.engine.errors import EngineFailedError, EngineUnavailableError
from dynamo.frontend.engine.prefill_policy import (
    DisaggSettings,
    PrefillDecision,
    PrefillReason,
    local_decision,
)
from dynamo.llm.protocols import (
    FinishReason,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    PromptLogprobs,
)

log = logging.getLogger(__name__)

# Called with (model, reason) when decode has to prefill by itself.
FallbackHook = Callable[[str, str], None]
# Called with (model, decision) for every request: where its prompt is prefilled and why.
DecisionHook = Callable[[str, PrefillDecision], None]

DEFAULT_PREFILL_TIMEOUT_S = 60.0


@dataclass(eq=False)
class DisaggregatedEngineClient:
    """Decides where each prompt is prefilled, runs the prefill leg when it is remote,
    then streams the decode leg."""

    prefill: EndpointClient
    decode: EndpointClient
    on_fallback: FallbackHook | None = None
    prefill_timeout_s: float | None = DEFAULT_PREFILL_TIMEOUT_S
    settings: DisaggSettings = field(default_factory=DisaggSettings)
    on_decision: DecisionHook | None = None
    remote_prefills: int = field(default=0, init=False)  # prefills done by a prefill worker
    local_prefills: int = field(default=0, init=False)  # fallbacks: decode prefilled itself
    decisions: Counter[PrefillReason] = field(default_factory=Counter, init=False)

    def instance_ids(self) -> list[int]:
        return self.decode.instance_ids()

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        decision = self.decide(request)
        self.decisions[decision.reason] += 1
        if self.on_decision is not None:
            self.on_decision(request.model, decision)
        if decision.reason is PrefillReason.NO_PREFILL_WORKER:
            self._fallback(request, "no prefill worker")
        prompt_logprobs: PromptLogprobs = []
        result = await self._prefill(request, prompt_logprobs) if decision.remote else None
        decode_request = msgspec.structs.replace(request, prefill_result=result)
        if result is None:
            prompt_logprobs.clear()  # the decode worker prefills, and computes them itself
        elif request.output_options.prompt_logprobs is not None:
            options = msgspec.structs.replace(request.output_options, prompt_logprobs=None)
            decode_request = msgspec.structs.replace(decode_request, output_options=options)
        stream = self.decode.generate(decode_request)
        try:
            async for output in stream:
                if prompt_logprobs:  # from the prefill leg, with the first output
                    output.prompt_logprobs = prompt_logprobs
                    prompt_logprobs = []
                yield output
        finally:
            await stream.aclose()

    def decide(self, request: PreprocessedRequest) -> PrefillDecision:
        """Where `request`'s prompt is prefilled (nothing is booked by asking).

        n > 1: vLLM's n child sequences would each load the one transferred KV (not
        supported by its connectors); the decode worker prefills once for all of them."""
        tokens = len(request.token_ids)
        if (request.sampling_options.n or 1) > 1:
            return local_decision(PrefillReason.MULTIPLE_CHOICES, tokens)
        prefill_ids = self.prefill.instance_ids()
        if not prefill_ids:
            return local_decision(PrefillReason.NO_PREFILL_WORKER, tokens)
        if not self.settings.conditional:
            return self.settings.decide(tokens, None, None)
        decode_ids = self.decode.instance_ids()
        decode = self.decode.router.preview(request, decode_ids) if decode_ids else None
        prefill = self.prefill.router.preview(prefill_leg(request), prefill_ids)
        return self.settings.decide(tokens, decode, prefill)

    def debug_state(self) -> dict[str, Any]:
        """The policy and its decisions so far, for `GET /debug/kv`."""
        return {
            "settings": self.settings.as_dict(),
            "decisions": {reason.value: n for reason, n in sorted(self.decisions.items())},
            "remote_prefills": self.remote_prefills,
            "local_prefill_fallbacks": self.local_prefills,
        }

    async def close(self) -> None:
        """Nothing to release: both legs' clients belong to the model registry."""

    async def _prefill(
        self, request: PreprocessedRequest, prompt_logprobs: PromptLogprobs
    ) -> PrefillResult | None:
        """The remote prefill's result (None: the decode worker prefills itself); the
        prompt's logprobs, when the request asked for them, are added to
        `prompt_logprobs`."""
        leg = prefill_leg(request)
        params = None
        details = None
        kv_storage = None
        stream = self.prefill.generate(leg)
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                async for output in stream:
                    if output.error is not None or output.finish_reason is FinishReason.ERROR:
                        return self._fallback(request, output.error or "prefill failed")
                    if output.disaggregated_params:
                        params = output.disaggregated_params
                    if output.kv_storage is not None:
                        kv_storage = output.kv_storage
                    prompt_logprobs.extend(output.prompt_logprobs or ())
                    usage = output.completion_usage
                    if usage and usage.prompt_tokens_details:
                        details = msgspec.to_builtins(usage.prompt_tokens_details)
        except TimeoutError:
            return self._fallback(request, f"prefill timed out after {self.prefill_timeout_s}s")
        except (EngineUnavailableError, EngineFailedError) as exc:
            return self._fallback(request, str(exc))
        finally:
            await stream.aclose()
        if not params:
            return self._fallback(request, "prefill worker returned no transfer parameters")
        self.remote_prefills += 1
        return PrefillResult(
            disaggregated_params=params, prompt_tokens_details=details, kv_storage=kv_storage
        )

    def _fallback(self, request: PreprocessedRequest, reason: str) -> None:
        self.local_prefills += 1
        log.warning("request %s: decode worker prefills locally (%s)", request.request_id, reason)
        if self.on_fallback is not None:
            self.on_fallback(request.model, reason)
        return None


def prefill_leg(request: PreprocessedRequest) -> PreprocessedRequest:
    """The request as sent to a prefill worker: one token, KV handed off for remote decode."""
    stop = msgspec.structs.replace(request.stop_conditions, max_tokens=1, min_tokens=None)
    return msgspec.structs.replace(
        request,
        stop_conditions=stop,
        kv_transfer_params={"do_remote_decode": True},
        prefill_result=None,
    )
