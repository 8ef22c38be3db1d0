"""Speculative decoding's acceptance arithmetic, the one definition every counter uses.

vLLM counts, per verification step (a "draft"): the draft tokens proposed, the draft
tokens the target accepted, and per draft position how many drafts had that token
accepted (acceptance stops at the first rejected token, so position i counts the drafts
whose first i + 1 tokens were all accepted). From those:

* the acceptance length: tokens a verification step produces, the bonus token included;
* the acceptance rate: the share of proposed draft tokens that were accepted;
* the per-position rates: the share of drafts whose token i was accepted.

Each counter of this project (the worker's engine statistics, the mocker's, a request's
statistics in the frontend, the speculation monitor's windows, the tests' Prometheus
readings) keeps its own totals and asks these functions, so that a figure means the same
wherever it is shown."""

from __future__ import annotations

from collections.abc import Iterable


def acceptance_length(accepted_tokens: float, drafts: float) -> float:
    """Tokens per verification step, bonus token included; 1.0 when nothing was drafted
    (each step then produced its one token)."""
    return 1.0 + accepted_tokens / drafts if drafts else 1.0


def acceptance_rate(accepted_tokens: float, draft_tokens: float) -> float:
    """Accepted over proposed draft tokens; 0.0 when none was proposed."""
    return accepted_tokens / draft_tokens if draft_tokens else 0.0


def per_position_rates(accepted_per_position: Iterable[float], drafts: float) -> list[float]:
    """The share of drafts whose token at each position was accepted; 0.0 at every
    position when nothing was drafted."""
    return [n / drafts if drafts else 0.0 for n in accepted_per_position]
