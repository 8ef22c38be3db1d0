"""The simulated engine's totals since start, read by its `/metrics` and by tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo.llm.acceptance import acceptance_length, acceptance_rate, per_position_rates


@dataclass(slots=True)
class EngineCounters:
    """Engine-wide totals since start (for /metrics and tests)."""

    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    # Served without computing them: prefix-cache hits and KV transferred from a prefill
    # worker (vLLM counts connector-loaded tokens as cached too).
    cached_prompt_tokens: int = 0
    # Of those, loaded back from the host tier (`--kv-host-blocks`) at admission.
    onboarded_tokens: int = 0
    computed_prefill_tokens: int = 0
    # Disaggregated decode: prompts whose KV came from a prefill worker, the tokens
    # transferred (a part of `cached_prompt_tokens`), and handoffs refused (prefilled here).
    kv_transfers: int = 0
    transferred_prompt_tokens: int = 0
    kv_transfers_refused: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.spec_accepted_tokens, self.spec_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return acceptance_length(self.spec_accepted_tokens, self.spec_drafts)

    def per_position_rate(self) -> list[float]:
        return per_position_rates(self.spec_accepted_per_position, self.spec_drafts)
