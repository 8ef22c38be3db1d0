"""Model cards of KV-routed workers, shared by the KV router unit tests (which import
this module by name: pytest puts this folder on `sys.path`, as for `frontend_support`)."""

from __future__ import annotations

from dynamo.llm.protocols import ModelCard, SpeculativeInfo

BLOCK_SIZE = 16
"""Tokens per KV block of every card here; tests hash their prompts with the same size."""


def worker_card(instance_id: int, k: int | None = None) -> ModelCard:
    """The card a worker of model "m" publishes; `k` speculative tokens (ngram) if given,
    which the KV router counts as extra blocks the worker will fill."""
    spec = SpeculativeInfo(method="ngram", num_speculative_tokens=k) if k is not None else None
    return ModelCard(
        name="m",
        namespace="ns",
        component="backend",
        endpoint="generate",
        instance_id=instance_id,
        kv_block_size=BLOCK_SIZE,
        speculative=spec,
    )
