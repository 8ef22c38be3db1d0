"""Speculation turned off for one request: vLLM's scheduler, minus that request's drafts.

A request that sends `"speculative_decoding": false` (a bulk job that wants throughput,
not latency) reaches the engine with `SamplingParams.extra_args[OPT_OUT_KEY] = True`
(`conversion.to_sampling_params`). vLLM has no per-request switch, so the worker runs
this scheduler (through vLLM's `--scheduler-cls`) whenever it speculates: when the
runner hands back the drafts it proposed after a step, the opted-out requests' drafts
are dropped before they are scheduled. The request then decodes one token per step and
costs no verification slots; the others speculate as before. Its per-request statistics
say so: no drafts.

With vLLM's asynchronous scheduling (GPU builds) the slots for drafts are scheduled
before the drafts exist; there the opted-out request's drafts are marked invalid, as a
grammar marks tokens it forbids: nothing is accepted from them, but their slots are
still verified (vLLM pads a request's missing drafts with invalid tokens). The runner
may still propose drafts for the request (n-gram's search, a drafter's forward pass run
batched with the others); only their verification is saved.

Every speculating worker runs this scheduler, so it is also where the engine core learns
the K of each step (`k_after_step`): at K = 0 the runner drafts nothing (`free_k0`), and
the engine core then skips asking the runner for drafts after the step.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

OPT_OUT_KEY = "dynamo_no_speculation"
"""`SamplingParams.extra_args` key: True when the request turned speculation off."""

SCHEDULER_CLS = "dynamo.vllm.speculative.opt_out.SpeculationOptOutScheduler"


def opted_out(sampling_params: SamplingParams | None) -> bool:
    """Whether a request with these `SamplingParams` (None: a pooling request) turned
    speculation off."""
    extra = sampling_params.extra_args if sampling_params is not None else None
    return bool(extra and extra.get(OPT_OUT_KEY))


class SpeculationOptOutScheduler(Scheduler):
    """See the module. It also remembers the K of the step it scheduled last
    (`k_after_step`, what `free_k0` reads to skip fetching drafts that were never made)."""

    _k_after_step = -1  # unknown until the first step is scheduled

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        self._k_after_step = output.num_spec_tokens_to_schedule
        return output

    def k_after_step(self) -> int:
        """How many drafts per sequence the runner was asked to propose after the step
        scheduled last (-1 before the first step)."""
        return self._k_after_step

    def _opted_out(self, req_id: str) -> bool:
        request = self.requests.get(req_id)
        return request is not None and opted_out(request.sampling_params)

    def without_opted_out(self, draft_token_ids: DraftTokenIds) -> DraftTokenIds:
        """The drafts, with an empty one for every request that turned speculation off."""
        return DraftTokenIds(
            draft_token_ids.req_ids,
            [
                [] if self._opted_out(req_id) else drafts  # pairs as vLLM pairs them
                for req_id, drafts in zip(
                    draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=False
                )
            ],
        )

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        super().update_draft_token_ids(self.without_opted_out(draft_token_ids))

    def update_draft_token_ids_in_output(
        self, draft_token_ids: DraftTokenIds, scheduler_output: SchedulerOutput
    ) -> None:
        super().update_draft_token_ids_in_output(
            self.without_opted_out(draft_token_ids), scheduler_output
        )
