"""vLLM's own output objects, built directly for the worker's unit tests (no engine): a
`CompletionOutput` for one engine step's tokens and the `RequestOutput` carrying it."""

from __future__ import annotations

from typing import Any

from vllm.logprobs import SampleLogprobs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics


def completion(
    token_ids: list[int],
    *,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    logprobs: SampleLogprobs | None = None,
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None,
) -> CompletionOutput:
    """The tokens one engine step produced (a DELTA output), finished when a reason is given."""
    return CompletionOutput(
        index=0,
        text="",
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        spec_decode_metrics=spec_decode_metrics,
    )


def request_output(
    out: CompletionOutput,
    *,
    prompt_token_ids: list[int],
    request_id: str = "req-1",
    finished: bool | None = None,
    num_cached_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    prompt_logprobs: Any = None,
) -> RequestOutput:
    """`out` as vLLM hands it to `AsyncLLM.generate`'s caller; finished as `out` is unless
    `finished` says otherwise."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(prompt_token_ids),
        prompt_logprobs=prompt_logprobs,
        outputs=[out],
        finished=out.finished() if finished is None else finished,
        num_cached_tokens=num_cached_tokens,
        kv_transfer_params=kv_transfer_params,
    )
