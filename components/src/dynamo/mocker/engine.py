"""`MockEngine`: a simulated continuous-batching engine (pure asyncio, no NATS, no GPU).

It behaves like a vLLM engine as seen from outside — the same `PreprocessedRequest` in,
the same stream of `LLMEngineOutput`s out, the same KV-cache events — while only counting
blocks and sleeping for a modelled step time. That is what makes it useful for router and
scale tests: hundreds of workers on one machine whose caches, load and latency behave
plausibly.

Scheduling, once per step (a simplified vLLM v1 scheduler):

1. every running request past its prefill decodes, taking ``1 + K`` tokens of the step's
   token budget (`max_num_batched_tokens`);
2. requests still prefilling get the next chunk of their prompt from what is left of the
   budget (chunked prefill), oldest first;
3. waiting requests are admitted in arrival order while there is budget, a free sequence
   slot (`max_num_seqs`) and room in the block pool; admission looks the prompt up in the
   prefix cache, and the cached blocks are not computed again. The prompt blocks a step
   schedules are cached (and announced) at once, as vLLM 0.32 does.

The step then "runs" (`TimingModel`), and afterwards a request whose prefill finished
produces its first token, and each decoding request produces ``j + 1`` tokens, ``j`` drawn
from the `AcceptanceModel`. Slot accounting is `ActiveSequences` from the KV router: a
request holds ``ceil((context + K) / B)`` blocks, generated blocks become cached once
filled by accepted tokens, and rejected draft slots stay allocated but are never stored.
When a request cannot grow, the youngest running request is preempted (its blocks
released, recomputed later), as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dynamo.llm.kv_router.active_sequences import ActiveSequences
from dynamo.llm.kv_router.hashing import compute_block_hashes, num_blocks_spanned
from dynamo.llm.protocols import (
    FinishReason,
    KvEventData,
    LLMEngineOutput,
    LoadMetrics,
    PreprocessedRequest,
)
from dynamo.mocker.acceptance import acceptance_at
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.counters import EngineCounters
from dynamo.mocker.kv_cache import KvBlockPool
from dynamo.mocker.request import (
    InvalidRequest,
    MockRequest,
    Phase,
    RequestRejected,
    admit_request,
)
from dynamo.mocker.timing import StepPacer
from dynamo.mocker.transfer import KvTransfers

log = logging.getLogger(__name__)

KvEventSink = Callable[[list[KvEventData]], None]
"""Receives each step's cache events, in order (called synchronously, must not block)."""


@dataclass(slots=True)
class _Batch:
    """What one step computes."""

    decodes: list[MockRequest]
    prefills: list[tuple[MockRequest, int]]  # (request, prompt tokens computed this step)
    onboarded: int = 0  # prompt tokens loaded back from the host tier instead of computed

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for _, chunk in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class MockEngine:
    """A simulated engine. Start it inside a running event loop, then call `generate`."""

    def __init__(
        self, config: MockEngineConfig, *, on_kv_events: KvEventSink | None = None
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.acceptance = config.acceptance_model
        self._started_at = time.monotonic()  # what --acceptance-rate-after counts from
        self.timing = config.timing
        self.pool = KvBlockPool.for_engine(config)  # with its host tier, if any (`host_tier`)
        self.sequences = ActiveSequences(config.block_size, self.k)
        self.counters = EngineCounters(spec_accepted_per_position=[0] * self.k)
        self._on_kv_events = on_kv_events
        self._waiting: deque[MockRequest] = deque()
        self._running: list[MockRequest] = []
        self._requests: dict[str, MockRequest] = {}
        self._wakeup = asyncio.Event()
        self._transfers = KvTransfers(self.timing, self.counters, wake=self._wakeup.set)
        self._pacer = StepPacer(self.timing.quantum_ms / 1000.0)
        self._task: asyncio.Task[None] | None = None
        self.dead: BaseException | None = None
        self._load_changed: Callable[[], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> MockEngine:
        """Start the step loop (idle until a request arrives)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="mock-engine")
        return self

    async def stop(self) -> None:
        """Stop stepping; requests still in flight end with `cancelled`."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for request in list(self._requests.values()):
            self._finish(request, FinishReason.CANCELLED)
        self._flush_events()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead is None

    # ------------------------------------------------------------------ requests

    async def generate(
        self, request: PreprocessedRequest, request_id: str | None = None
    ) -> AsyncIterator[LLMEngineOutput]:
        """Stream one request's outputs: one per step it took part in producing tokens,
        the last with `finish_reason`, usage and speculative statistics. Closing the
        stream early aborts the request and frees its blocks at once.

        With `n` > 1 the request runs as n sequences (as vLLM's parallel sampling runs n
        child requests `"{i}_{request_id}"`, sharing the prompt's cached blocks): their
        outputs are interleaved on one stream, each naming its sequence by `index` and
        each sequence ending with its own final output; the stream ends when all have.

        A request the engine cannot take raises `RequestRejected` before any output, as
        vLLM raises (`InvalidRequest` when its parameters are at fault)."""
        states = self._submit_all(request, request_id or request.request_id)
        outputs = states[0].outputs  # shared by all sequences of the request
        unfinished = len(states)
        try:
            while unfinished:
                output = await outputs.get()
                if output.finish_reason is not None:
                    unfinished -= 1
                yield output
        finally:
            for state in states:
                if state.phase is not Phase.FINISHED:
                    self.abort(state.request_id)

    def _submit_all(self, request: PreprocessedRequest, request_id: str) -> list[MockRequest]:
        """Admit the request's `n` sequences (all or none), on one shared output queue."""
        n = request.sampling_options.n or 1
        if n < 1:
            raise InvalidRequest(f"n must be at least 1, got {n}.")
        if n == 1:
            return [self._submit(request, request_id)]
        shared: asyncio.Queue[LLMEngineOutput] = asyncio.Queue()
        states: list[MockRequest] = []
        try:
            for index in range(n):
                states.append(
                    self._submit(request, f"{index}_{request_id}", index=index, outputs=shared)
                )
        except RequestRejected:
            for state in states:
                self.abort(state.request_id)
            raise
        return states

    def watch_load(self, changed: Callable[[], None]) -> None:
        """Call `changed` after every step and every abort: what `load_metrics` reports
        may differ then, and only then (a request that arrives counts with its first
        step, as a real engine's stats do)."""
        self._load_changed = changed

    def abort(self, request_id: str) -> bool:
        """End a request now (it gets a `cancelled` output); False if unknown."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self._finish(state, FinishReason.CANCELLED)
        self._flush_events()
        self._notify_load()
        return True

    def clear_kv_blocks(self) -> bool:
        """Drop the prefix cache (announced as `KvAllCleared`). Refused while requests
        are in flight, as vLLM's `reset_prefix_cache` is."""
        if self._requests or not self.pool.clear():
            return False
        self._flush_events()
        self._notify_load()
        return True

    # ------------------------------------------------------------------ views

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._transfers)  # KV arriving: waiting, as in vLLM

    def load_metrics(self, worker_id: int) -> LoadMetrics:
        """The engine's load as a worker reports it to routers (speculative slots
        included in `active_blocks`, cached-only blocks not)."""
        return LoadMetrics(
            worker_id=worker_id,
            active_requests=len(self._running),
            waiting_requests=self.num_waiting,
            active_blocks=self.pool.active_blocks,
            total_blocks=self.pool.num_blocks,
            kv_usage=self.pool.usage,
        )

    # ------------------------------------------------------------------ admission

    def _submit(
        self,
        request: PreprocessedRequest,
        request_id: str,
        *,
        index: int = 0,
        outputs: asyncio.Queue[LLMEngineOutput] | None = None,
    ) -> MockRequest:
        if self.dead is not None:
            raise RequestRejected(f"engine dead: {self.dead}")
        if request_id in self._requests:
            raise RequestRejected(f"request {request_id!r} is already running")
        state = admit_request(request, request_id, self.config, index=index, outputs=outputs)
        self._transfers.expect(state, request, self.config.block_size)
        self._requests[request_id] = state
        self._waiting.append(state)
        self.counters.requests += 1
        self.counters.prompt_tokens += state.prompt_len
        self._wakeup.set()
        return state

    def _admit(self, state: MockRequest) -> bool:
        """Give a waiting request its blocks: cached prefix referenced, the rest (and K
        speculative slots) allocated. False when the pool cannot hold it right now."""
        block = self.config.block_size
        tokens = state.tokens
        hashes = compute_block_hashes(tokens, block)
        # At least one token is always computed: the engine needs its logits.
        hit = min(self.pool.match_prefix(hashes), (len(tokens) - 1) // block)
        if self.config.drops_last_prefix_block:
            hit = max(0, hit - 1)
        needed = num_blocks_spanned(len(tokens) + self.k, block) - hit
        if not self.pool.can_allocate(needed, hashes[:hit]):
            return False
        self.counters.onboarded_tokens += self.pool.acquire(hashes[:hit]) * block
        allocated = self.pool.allocate(needed)
        assert allocated
        self.sequences.add_request(
            state.request_id, len(tokens), block_hashes=hashes, token_ids=tokens, overlap_blocks=hit
        )
        state.pinned = hashes[:hit]
        state.private = needed
        state.prefill_remaining = len(tokens) - hit * block
        if state.cached_tokens is None:  # usage reports the first admission's hit
            state.cached_tokens = hit * block
            self.counters.cached_prompt_tokens += hit * block
        state.phase = Phase.RUNNING
        return True

    # ------------------------------------------------------------------ the step loop

    async def _loop(self) -> None:
        try:
            while True:
                self._land_transfers()
                if not self._running and not self._waiting:
                    self._pacer.idle()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch = self._schedule()
                if batch.empty and not self._transfers:  # else: an empty step, polling them
                    # Only possible if the config's capacity checks were bypassed.
                    self._finish(
                        self._waiting[0], FinishReason.ERROR, error="does not fit the KV cache"
                    )
                    continue
                seconds = self.timing.step_seconds(batch.prefill_tokens, len(batch.decodes), self.k)
                await self._pacer.wait(seconds + self.timing.onboard_seconds(batch.onboarded))
                self._complete(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: fail loudly, never hang the clients
            log.exception("mock engine step failed")
            self.dead = exc
            for request in list(self._requests.values()):
                self._finish(request, FinishReason.ERROR, error=f"engine dead: {exc}")

    def _schedule(self) -> _Batch:
        cfg = self.config
        onboarded_before = self.counters.onboarded_tokens  # `_admit` adds a step's loads
        budget = cfg.max_num_batched_tokens
        per_decode = 1 + self.k
        decodes: list[MockRequest] = []
        prefills: list[tuple[MockRequest, int]] = []
        for state in self._running:
            if state.prefill_remaining == 0 and budget >= per_decode:
                decodes.append(state)
                budget -= per_decode
        for state in self._running:
            if state.prefill_remaining and budget > 0:
                chunk = min(state.prefill_remaining, budget)
                prefills.append((state, self._cache_scheduled(state, chunk)))
                budget -= chunk
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            state = self._waiting[0]
            if not self._admit(state):
                break  # first come, first served: no overtaking of a large request
            self._waiting.popleft()
            if self._transfers.start(state):  # its prompt's KV comes from a prefill worker
                continue
            self._running.append(state)
            chunk = min(state.prefill_remaining, budget)
            prefills.append((state, self._cache_scheduled(state, chunk)))
            budget -= chunk
        return _Batch(decodes, prefills, self.counters.onboarded_tokens - onboarded_before)

    def _land_transfers(self) -> None:
        """Prompt KV arrived (`transfer`): cached and announced as if computed; decode next."""
        for state in self._transfers.landed():
            self._running.append(state)
            state.prefill_remaining -= self._cache_scheduled(state, state.prefill_remaining)

    def _cache_scheduled(self, state: MockRequest, chunk: int) -> int:
        """Cache the prompt blocks `chunk` fills as it is scheduled (returns `chunk`): vLLM
        0.32 registers a block when it allocates it for a step, before computing it, so a
        request of the same prefix admitted after it in the step counts them as hits."""
        if not self.pool.enable_prefix_caching:
            return chunk
        seq = self.sequences.get(state.request_id)
        assert seq is not None
        parent = seq.last_stored_hash
        scheduled = len(state.tokens) - state.prefill_remaining + chunk
        stored = self.sequences.store_scheduled_prompt_blocks(state.request_id, scheduled)
        self._commit(state, stored, parent)
        return chunk

    def _commit(self, state: MockRequest, stored: list[int], parent: int | None) -> None:
        """Turn `stored` of the request's private blocks into cached blocks it pins."""
        if stored:
            self.pool.commit(stored, parent)
            state.pinned.extend(stored)
            state.private -= len(stored)

    def _complete(self, batch: _Batch) -> None:
        """Apply the step that just ran: outputs, cache commits, growth, preemption."""
        self.counters.steps += 1
        for state, chunk in batch.prefills:
            if state.phase is not Phase.RUNNING:
                continue  # aborted while the step ran
            state.prefill_remaining -= chunk
            self.counters.computed_prefill_tokens += chunk
            if state.prefill_remaining == 0:
                self._produce(state, None)  # the prefill's own token, no drafts yet
        for state in batch.decodes:
            if state.phase is Phase.RUNNING:
                self._produce(state, self._accepted_drafts(state))
        self._grow()
        self._flush_events()
        self._notify_load()

    def _notify_load(self) -> None:
        if self._load_changed is not None:
            self._load_changed()

    def _accepted_drafts(self, state: MockRequest) -> int | None:
        """How many drafts the verifier accepts in a decode step; None where no draft is
        verified (speculation off, or no token to draft from: its prompt's KV was
        transferred). The step-time model counts every decode at K: K is per engine."""
        if not state.speculative or not state.num_output:
            return None
        if not self.k:
            return 0
        model = self.acceptance
        if self.config.acceptance_changes:
            epoch = self.config.acceptance_epoch
            elapsed = time.monotonic() - self._started_at if epoch is None else time.time() - epoch
            model = acceptance_at(model, self.config.acceptance_changes, elapsed)
        return model.sample(state.accept_rng)

    def _produce(self, state: MockRequest, accepted_drafts: int | None) -> None:
        """Generate this step's tokens for one request and account for their slots."""
        wanted = 1 if accepted_drafts is None else accepted_drafts + 1
        tokens, reason, stop_reason = state.sample(wanted, self.config.eos_probability)
        if accepted_drafts is not None and self.k:
            # Statistics count what the verifier accepted, before stop/length truncation.
            state.spec.record(accepted_drafts, self.k)
            counters = self.counters
            counters.spec_drafts += 1
            counters.spec_draft_tokens += self.k
            counters.spec_accepted_tokens += accepted_drafts
            for position in range(accepted_drafts):
                counters.spec_accepted_per_position[position] += 1
        seq = self.sequences.get(state.request_id)
        assert seq is not None
        parent = seq.last_stored_hash
        result = self.sequences.step(state.request_id, len(tokens) - 1, tokens)
        state.tokens.extend(tokens)
        self.counters.generated_tokens += len(tokens)
        stored = result.newly_stored_hashes
        if stored and self.pool.enable_prefix_caching:
            self._commit(state, stored, parent)
        output = state.output(tokens)
        if reason is None:
            state.outputs.put_nowait(output)
        else:
            self._finish(state, reason, stop_reason=stop_reason, output=output)

    def _grow(self) -> None:
        """Give every running request the blocks its grown context (+ K slots) needs,
        oldest first, preempting the youngest when the pool is full."""
        for state in list(self._running):
            if state.phase is not Phase.RUNNING:
                continue
            seq = self.sequences.get(state.request_id)
            assert seq is not None
            deficit = seq.allocated_blocks - len(state.pinned) - state.private
            if deficit <= 0:
                continue
            while not self.pool.allocate(deficit):
                victim = next((r for r in reversed(self._running) if r is not state), None)
                if victim is None:  # cannot happen with a validated config
                    log.warning("request %s does not fit the KV cache alone", state.request_id)
                    self._finish(state, FinishReason.LENGTH)
                    break
                self._preempt(victim)
            else:
                state.private += deficit

    def _preempt(self, state: MockRequest) -> None:
        """Free a running request's blocks and queue it first for recomputation (its
        prompt is then the prompt plus what it generated so far)."""
        self._release(state)
        self._running.remove(state)
        state.phase = Phase.WAITING
        state.prefill_remaining = 0
        state.preemptions += 1
        self.counters.preemptions += 1
        self._waiting.appendleft(state)

    def _release(self, state: MockRequest) -> None:
        self.sequences.free(state.request_id)
        self.pool.release(state.pinned)
        self.pool.free(state.private)
        state.pinned = []
        state.private = 0

    def _finish(
        self,
        state: MockRequest,
        reason: FinishReason,
        *,
        stop_reason: int | None = None,
        output: LLMEngineOutput | None = None,
        error: str | None = None,
    ) -> None:
        if state.phase is Phase.RUNNING:
            self._release(state)
            self._running.remove(state)
        elif state.phase is Phase.WAITING:
            self._waiting.remove(state)
        elif state.phase is Phase.TRANSFERRING:
            self._transfers.cancel(state)
            self._release(state)
        else:
            return
        self._requests.pop(state.request_id, None)
        final = state.finish(
            output or LLMEngineOutput(),
            reason,
            stop_reason=stop_reason,
            error=error,
            num_speculative_tokens=self.k,
        )
        finished = self.counters.finished
        finished[reason.value] = finished.get(reason.value, 0) + 1
        state.outputs.put_nowait(final)

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)
