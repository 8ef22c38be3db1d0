"""How long one simulated engine step takes.

A continuous-batching engine runs one forward pass per step over every scheduled token:
prompt chunks of requests in prefill and, per decoding request, the last token plus its K
draft tokens (verification). The model is deliberately linear and small so its numbers
can be read off a profile of a real engine:

    step_ms = decode_ms_per_step                      fixed cost of a forward pass
            + decode_ms_per_token × decode tokens     Σ over decoding requests of (1 + K)
            + prefill_ms_per_token × prefill tokens   prompt tokens computed this step
            + draft_ms_per_token × K                  the drafter runs K positions per step
                                                      (only when some request decodes)

and the simulation sleeps ``step_ms / speed_up``. Why these terms: at small batch a decode
step is memory bound (the fixed term dominates), and the per-token term makes inter-token
latency grow with batch size and with K, which is what makes the choice of K and the
router's load balancing matter. Prefill is compute bound, so linear in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Parameters of the step-time model (milliseconds at ``speed_up`` 1)."""

    prefill_ms_per_token: float = 0.05
    decode_ms_per_step: float = 8.0
    decode_ms_per_token: float = 0.05
    draft_ms_per_token: float = 0.5
    speed_up: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_ms_per_token",
            "decode_ms_per_step",
            "decode_ms_per_token",
            "draft_ms_per_token",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.speed_up > 0:
            raise ValueError(f"speed_up must be > 0, got {self.speed_up}")

    def step_ms(
        self, prefill_tokens: int, decode_requests: int, num_speculative_tokens: int
    ) -> float:
        """Simulated duration of one step in milliseconds, before `speed_up`."""
        k = num_speculative_tokens
        ms = self.decode_ms_per_step + self.prefill_ms_per_token * prefill_tokens
        if decode_requests:
            ms += self.decode_ms_per_token * decode_requests * (1 + k)
            ms += self.draft_ms_per_token * k
        return ms

    def step_seconds(
        self, prefill_tokens: int, decode_requests: int, num_speculative_tokens: int
    ) -> float:
        """Wall-clock seconds the simulation waits for one step (`speed_up` applied)."""
        ms = self.step_ms(prefill_tokens, decode_requests, num_speculative_tokens)
        return ms / 1000.0 / self.speed_up

    def inter_token_ms(self, batch_size: int, mean_acceptance_length: float, k: int) -> float:
        """Expected time between tokens of one stream in steady decode (for docs and
        sizing): one step's time spread over the tokens a step produces on average."""
        return self.step_ms(0, batch_size, k) / max(mean_acceptance_length, 1.0) / self.speed_up
