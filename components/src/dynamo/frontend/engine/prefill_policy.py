"""Conditional disaggregation: per request, prefill on a prefill worker or on the decode
worker itself.

A remote prefill has a price the local one does not: a second scheduling round on another
worker, and the prompt's KV moved through the KV connector before the decode worker can
start. It pays when the prompt's computation is long enough that keeping it off the decode
worker (whose running streams it would stall) is worth that price. So the decision is
made per request, before the prefill leg, from what the routers already know:

* **the prompt tokens the decode worker would still compute**: the prompt length minus
  what the decode router expects that worker to reuse from its prefix cache (the KV
  indexer's overlap, `Router.preview`). At or under `--disagg-local-prefill-tokens`, the
  decode worker prefills: a short prompt (`short_prompt`), or a long one it mostly
  caches (`cached_on_decode`).
* **the pools' prefill queues**: the prompt tokens routed to a worker whose prefill has not
  completed (the KV routers' books). When the prefill worker the request would go to has
  at least `--disagg-prefill-queue-tokens` queued and the decode worker has fewer queued
  than that, the decode worker's idle compute takes it (`prefill_pool_busy`).
* otherwise the prefill worker computes it (`long_prompt`).

Routers that keep no books (round-robin, random) preview nothing: the decision then reads
the prompt length alone. `--disagg-prefill remote` sends every prompt to a prefill worker
(`always_remote`), as before this policy existed.

The decision is a pure function of those numbers (`decide`), so it is tested without a
worker; `disagg.DisaggregatedEngineClient` gathers them and acts on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from dynamo.llm.router import PlacementPreview
from dynamo.runtime.cli import non_negative_int
from dynamo.runtime.settings import Flag, setting

DISAGG_GROUP = "Disaggregated serving"

DEFAULT_LOCAL_PREFILL_TOKENS = 64
"""Prompt tokens still to compute at or under which the decode worker prefills. Measured
on the embedded model with the CPU connector, each engine on its own core
(docs/disaggregation.md, "Conditional disaggregation"): a remote prefill adds ~100 ms to
a request's TTFT, and computing a prompt locally stalls the decode worker ~1.8 ms per
token, so below 48-69 tokens (two runs) the hand-off costs more than the stall it spares.
Faster engines (a GPU) move the break-even up: `conditional_disagg_bench.py --sweep`
measures it."""

DEFAULT_PREFILL_QUEUE_TOKENS = 2048
"""Prompt tokens queued on the chosen prefill worker at which a decode worker with fewer
queued takes the prefill: about two long prompts waiting, so a burst of long prompts
spreads over both pools instead of queueing behind one prefill worker."""


class PrefillMode(str, enum.Enum):
    """`--disagg-prefill`: how a disaggregated model's prompts are placed."""

    CONDITIONAL = "conditional"
    REMOTE = "remote"


class PrefillReason(str, enum.Enum):
    """Why a request was prefilled where it was (the `reason` label of the metric)."""

    LONG_PROMPT = "long_prompt"  # remote: the prompt is worth moving off the decode worker
    ALWAYS_REMOTE = "always_remote"  # remote: --disagg-prefill remote
    SHORT_PROMPT = "short_prompt"  # local: cheaper to compute than to hand off
    CACHED_ON_DECODE = "cached_on_decode"  # local: the decode worker caches most of it
    PREFILL_POOL_BUSY = "prefill_pool_busy"  # local: the prefill worker's queue is long
    MULTIPLE_CHOICES = "n_choices"  # local: n > 1 cannot share one transferred KV
    NO_PREFILL_WORKER = "no_prefill_worker"  # local: none is up

    @property
    def remote(self) -> bool:
        return self in (PrefillReason.LONG_PROMPT, PrefillReason.ALWAYS_REMOTE)


@dataclass(frozen=True)
class PrefillDecision:
    """Where one request is prefilled, why, and the numbers the decision read."""

    reason: PrefillReason
    prompt_tokens: int
    decode_cached_tokens: int = 0  # what the decode worker is expected to reuse
    prefill_queue_tokens: int | None = None  # None: the prefill router keeps no books
    decode_queue_tokens: int | None = None

    @property
    def remote(self) -> bool:
        return self.reason.remote


@dataclass(frozen=True)
class DisaggSettings:
    """How a model with prefill workers places each prompt (`--disagg-*`)."""

    mode: PrefillMode = setting(
        PrefillMode.CONDITIONAL,
        Flag(
            "--disagg-prefill",
            "Models with prefill workers: 'conditional' decides per request whether a "
            "prefill worker or the decode worker computes the prompt, from the tokens the "
            "decode worker would compute (prompt minus its cached prefix) and both pools' "
            "queued prefill tokens; 'remote' sends every prompt to a prefill worker. "
            "Each decision is counted in dynamo_frontend_prefill_decisions_total.",
            type=PrefillMode,
            choices=tuple(m.value for m in PrefillMode),
            group=DISAGG_GROUP,
        ),
    )
    local_prefill_tokens: int = setting(
        DEFAULT_LOCAL_PREFILL_TOKENS,
        Flag(
            "--disagg-local-prefill-tokens",
            "conditional: a prompt whose tokens still to compute on the decode worker "
            "(after its cached prefix) are at most this many is prefilled there; "
            "0: only fully cached prompts.",
            type=non_negative_int,
            group=DISAGG_GROUP,
        ),
    )
    prefill_queue_tokens: int = setting(
        DEFAULT_PREFILL_QUEUE_TOKENS,
        Flag(
            "--disagg-prefill-queue-tokens",
            "conditional, kv router mode: when the prefill worker a prompt would go to "
            "has at least this many prompt tokens queued and the decode worker fewer, "
            "the decode worker prefills it. 0: never for this reason.",
            type=non_negative_int,
            group=DISAGG_GROUP,
        ),
    )

    @property
    def conditional(self) -> bool:
        return self.mode is PrefillMode.CONDITIONAL

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "local_prefill_tokens": self.local_prefill_tokens,
            "prefill_queue_tokens": self.prefill_queue_tokens,
        }

    def decide(
        self,
        prompt_tokens: int,
        decode: PlacementPreview | None,
        prefill: PlacementPreview | None,
    ) -> PrefillDecision:
        """The placement of a prompt of `prompt_tokens`, given where each router would
        send it (None: that router keeps no books)."""
        cached = min(decode.cached_tokens, prompt_tokens) if decode is not None else 0
        decision = PrefillDecision(
            PrefillReason.LONG_PROMPT,
            prompt_tokens,
            cached,
            prefill.queued_prefill_tokens if prefill is not None else None,
            decode.queued_prefill_tokens if decode is not None else None,
        )
        if self.mode is PrefillMode.REMOTE:
            return replace(decision, reason=PrefillReason.ALWAYS_REMOTE)
        if prompt_tokens <= self.local_prefill_tokens:
            return replace(decision, reason=PrefillReason.SHORT_PROMPT)
        if prompt_tokens - cached <= self.local_prefill_tokens:
            return replace(decision, reason=PrefillReason.CACHED_ON_DECODE)
        if self._prefill_pool_busy(decision):
            return replace(decision, reason=PrefillReason.PREFILL_POOL_BUSY)
        return decision

    def _prefill_pool_busy(self, decision: PrefillDecision) -> bool:
        """The prefill worker's queue is at the threshold and the decode worker's shorter
        (both known: routers without books never trigger it)."""
        queued, decode_queued = decision.prefill_queue_tokens, decision.decode_queue_tokens
        if not self.prefill_queue_tokens or queued is None or decode_queued is None:
            return False
        return queued >= self.prefill_queue_tokens and decode_queued < self.prefill_queue_tokens


def local_decision(reason: PrefillReason, prompt_tokens: int) -> PrefillDecision:
    """A local prefill decided before any router was asked (n > 1, no prefill worker)."""
    return PrefillDecision(reason, prompt_tokens)
