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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import msgspec

from dynamo.frontend.engine.client import EngineClient
from dynamo.frontend.engine.errors import EngineFailedError, EngineUnavailableError
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

DEFAULT_PREFILL_TIMEOUT_S = 60.0


@dataclass(eq=False)
class DisaggregatedEngineClient:
    """Runs the prefill leg, then streams the decode leg."""

    prefill: EngineClient
    decode: EngineClient
    on_fallback: FallbackHook | None = None
    prefill_timeout_s: float | None = DEFAULT_PREFILL_TIMEOUT_S
    remote_prefills: int = field(default=0, init=False)  # prefills done by a prefill worker
    local_prefills: int = field(default=0, init=False)  # fallbacks: decode prefilled itself

    def instance_ids(self) -> list[int]:
        return self.decode.instance_ids()

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        # n > 1: vLLM's n child sequences would each load the one transferred KV (not
        # supported by its connectors); the decode worker prefills once for all of them.
        single = (request.sampling_options.n or 1) == 1
        prompt_logprobs: PromptLogprobs = []
        result = await self._prefill(request, prompt_logprobs) if single else None
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

    async def close(self) -> None:
        """Nothing to release: both legs' clients belong to the model registry."""

    async def _prefill(
        self, request: PreprocessedRequest, prompt_logprobs: PromptLogprobs
    ) -> PrefillResult | None:
        """The remote prefill's result (None: the decode worker prefills itself); the
        prompt's logprobs, when the request asked for them, are added to
        `prompt_logprobs`."""
        if not self.prefill.instance_ids():
            return self._fallback(request, "no prefill worker")
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
