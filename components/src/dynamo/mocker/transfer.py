"""`KvTransfers`: the prompt KV a decode engine receives from prefill workers, in flight.

A decode request that comes with a mocker prefill worker's `prefill_result`
(`handoff.KvHandoff`) does not compute its prompt: its KV "arrives" by transfer, as vLLM's
KV connectors load it. The engine admits it like any request (it looks the prompt up in
its own prefix cache and allocates the blocks), then hands it here instead of scheduling
its prefill. Only the part the decode engine does not cache is transferred, as vLLM's
connectors load only what the worker misses. While the transfer runs the request holds its
blocks but takes no step budget (it is not running, it counts as waiting, as vLLM's
`WAITING_FOR_REMOTE_KVS`); it lasts

    kv-transfer-overhead-ms + kv-transfer-ms-per-token x transferred tokens   (/ speed-up)

of wall-clock time (`TimingModel.transfer_seconds`), concurrent with the engine's steps.
When it lands the engine caches the prompt's blocks (announcing them as a computed
prefill would) and the request decodes from the next step on; its first token comes from
that step's one-token forward pass, as vLLM recomputes the last prompt position. A
request preempted later recomputes locally: the transferred KV is gone with its blocks.

Refused handoffs (`handoff.handoff_refusal`) are prefilled locally, as a vLLM decode worker
recomputes KV laid out unlike its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dynamo.llm.protocols import PreprocessedRequest
from dynamo.mocker.counters import EngineCounters
from dynamo.mocker.handoff import KvHandoff, handoff_refusal
from dynamo.mocker.request import MockRequest, Phase
from dynamo.mocker.timing import TimingModel

log = logging.getLogger(__name__)


class KvTransfers:
    """Transfers in flight for one engine; each landing wakes the engine's step loop."""

    def __init__(
        self, timing: TimingModel, counters: EngineCounters, *, wake: Callable[[], None]
    ) -> None:
        self.timing = timing
        self.counters = counters
        self._wake = wake
        self._inflight: dict[MockRequest, tuple[asyncio.TimerHandle, int]] = {}
        self._arrived: list[tuple[MockRequest, int]] = []

    def __len__(self) -> int:
        return len(self._inflight)

    def expect(self, state: MockRequest, request: PreprocessedRequest, block_size: int) -> None:
        """Note the handoff `request` comes with, if any, on its state (taken at its first
        admission); a handoff this engine cannot take is counted and logged, and the
        request prefills locally."""
        result = request.prefill_result
        if result is None or not result.disaggregated_params:
            return
        handoff = KvHandoff.from_params(result.disaggregated_params)
        refusal = handoff_refusal(request, handoff, block_size)
        if refusal is not None:
            self.counters.kv_transfers_refused += 1
            log.warning("request %s: prefilling locally: %s", state.request_id, refusal)
            return
        state.handoff = handoff

    def start(self, state: MockRequest) -> bool:
        """Start the transfer of an admitted request's uncached prompt tokens (its
        `prefill_remaining`); False, and nothing done, when it has no handoff. The handoff
        is consumed: a recomputation after preemption prefills locally."""
        if state.handoff is None:
            return False
        state.handoff = None
        state.phase = Phase.TRANSFERRING
        tokens = state.prefill_remaining
        seconds = self.timing.transfer_seconds(tokens)
        handle = asyncio.get_running_loop().call_later(seconds, self._arrive, state)
        self._inflight[state] = (handle, tokens)
        return True

    def cancel(self, state: MockRequest) -> None:
        """The request ended while its KV was in flight (its blocks are the engine's to
        release)."""
        entry = self._inflight.pop(state, None)
        if entry is not None:
            entry[0].cancel()

    def landed(self) -> list[MockRequest]:
        """Requests whose KV arrived since the last call, now running with their prompt
        counted as transferred (and, in usage, as cached: served without computing); the
        engine caches their blocks."""
        arrived, self._arrived = self._arrived, []
        landed = []
        for state, tokens in arrived:
            if state.phase is not Phase.TRANSFERRING:
                continue  # ended between its arrival and now
            state.phase = Phase.RUNNING
            state.cached_tokens = (state.cached_tokens or 0) + tokens
            counters = self.counters
            counters.kv_transfers += 1
            counters.transferred_prompt_tokens += tokens
            counters.cached_prompt_tokens += tokens
            landed.append(state)
        return landed

    def _arrive(self, state: MockRequest) -> None:
        entry = self._inflight.pop(state, None)
        if entry is not None:
            self._arrived.append((state, entry[1]))
            self._wake()
