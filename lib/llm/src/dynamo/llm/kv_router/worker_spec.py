"""`KvWorkerSpec`: what the KV router must know about one worker, read from its card.

Its own module because both the scheduler (which keeps each worker's books at that
worker's block size and speculative depth) and the `KvRouter` (which turns registered
cards into specs) need it, and it depends on nothing but the card protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.llm.protocols import ModelCard, SpeculativeInfo


@dataclass(frozen=True, slots=True)
class KvWorkerSpec:
    """What the router must know about a worker: its block size and its speculation."""

    worker_id: int
    block_size: int
    speculative: SpeculativeInfo | None = None

    @property
    def is_adaptive(self) -> bool:
        """K is chosen online (`--speculation-adapt`): the worker reports the K in force."""
        return self.speculative is not None and self.speculative.adaptive

    @classmethod
    def from_card(cls, card: ModelCard, default_block_size: int) -> KvWorkerSpec:
        """Read the card a worker registered; a card without a block size gets the
        model's (the first card's) block size."""
        return cls(card.instance_id, card.kv_block_size or default_block_size, card.speculative)
