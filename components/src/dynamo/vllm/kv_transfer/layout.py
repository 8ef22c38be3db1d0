"""The shape of a worker's KV cache, so a decode worker can refuse KV it cannot load.

A disaggregated pair hands the prompt's KV cache over layer by layer, so both engines must
keep the same attention layers. Speculation can change that set: an MTP layer, an Eagle
head or a draft model keeps KV of its own next to the target's (vLLM registers it as
more attention layers, e.g. `model.layers.<N>.self_attn.attn` for MiMo's MTP layer), while
n-gram and suffix speculation keep none. vLLM does not compare the two sides: on CPU, a
decode worker with an MTP layer fed by a prefill worker without one fails inside the
ExampleConnector (no KV file for the MTP layer) and the engine dies; with DiskKvConnector it
recomputes, but every request pays a failed load.

So the prefill worker names its layout in the transfer parameters it returns, and the
decode worker compares it with its own before handing them to vLLM. On a mismatch the
decode worker computes the prompt itself (slower, correct), logs why once per pair of
layouts, and counts it; the transferred entry is discarded so a prompt-keyed connector
cannot load it anyway.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

KV_LAYOUT_PARAM = "dynamo_kv_layout"
"""Key of the layout in a prefill worker's transfer parameters; removed before vLLM sees them."""


def describe_kv_layout(vllm_config: Any) -> str:
    """One line naming what must match across a prefill/decode pair: attention layers of
    the target and of the drafter (when it keeps KV), KV heads and head size, block size
    and cache dtype."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache, spec = vllm_config.cache_config, vllm_config.speculative_config
    draft = "no draft layers"
    if spec is not None and spec.uses_draft_kv_cache() and spec.draft_model_config is not None:
        draft = f"{spec.draft_model_config.get_num_layers(parallel)} draft layers ({spec.method})"
    dtype = cache.cache_dtype if cache.cache_dtype != "auto" else str(model.dtype)
    return (
        f"{model.get_num_layers(parallel)} layers + {draft}, "
        f"{model.get_num_kv_heads(parallel)} KV heads x {model.get_head_size()}, "
        f"block {cache.block_size}, {dtype.removeprefix('torch.')}"
    )


class KvLayoutCheck:
    """The decode side: accepts transfer parameters whose layout matches this engine's."""

    def __init__(self, own: str) -> None:
        self.own = own
        self._reported: set[str] = set()

    def admits(self, params: dict[str, Any], request_id: str) -> bool:
        """Whether KV described by `params` can be loaded here. Parameters without a
        layout (an older prefill worker, a client's own `kv_transfer_params`) are admitted."""
        theirs = params.get(KV_LAYOUT_PARAM)
        if theirs is None or theirs == self.own:
            return True
        if theirs not in self._reported:
            self._reported.add(theirs)
            log.error(
                "request %s: the prefill worker's KV cache is laid out as [%s] but this "
                "decode worker's as [%s]; computing the prompt here instead of loading it. "
                "Start prefill workers with the same model and --speculative-config as "
                "decode workers (a drafter with its own KV layers, such as MTP or Eagle, "
                "must run on both). Reported once per layout.",
                request_id,
                theirs,
                self.own,
            )
        return False
