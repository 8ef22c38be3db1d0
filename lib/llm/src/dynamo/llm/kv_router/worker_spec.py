"""`KvWorkerSpec`: what the KV router must know about one worker, read from its card.

Its own module because both the scheduler (which keeps each worker's books at that
worker's block size and speculative depth) and the `KvRouter` (which turns registered
cards into specs) need it, and it depends on nothing but the card protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.llm.protocols import ModelCard, SpeculativeInfo

HIDDEN_STATE_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
"""vLLM's speculative methods whose drafter reads the target's hidden states. For them
vLLM drops the last block of every prefix cache hit and recomputes it, to give the drafter
the hidden states of those positions (`SpeculativeConfig.use_eagle_block_drop`): such a
worker reuses one block less than it caches, and its card says so
(`SpeculativeInfo.drops_last_prefix_block`)."""


@dataclass(frozen=True, slots=True)
class KvWorkerSpec:
    """What the router must know about a worker: its block size and its speculation."""

    worker_id: int
    block_size: int
    speculative: SpeculativeInfo | None = None
    max_num_seqs: int = 0  # requests its engine runs at once (0: unknown)

    @property
    def is_adaptive(self) -> bool:
        """K is chosen online (`--speculation-adapt`): the worker reports the K in force."""
        return self.speculative is not None and self.speculative.adaptive

    def reusable_prefix_blocks(self, cached_blocks: int) -> int:
        """Of `cached_blocks` leading prompt blocks cached on the worker, how many its
        engine reuses (one less where it recomputes a hit's last block)."""
        drops = self.speculative is not None and self.speculative.drops_last_prefix_block
        return max(0, cached_blocks - 1) if drops else cached_blocks

    @classmethod
    def from_card(cls, card: ModelCard, default_block_size: int) -> KvWorkerSpec:
        """Read the card a worker registered; a card without a block size gets the
        model's (the first card's) block size."""
        block_size = card.kv_block_size or default_block_size
        return cls(card.instance_id, block_size, card.speculative, card.max_num_seqs)
