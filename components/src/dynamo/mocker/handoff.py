"""The mocker's `disaggregated_params`: what a prefill mocker hands the frontend, and the
frontend hands a decode mocker (in `PrefillResult`), to say whose KV to "load".

A real prefill worker answers with its KV connector's parameters (NIXL: the remote engine,
its block ids and address; the CPU disk connector: nothing beyond `do_remote_prefill`),
which only the same connector on a decode worker understands. The mocker has no KV to
move, so its parameters only identify the transfer, enough for a decode mocker to check
that it is about this request and cost it:

    {
      "kv_transfer": "dynamo.mocker/1",  # the schema: from a mocker prefill worker
      "engine_id": "5f0c...",            # the prefill engine that holds the KV (vLLM's
                                         # `remote_engine_id`: a uuid per engine)
      "prompt_tokens": 412,              # tokens whose KV it computed: the whole prompt
      "block_size": 16,                  # its KV block size
      "do_remote_prefill": true          # vLLM's flag for "load, do not compute"
    }

A decode mocker takes the transfer only when the schema is this one, `prompt_tokens` is the
length of the request's prompt and `block_size` its own (the blocks would not line up
otherwise, as vLLM refuses KV laid out unlike its own); anything else, a real connector's
parameters included, is prefilled locally and counted as refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynamo.llm.protocols import PreprocessedRequest

SCHEMA = "dynamo.mocker/1"
"""The value of `kv_transfer` in the mocker's parameters (bumped if the fields change)."""


@dataclass(frozen=True, slots=True)
class KvHandoff:
    """One prompt's KV as a mocker prefill worker hands it off (see the module docstring)."""

    engine_id: str
    prompt_tokens: int
    block_size: int

    def to_params(self) -> dict[str, Any]:
        """The `disaggregated_params` of the prefill worker's final output."""
        return {
            "kv_transfer": SCHEMA,
            "engine_id": self.engine_id,
            "prompt_tokens": self.prompt_tokens,
            "block_size": self.block_size,
            "do_remote_prefill": True,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> KvHandoff | None:
        """The handoff `params` describe; None when they are not a mocker's (a real
        connector's, an older schema, or malformed)."""
        if not params or params.get("kv_transfer") != SCHEMA:
            return None
        engine_id = params.get("engine_id")
        tokens = params.get("prompt_tokens")
        block = params.get("block_size")
        if not isinstance(engine_id, str) or not _positive_int(tokens) or not _positive_int(block):
            return None
        return cls(engine_id, tokens, block)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def handoff_refusal(
    request: PreprocessedRequest, handoff: KvHandoff | None, block_size: int
) -> str | None:
    """Why a decode engine of `block_size` cannot take `handoff` for `request` (None: it
    can). Called only for requests that came with a `prefill_result`."""
    if handoff is None:
        return "its disaggregated_params are not a mocker prefill worker's"
    if handoff.prompt_tokens != len(request.token_ids):
        return (
            f"the transfer carries {handoff.prompt_tokens} prompt tokens, "
            f"the prompt has {len(request.token_ids)}"
        )
    if handoff.block_size != block_size:
        return f"the transfer's block size is {handoff.block_size}, this engine's {block_size}"
    if (request.sampling_options.n or 1) != 1:
        return "n > 1: one transferred KV cannot serve several sequences"
    return None
