"""The `n` choices of one response: one `Postprocessor` per choice over one engine stream.

With `n` > 1 the worker runs n sequences from one prompt (vLLM's parallel sampling: the
children share the prompt's KV blocks) and interleaves their outputs on one stream, each
naming its sequence by `LLMEngineOutput.index`. Everything the postprocessor keeps is a
property of one sequence (the incremental detokenizer, held-back stop-string text, hidden
stop tokens, logprobs, the finish reason), so each choice gets its own, and a stop string
in one choice ends that choice only. The response ends when every choice has finished
(or one failed: an engine error fails the whole response, as a single choice would).

Usage is the response's: the prompt counted once (the sequences share it), completion
tokens summed over the choices; speculation statistics are summed likewise.

n = 1 takes the same path with one choice, so there is a single code path to test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dynamo.frontend.openai.protocol import PerRequestMetrics, Usage
from dynamo.frontend.postprocess.postprocessor import (
    Postprocessor,
    TextDelta,
    speculative_decoding_metrics,
)
from dynamo.llm.protocols import LLMEngineOutput, SpecDecodeStats

log = logging.getLogger(__name__)


class ChoicePostprocessors:
    """Routes a batch of engine outputs to the postprocessor of each output's choice and
    returns one `TextDelta` per choice the batch touched, tagged with its `index`."""

    def __init__(
        self, n: int, make: Callable[[], Postprocessor], report_spec_stats: bool = False
    ) -> None:
        """`make` builds one choice's postprocessor (they share nothing)."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        self._choices = [make() for _ in range(n)]
        self._report_spec_stats = report_spec_stats
        self._failed = False

    @property
    def n(self) -> int:
        return len(self._choices)

    @property
    def finished(self) -> bool:
        """Every choice has finished, or one failed (the response is then an error)."""
        return self._failed or all(choice.finished for choice in self._choices)

    def process(self, outputs: Sequence[LLMEngineOutput]) -> list[TextDelta]:
        """One delta per choice present in `outputs`, in index order. Outputs for an
        index outside 0..n-1 (a misbehaving worker) are dropped with a warning."""
        by_index: dict[int, list[LLMEngineOutput]] = {}
        for output in outputs:
            if 0 <= output.index < self.n:
                by_index.setdefault(output.index, []).append(output)
            else:
                log.warning("engine output for choice %d of %d dropped", output.index, self.n)
        deltas = []
        for index in sorted(by_index):
            delta = self._choices[index].process(by_index[index])
            delta.index = index
            self._failed = self._failed or delta.error is not None
            deltas.append(delta)
        return deltas

    def end_of_stream(self) -> list[TextDelta]:
        """The engine's stream ended with choices unfinished: each of them is aborted."""
        deltas = []
        for index, choice in enumerate(self._choices):
            if not choice.finished:
                delta = choice.end_of_stream()
                delta.index = index
                deltas.append(delta)
        return deltas

    def usage(self) -> Usage:
        """The prompt once, the completion tokens of all choices together."""
        usages = [choice.usage() for choice in self._choices]
        prompt = usages[0].prompt_tokens
        completion = sum(usage.completion_tokens for usage in usages)
        details = next((u.prompt_tokens_details for u in usages if u.prompt_tokens_details), None)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """The engine's speculation statistics summed over the choices (None: none sent)."""
        return merge_spec_stats([c.spec_stats for c in self._choices if c.spec_stats])

    def metrics(self) -> PerRequestMetrics | None:
        """The response's `metrics` (speculation statistics) when asked for and sent."""
        stats = self.spec_stats
        if not self._report_spec_stats or stats is None:
            return None
        return PerRequestMetrics(speculative_decoding=speculative_decoding_metrics(stats))


def merge_spec_stats(parts: Sequence[SpecDecodeStats]) -> SpecDecodeStats | None:
    """Sum of per-sequence statistics: counts added, histograms added position by
    position (the sequences share one K, so the histograms have one length)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    width = max(len(p.acceptance_histogram or []) for p in parts)
    histogram = [0] * width
    for part in parts:
        for j, count in enumerate(part.acceptance_histogram or []):
            histogram[j] += count
    return SpecDecodeStats(
        num_drafts=sum(p.num_drafts for p in parts),
        num_draft_tokens=sum(p.num_draft_tokens for p in parts),
        num_accepted_tokens=sum(p.num_accepted_tokens for p in parts),
        acceptance_histogram=histogram if width else None,
    )
