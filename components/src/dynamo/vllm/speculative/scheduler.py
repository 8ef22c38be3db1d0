"""vLLM's scheduler with K chosen online each step (`speculative.adaptive_k.AdaptiveK`).

It keeps the per-request opt-out of the scheduler it extends (`speculative.opt_out`).

Plugged in through vLLM's own extension point, `--scheduler-cls`, so it runs inside the
engine core process where every step is scheduled. Three overrides, each a thin hook
around vLLM's own method:

* `_update_after_schedule`: the step's batch is known; before vLLM records the step, its
  `num_spec_tokens_to_schedule` (how many drafts the runner proposes after this step) is
  replaced by the chooser's K for the number of decoding sequences. vLLM stays in its
  dynamic-K mode (the worker keeps a schedule in the speculative config), so the runner
  reads that field and no request is padded to the static K.
* `make_spec_decoding_stats`: called once per verified request with its drafts and
  accepted tokens; they feed the acceptance estimate (the positions each draft reached
  with every earlier token accepted, and which of those were accepted).
* `schedule`, `update_from_output` and `update_draft_token_ids`: a step's time runs from
  `schedule` to the end of the engine core's work for it: `update_from_output` at K = 0,
  and for a step that drafted, `update_draft_token_ids`, which the engine core calls
  after it has fetched the drafts from the runner's process (`EngineCore.post_step`). That
  round trip is work only a drafting step causes (the free K = 0 skips it), so it belongs
  to the drafting K's price. A pure-decode step whose verified and drafted K were the
  same feeds the step-time estimate at that K.

The settings arrive in `additional_config[ADDITIONAL_CONFIG_KEY]` (a vLLM config field
made for plugins), written by the worker from its flags. Each decoding step's K goes to
the worker through `speculative.k_in_force` (load reports, metrics, the router's books).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from dynamo.vllm.speculative.adaptive_k import (
    ADDITIONAL_CONFIG_KEY,
    SCHEDULER_CLS,
    adaptive_entry,
    chooser_from_engine_config,
    state_path_of,
)
from dynamo.vllm.speculative.k_in_force import SpeculationStateWriter
from dynamo.vllm.speculative.opt_out import SpeculationOptOutScheduler
from dynamo.vllm.speculative.step_cost import batch_bucket

# Under vLLM's logger: this runs in the engine core process, where only vLLM's logging
# is configured (its lines reach the worker's log with the engine core's prefix).
log = logging.getLogger("vllm.dynamo.adaptive_scheduler")

REPORT_EVERY_S = 10.0


class AdaptiveSpeculationScheduler(SpeculationOptOutScheduler):
    """See the module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = adaptive_entry(self.vllm_config.additional_config)
        if config is None or self.num_spec_tokens < 1:
            raise ValueError(
                f"{SCHEDULER_CLS} needs speculative decoding and additional_config"
                f"[{ADDITIONAL_CONFIG_KEY!r}] (the worker's --speculation-adapt sets both)"
            )
        if self.dynamic_sd_lookup is None:  # keep vLLM in dynamic-K mode (see the module)
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (
                self.scheduler_config.max_num_seqs + 1
            )
        self.chooser = chooser_from_engine_config(config, self.num_spec_tokens)
        self.shared = SpeculationStateWriter(state_path_of(config))
        self._reached = [0] * self.num_spec_tokens
        self._accepted = [0] * self.num_spec_tokens
        self._verified = 0
        # Sequences asked for drafts after the previous step (verified in this one) and
        # after this step: a step's K decides the drafts the next step verifies.
        self._asked_now = 0
        self._asked_next = 0
        # (started, K, batch) of the step being timed; one that drafts stays until its
        # drafts come, and the next step's `_update_after_schedule` replaces one they never do.
        self._step: tuple[float, int, int] | None = None
        self._scheduled_at = 0.0
        # (batch size bucket, K) chosen since the last report
        self._chosen: Counter[tuple[int, int]] = Counter()
        self._reported_at = time.monotonic()
        log.info(
            "adaptive speculation: K chosen each step from live acceptance (up to K=%d)",
            self.chooser.max_k,
        )

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._scheduled_at = time.perf_counter()
        return super().schedule(*args, **kwargs)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        decoding, prefilling = self._batch_of(scheduler_output)
        # A step of prompts alone (at one request at a time, each request's first) drafts
        # for the batch that decodes next; a run of them is no run of K = 0 steps.
        k = self.chooser.choose(decoding) if decoding else self.chooser.best(prefilling)
        scheduler_output.num_spec_tokens_to_schedule = k
        if decoding:
            self.shared.write(k)
            self._chosen[(2 ** batch_bucket(decoding), k)] += 1
            self._report()
        verified = max(
            (len(t) for t in scheduler_output.scheduled_spec_decode_tokens.values()), default=0
        )
        steady = decoding > 0 and not prefilling and verified == k
        self._asked_now, self._asked_next = self._asked_next, decoding if k > 0 else 0
        self._step = (self._scheduled_at, k, decoding) if steady else None
        super()._update_after_schedule(scheduler_output)

    def _report(self) -> None:
        """Every REPORT_EVERY_S of decoding, one log line: the K chosen and why."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_EVERY_S:
            return
        estimate = self.chooser.acceptance
        by_batch: dict[int, dict[int, int]] = {}
        for (batch, k), steps in sorted(self._chosen.items()):
            by_batch.setdefault(batch, {})[k] = steps
        log.info(
            "adaptive speculation: K chosen over the last %.0fs (steps per batch size and K) "
            "%s; acceptance per position %s, drafted %.2f; step time x%s of the profile's "
            "(per batch size and K: %s)",
            now - self._reported_at,
            by_batch,
            [round(rate, 3) for rate in estimate.rates()],
            estimate.drafted_fraction(),
            [round(self.chooser.cost.correction(k), 2) for k in range(self.chooser.max_k + 1)],
            self.chooser.cost.by_batch(),
        )
        self._chosen.clear()
        self._reported_at = now

    def _batch_of(self, scheduler_output: SchedulerOutput) -> tuple[int, int]:
        """(decoding sequences, sequences still prefilling) in this step."""
        decoding = prefilling = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.num_computed_tokens < request.num_prompt_tokens:
                prefilling += 1
            else:
                decoding += 1
        return decoding, prefilling

    def update_from_output(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        outputs = super().update_from_output(scheduler_output, *args, **kwargs)
        if self._step is not None and self._step[1] == 0:  # one that drafts: at its drafts
            self._observe()
        if self._verified or self._asked_now:  # drafts asked for, even if none came (n-gram)
            self.chooser.observe_verification(
                self._reached,
                self._accepted,
                max(self._asked_now, self._verified),
                self._verified,
            )
            self._reached = [0] * self.num_spec_tokens
            self._accepted = [0] * self.num_spec_tokens
            self._verified = 0
        return outputs

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        super().update_draft_token_ids(draft_token_ids)
        self._observe()

    def _observe(self) -> None:
        """Feed the chooser the step being timed, if any: it ends now."""
        if self._step is None:
            return
        started, k, batch = self._step
        self.chooser.observe_step(k, batch, (time.perf_counter() - started) * 1000.0)
        self._step = None

    def make_spec_decoding_stats(
        self,
        spec_decoding_stats: SpecDecodingStats | None,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_invalid_spec_tokens: dict[str, int] | None,
        request_id: str,
    ) -> SpecDecodingStats | None:
        drafts = num_draft_tokens - (num_invalid_spec_tokens or {}).get(request_id, 0)
        if drafts > 0:
            self._verified += 1
            # Position i is reached when every earlier token was accepted.
            for i in range(min(drafts, num_accepted_tokens + 1, len(self._reached))):
                self._reached[i] += 1
            for i in range(min(num_accepted_tokens, drafts, len(self._accepted))):
                self._accepted[i] += 1
        return super().make_spec_decoding_stats(
            spec_decoding_stats,
            num_draft_tokens,
            num_accepted_tokens,
            num_invalid_spec_tokens,
            request_id,
        )
