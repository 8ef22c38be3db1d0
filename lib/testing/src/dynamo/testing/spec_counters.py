"""vLLM's speculative-decoding counters of one worker, read from its `/metrics`, so a test
or a benchmark can take the difference over the requests it sent."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.llm.acceptance import acceptance_length, per_position_rates
from dynamo.testing.processes import WorkerProcess

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecCounters:
    """Drafts (verification rounds), accepted draft tokens, and accepted tokens per draft
    position (position i counts rounds whose first i + 1 drafts were all accepted)."""

    drafts: float
    accepted: float
    per_position: tuple[float, ...]

    @classmethod
    def read(cls, worker: WorkerProcess, k: int) -> SpecCounters:
        return cls(
            drafts=worker.metric(DRAFTS),
            accepted=worker.metric(ACCEPTED),
            per_position=tuple(worker.metric(PER_POSITION, position=str(i)) for i in range(k)),
        )

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - other.drafts,
            self.accepted - other.accepted,
            tuple(a - b for a, b in zip(self.per_position, other.per_position, strict=True)),
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round: the bonus token plus the accepted drafts."""
        return acceptance_length(self.accepted, self.drafts)

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """The share of rounds that accepted each position (cumulative along the chain)."""
        return tuple(per_position_rates(self.per_position, self.drafts))
