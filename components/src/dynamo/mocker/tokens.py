"""Token ids the simulated engine "generates": arbitrary, but deterministic and readable.

Each request gets its own PRNG, seeded from the engine seed, the request's sampling seed
(when given) and the content hash of its prompt, so the same request produces the same
tokens on every worker, at any batch size and with any speculation settings (a real
engine's greedy output does not change with speculative decoding either), and tests can
predict them.

Tokens are drawn from the prompt's own tokens (special tokens removed), so the output
decodes to text made of the prompt's words: any detokenizer handles it, and nothing
accidentally ends the request. End-of-sequence is simulated separately with a per-token
probability, so output lengths can be fixed (`max_tokens`, the usual benchmark setting)
or random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence

from dynamo.llm.kv_router.hashing import hash_block


def request_seed(
    engine_seed: int, request_seed: int | None, prompt: Sequence[int], index: int = 0
) -> str:
    """The seed material of one request (a string: `random.Random` hashes it stably).
    `index` is the sequence's index with `n` > 1: sequences of one request differ, and
    sequence 0 is the request's only sequence at n = 1."""
    material = f"{engine_seed}:{request_seed if request_seed is not None else '-'}:{hash_block(None, prompt)}"
    return material if index == 0 else f"{material}:{index}"


class TokenSampler:
    """Deterministic token ids for one request."""

    def __init__(
        self,
        prompt: Sequence[int],
        rng: random.Random,
        *,
        vocab_size: int,
        excluded: Collection[int] = (),
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self._rng = rng
        self._vocab_size = vocab_size
        self._excluded = excluded
        # Duplicates are kept: frequent prompt words stay frequent in the output.
        self._pool = [t for t in prompt if 0 <= t < vocab_size and t not in excluded]
        distinct = len(set(self._pool)) if self._pool else max(vocab_size - len(excluded), 1)
        self.logprob = -math.log(distinct)
        """The log-probability reported for each generated token (uniform choice)."""

    def next_token(self, forbidden: Collection[int] = ()) -> int:
        """The next token, never one of `forbidden` (e.g. stop tokens before min_tokens)
        unless nothing else is available."""
        for _ in range(32):
            token = self._draw()
            if token not in forbidden and token not in self._excluded:
                return token
        return token

    def chance(self, probability: float) -> bool:
        """A Bernoulli draw from the same stream (simulated end of sequence)."""
        return probability > 0 and self._rng.random() < probability

    def alternatives(self, count: int, chosen: int) -> list[int]:
        """Up to `count` other plausible tokens (for top-logprob lists), deterministic."""
        seen = {chosen}
        out: list[int] = []
        for token in self._pool or range(self._vocab_size):
            if len(out) >= count:
                break
            if token not in seen and token not in self._excluded:
                seen.add(token)
                out.append(token)
        return out

    def _draw(self) -> int:
        if self._pool:
            return self._pool[self._rng.randrange(len(self._pool))]
        return self._rng.randrange(self._vocab_size)
