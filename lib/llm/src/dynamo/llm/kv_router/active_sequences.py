"""Active-sequence accounting: how many KV blocks the requests in flight on a worker hold.

The KV router's cost function needs each worker's *current* KV occupancy, and cache events
only say which blocks are reusable, not which are pinned by running requests. So the router
keeps its own books of the requests it sent, and the mocker engine uses the very same
books to decide what it may publish as ``BlockStored``. (Which worker holds which request
is `multi_worker_sequences`'s business; these are one worker's books.)

Slot model (docs/architecture.md, "Speculative slots"). A request on a worker speculating K draft
tokens with block size B, whose context (prompt plus accepted output) is ``ctx`` tokens:

* holds ``ceil((ctx + K) / B)`` blocks: K slots are allocated ahead of the accepted tokens
  so the next verification step has room for its drafts;
* after a step that accepted ``j`` of the K drafts, the context grows by ``j + 1`` (the
  target model's bonus token); the ``K - j`` rejected slots are rolled back but stay
  allocated as capacity for the next step's drafts, so they never count as stored;
* only blocks completely filled by accepted tokens (``ctx // B``) are immutable ("stored"),
  and only those may ever be announced in a ``BlockStored`` event;
* finishing or cancelling releases everything the request held.

Prefix sharing: the full blocks of a prompt are identified by their content hashes
(`hashing`), and a block two running requests share is one physical block on the worker,
so it is counted once per worker (reference-counted by hash). Everything else a request
holds (the partial tail, generated blocks, speculative slots) is private to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypedDict

from dynamo.llm.kv_router.hashing import compute_block_hashes, hash_block, num_blocks_spanned
from dynamo.llm.protocols import SpeculativeInfo


def scheduled_k(schedule: Sequence[Sequence[int]], batch_size: int) -> int:
    """The K a dynamic schedule ``[[bs_lo, bs_hi, K], ...]`` gives `batch_size`, looked up
    as vLLM's scheduler does: the K of the last range starting at or below `batch_size`,
    so gaps and the tail beyond the last range carry the previous K on (an empty batch
    takes the first range's K). Uncapped: vLLM caps it at `num_speculative_tokens`."""
    ranges = sorted(entry for entry in schedule if len(entry) >= 3)
    k = int(ranges[0][2])
    for first, _last, range_k, *_ in ranges:
        if first <= batch_size:
            k = int(range_k)
    return k


def speculative_depth(
    info: SpeculativeInfo | None, batch_size: int = 1, reported: int | None = None
) -> int:
    """The number of draft tokens K a worker proposes per step at `batch_size`: on an
    adaptive worker the K it `reported` in force; otherwise (or before its first report)
    its dynamic schedule's K (`scheduled_k`); either capped at the static
    `num_speculative_tokens`, or that static K without a schedule; 0 without speculation."""
    if info is None:
        return 0
    static = max(0, info.num_speculative_tokens)
    if info.adaptive and reported is not None:
        return max(0, min(reported, static))
    if not any(len(entry) >= 3 for entry in info.schedule or ()):
        return static
    return max(0, min(scheduled_k(info.schedule or [], batch_size), static))


@dataclass(slots=True)
class StepResult:
    """What one verification step did to a request's slots (returned by `step`)."""

    accepted_drafts: int  # j in 0..K
    new_tokens: int  # j + 1 (the bonus token is always produced)
    rolled_back_slots: int  # K - j: proposed, rejected, kept allocated
    allocated_blocks: int  # after re-allocating K slots ahead for the next step
    newly_stored_blocks: int  # blocks that became completely filled by accepted tokens
    # Content hashes of the newly stored blocks, when the request's token ids are known.
    newly_stored_hashes: list[int] | None = None


@dataclass(slots=True)
class SequenceState:
    """One request in flight on one worker."""

    request_id: str
    block_size: int
    num_speculative_tokens: int
    prompt_len: int
    shared_hashes: list[int]  # content hashes of the prompt's full blocks (shared)
    overlap_blocks: int  # prompt blocks the worker already had cached on arrival
    context_len: int  # prompt + accepted output tokens
    prefill_pending: bool = True
    # Token ids of the whole context, kept only while every step supplied its tokens;
    # they let the mocker name generated blocks by content hash.
    token_ids: list[int] | None = None
    # Content hash of the last stored block (the parent of the next one), if known.
    last_stored_hash: int | None = None
    stored_blocks: int = 0
    rolled_back_slots: int = 0
    steps: int = 0

    @property
    def allocated_blocks(self) -> int:
        """Blocks held: the context plus K speculative slots ahead of it."""
        return num_blocks_spanned(self.context_len + self.num_speculative_tokens, self.block_size)

    @property
    def private_blocks(self) -> int:
        """Blocks only this request uses (everything but the shared prompt blocks)."""
        return self.allocated_blocks - len(self.shared_hashes)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the worker still has to compute (0 once prefill completed).

        The engine always recomputes at least the last prompt token (it needs its
        logits), so a fully cached prompt still costs one token.
        """
        if not self.prefill_pending:
            return 0
        cached = min(self.overlap_blocks * self.block_size, self.prompt_len - 1)
        return self.prompt_len - max(cached, 0)


@dataclass(slots=True)
class WorkerLoad:
    """A snapshot of one worker's books, for cost functions and metrics."""

    active_blocks: int
    active_requests: int
    prefill_tokens: int


class RequestOptions(TypedDict, total=False):
    """`ActiveSequences.add_request`'s keyword options, for a caller that passes them on
    (`MultiWorkerSequences.add_request`)."""

    block_hashes: Sequence[int] | None
    token_ids: Sequence[int] | None
    overlap_blocks: int
    num_speculative_tokens: int | None


class ActiveSequences:
    """The requests in flight on one worker and the KV blocks they hold."""

    def __init__(self, block_size: int, num_speculative_tokens: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self._requests: dict[str, SequenceState] = {}
        self._shared_refs: dict[int, int] = {}  # content hash -> requests using it
        self._private_blocks = 0
        self._prefill_tokens = 0

    # ------------------------------------------------------------------ lifecycle

    def add_request(
        self,
        request_id: str,
        prompt_len: int,
        *,
        block_hashes: Sequence[int] | None = None,
        token_ids: Sequence[int] | None = None,
        overlap_blocks: int = 0,
        num_speculative_tokens: int | None = None,
    ) -> SequenceState:
        """Start accounting for a request: allocate ``ceil((prompt_len + K) / B)`` blocks.

        Pass `block_hashes` (the prompt's full-block content hashes, which the router
        already computed for matching) or `token_ids` (hashes are computed, and token
        tracking lets `step` name generated blocks). `overlap_blocks` prompt blocks are
        already cached on the worker: they cost no prefill and count as stored at once.
        `num_speculative_tokens` overrides the worker's K (dynamic speculation).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        if prompt_len <= 0:
            raise ValueError(f"prompt_len must be positive, got {prompt_len}")
        if token_ids is not None and len(token_ids) != prompt_len:
            raise ValueError("token_ids must have prompt_len entries")
        hashes = self._prompt_hashes(prompt_len, block_hashes, token_ids)
        k = (
            self.num_speculative_tokens
            if num_speculative_tokens is None
            else num_speculative_tokens
        )
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        overlap = max(0, min(overlap_blocks, len(hashes)))
        state = SequenceState(
            request_id=request_id,
            block_size=self.block_size,
            num_speculative_tokens=k,
            prompt_len=prompt_len,
            shared_hashes=hashes,
            overlap_blocks=overlap,
            context_len=prompt_len,
            token_ids=list(token_ids) if token_ids is not None else None,
            stored_blocks=overlap,
            last_stored_hash=hashes[overlap - 1] if overlap else None,
        )
        self._requests[request_id] = state
        refs = self._shared_refs
        for block_hash in hashes:
            refs[block_hash] = refs.get(block_hash, 0) + 1
        self._private_blocks += state.private_blocks
        self._prefill_tokens += state.prefill_tokens
        return state

    def mark_prefill_completed(self, request_id: str) -> list[int] | None:
        """The request's prompt has been computed: it no longer counts as prefill load,
        and the prompt's full blocks become stored.

        Returns the content hashes of the prompt blocks that became stored now (those not
        already cached), or None when the request is unknown or was already prefilled.
        """
        state = self._requests.get(request_id)
        if state is None or not state.prefill_pending:
            return None
        self._prefill_tokens -= state.prefill_tokens
        state.prefill_pending = False
        return self._store_full_blocks(state)

    def store_scheduled_prompt_blocks(self, request_id: str, scheduled_tokens: int) -> list[int]:
        """The first `scheduled_tokens` prompt tokens are scheduled: the prompt blocks they
        fill become stored now, before they are computed, as vLLM caches a block when it
        allocates it for a step. Returns the hashes of the blocks stored by this call."""
        state = self._require(request_id)
        full = min(scheduled_tokens // state.block_size, len(state.shared_hashes))
        if not state.prefill_pending or full <= state.stored_blocks:
            return []
        hashes = state.shared_hashes[state.stored_blocks : full]
        state.stored_blocks = full
        state.last_stored_hash = hashes[-1]
        return hashes

    def step(
        self, request_id: str, accepted_drafts: int, token_ids: Sequence[int] | None = None
    ) -> StepResult:
        """One verification step: `accepted_drafts` of the K drafts were accepted.

        The context grows by ``accepted_drafts + 1`` (bonus token); the rejected slots are
        rolled back (still allocated, never stored) and K slots are allocated ahead again.
        `token_ids`, when given, are the ``accepted_drafts + 1`` tokens produced, which
        keeps content hashes of generated blocks available. A step implies the prefill
        is done.
        """
        state = self._require(request_id)
        k = state.num_speculative_tokens
        if not 0 <= accepted_drafts <= k:
            raise ValueError(f"accepted_drafts must be in 0..{k}, got {accepted_drafts}")
        new_tokens = accepted_drafts + 1
        if token_ids is not None and len(token_ids) != new_tokens:
            raise ValueError(f"expected {new_tokens} token ids, got {len(token_ids)}")
        stored_before = state.stored_blocks
        prefill_hashes = self.mark_prefill_completed(request_id) if state.prefill_pending else []
        self._advance(state, new_tokens, token_ids)
        state.rolled_back_slots += k - accepted_drafts
        state.steps += 1
        step_hashes = self._store_full_blocks(state)
        hashes = (
            None if prefill_hashes is None or step_hashes is None else prefill_hashes + step_hashes
        )
        return StepResult(
            accepted_drafts=accepted_drafts,
            new_tokens=new_tokens,
            rolled_back_slots=k - accepted_drafts,
            allocated_blocks=state.allocated_blocks,
            newly_stored_blocks=state.stored_blocks - stored_before,
            newly_stored_hashes=hashes,
        )

    def append_tokens(self, request_id: str, num_tokens: int) -> None:
        """Grow a request's context by `num_tokens` without the step bookkeeping (the
        router only learns token counts, not which drafts were accepted)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        state = self._requests.get(request_id)
        if state is None or num_tokens == 0:
            return
        self._advance(state, num_tokens, None)
        if not state.prefill_pending:
            state.stored_blocks = max(state.stored_blocks, state.context_len // state.block_size)

    def set_speculative_depth(self, k: int) -> None:
        """The worker drafts `k` tokens a step from now on (an adaptive worker's report):
        every request in flight holds K slots ahead at the new K, as the engine allocates
        them at its next step, and requests added later start with it."""
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.num_speculative_tokens = k
        for state in self._requests.values():
            if state.num_speculative_tokens != k:
                self._private_blocks -= state.private_blocks
                state.num_speculative_tokens = k
                self._private_blocks += state.private_blocks

    def free(self, request_id: str) -> bool:
        """Release everything the request holds (finish or cancel). False if unknown."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self._private_blocks -= state.private_blocks
        self._prefill_tokens -= state.prefill_tokens
        refs = self._shared_refs
        for block_hash in state.shared_hashes:
            left = refs[block_hash] - 1
            if left:
                refs[block_hash] = left
            else:
                del refs[block_hash]
        return True

    # ------------------------------------------------------------------ views

    @property
    def active_blocks(self) -> int:
        """Blocks held by requests in flight, speculative slots included, shared prompt
        blocks counted once."""
        return len(self._shared_refs) + self._private_blocks

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens routed here whose prefill has not completed yet."""
        return self._prefill_tokens

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.active_blocks, self.active_requests, self.prefill_tokens)

    def get(self, request_id: str) -> SequenceState | None:
        return self._requests.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[SequenceState]:
        return iter(list(self._requests.values()))

    def shared_block_count(self) -> int:
        """Distinct prompt blocks pinned by requests in flight (for tests and debugging)."""
        return len(self._shared_refs)

    def potential_blocks(
        self, block_hashes: Sequence[int], prompt_len: int, num_speculative_tokens: int
    ) -> int:
        """Active blocks this worker would hold after also taking a new request.

        Prompt blocks already pinned by another request here are not counted again, so
        a worker running requests with the same prefix looks as cheap as it is. Pinned
        hashes are prefix-closed (a chained hash in the map implies its parent is), so
        the shared part is a leading run and the walk stops at the first miss: the
        router scores every worker per request, and this keeps that O(shared depth).
        """
        own = num_blocks_spanned(prompt_len + num_speculative_tokens, self.block_size)
        return self.active_blocks + own - self.pinned_prefix_blocks(block_hashes)

    def pins(self, block_hash: int) -> bool:
        """Whether a request in flight here holds this prompt block."""
        return block_hash in self._shared_refs

    def pinned_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading `block_hashes` are prompt blocks of requests in flight here."""
        refs = self._shared_refs
        pinned = 0
        if refs:
            for block_hash in block_hashes:
                if block_hash not in refs:
                    break
                pinned += 1
        return pinned

    # ------------------------------------------------------------------ internals

    def _require(self, request_id: str) -> SequenceState:
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} is not active")
        return state

    def _prompt_hashes(
        self,
        prompt_len: int,
        block_hashes: Sequence[int] | None,
        token_ids: Sequence[int] | None,
    ) -> list[int]:
        full = prompt_len // self.block_size
        if block_hashes is not None:
            if len(block_hashes) != full:
                raise ValueError(
                    f"expected {full} block hashes for {prompt_len} tokens, got {len(block_hashes)}"
                )
            return list(block_hashes)
        if token_ids is not None:
            return compute_block_hashes(token_ids, self.block_size)
        raise ValueError("either block_hashes or token_ids is required")

    def _advance(
        self, state: SequenceState, num_tokens: int, token_ids: Sequence[int] | None
    ) -> None:
        """Grow the context, keeping the worker's private-block total in step."""
        before = state.private_blocks
        state.context_len += num_tokens
        if state.token_ids is not None:
            if token_ids is None:
                state.token_ids = None  # the sequence's content is no longer known
            else:
                state.token_ids.extend(token_ids)
        self._private_blocks += state.private_blocks - before

    def _store_full_blocks(self, state: SequenceState) -> list[int] | None:
        """Mark every block completely filled by accepted tokens as stored.

        Returns their content hashes in order. Prompt blocks are always known; generated
        blocks only while token ids are tracked (otherwise None is returned).
        """
        first = state.stored_blocks
        full = state.context_len // state.block_size
        if full <= first:
            return []
        state.stored_blocks = full
        num_prompt = len(state.shared_hashes)
        hashes = state.shared_hashes[first : min(full, num_prompt)]
        if full > num_prompt:
            if state.token_ids is None:
                return None
            # Parent of the first generated block: the last prompt block just listed, or
            # the last block stored by an earlier step.
            parent = hashes[-1] if hashes else state.last_stored_hash
            block = state.block_size
            tokens = state.token_ids
            for index in range(max(first, num_prompt), full):
                parent = hash_block(parent, tokens[index * block : (index + 1) * block])
                hashes.append(parent)
        if hashes:
            state.last_stored_hash = hashes[-1]
        return hashes
