"""The KV router's scheduler: find the worker that makes a request cheapest to serve.

Cost of sending a request to worker w (lower is better; docs/architecture.md, "The KV
router's cost"):

    cost(w) = overlap_score_weight * blocks_to_prefill(w) + active_blocks(w)

* ``blocks_to_prefill(w)`` = the request's blocks (``ceil(prompt_len / B)``) minus the
  leading blocks w caches (`KvIndexer.find_matches`; one held only in an offload tier
  counts at its tier's weight, `tiers`) or is computing for a request in flight there.
* ``active_blocks(w)`` = the blocks w would hold with this request added, from the
  router's own books (`MultiWorkerSequences`), speculative slots included: a worker
  speculating K tokens holds ``ceil((ctx + K) / B)`` blocks per request, so deep
  speculation makes a worker look fuller. Prompt blocks already pinned by a request in
  flight on w are not counted twice. When the worker's own `LoadMetrics` are recent and
  report more blocks than the books (other frontends route to it too), they win.

Busy workers (`busy.BusyThresholds`, off by default) are left out before scoring; when
every candidate is busy `schedule` raises `AllWorkersBusyError` and books nothing.

``overlap_score_weight`` trades time-to-first-token (high: chase cache hits) against
load balance (low: spread decode load). ``router_temperature`` 0 picks the lowest cost
(ties broken at random, so equal workers share load); above 0 the choice is sampled from
``softmax(-normalised_cost / temperature)``, which spreads bursts of identical requests
(`selection.choose`, which also holds the records a decision leaves).

`KvScheduler` is the NATS-free core: costs and books. `router.KvRouter` is the
`dynamo.llm.router.Router` the frontend holds over it; `worker_spec.KvWorkerSpec` is what
it knows of each worker, and `scheduler_defaults` holds its knobs' default values.

Books shared among router replicas (docs/kv_router.md, "Replica sync"): every change of
the scheduler's own bookings goes to its `BookingObserver`s as a wire record
(`SequenceBooked`, `SequencePrefilled`, `SequenceFreed`), and another replica's records
are applied with `apply_booking` / `apply_prefill` / `release`, which tell no observer
(so a replica never echoes what it learnt). `replica_sync` wires the two over NATS.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Protocol

from dynamo.llm.kv_router.active_sequences import speculative_depth
from dynamo.llm.kv_router.anticipation import AnticipatedBlocks, CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.hashing import compute_block_hashes, num_blocks_spanned
from dynamo.llm.kv_router.indexer import KvIndexer, OverlapScores
from dynamo.llm.kv_router.multi_worker_sequences import MultiWorkerSequences
from dynamo.llm.kv_router.scheduler_defaults import (
    DEFAULT_LOAD_METRICS_TTL_S,
    DEFAULT_LOAD_REPORT_HOLD_OFF_S,
    DEFAULT_OVERLAP_SCORE_WEIGHT,
)
from dynamo.llm.kv_router.selection import RoutingDecision, RoutingTally, WorkerScore, choose
from dynamo.llm.kv_router.tiers import TierWeights
from dynamo.llm.kv_router.worker_spec import KvWorkerSpec
from dynamo.llm.protocols import (
    BookingChange,
    KvAllCleared,
    KvBlockStored,
    KvMedium,
    LoadMetrics,
    RouterEvent,
    SequenceBooked,
    SequenceFreed,
    SequencePrefilled,
)
from dynamo.llm.router import AllWorkersBusyError, PlacementPreview

log = logging.getLogger(__name__)


class BookingObserver(Protocol):
    """Told every change of the scheduler's own books (not of bookings applied from other
    replicas), in the order they happen: what a replica publishes to the others."""

    def booking_changed(self, change: BookingChange) -> None: ...


class KvScheduler:
    """Scores workers for a request and keeps the books of requests in flight."""

    def __init__(
        self,
        block_size: int,
        *,
        indexer: KvIndexer | None = None,
        overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
        temperature: float = 0.0,
        rng: random.Random | None = None,
        load_metrics_ttl_s: float = DEFAULT_LOAD_METRICS_TTL_S,
        load_report_hold_off_s: float = DEFAULT_LOAD_REPORT_HOLD_OFF_S,
        clock: Callable[[], float] = time.monotonic,
        busy: BusyThresholds | None = None,
        prediction: CachePrediction | None = None,
        tier_weights: TierWeights | None = None,
    ) -> None:
        if overlap_score_weight < 0:
            raise ValueError("overlap_score_weight must be >= 0")
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.block_size = block_size
        self.indexer = indexer if indexer is not None else KvIndexer(block_size)
        if self.indexer.block_size != block_size:
            raise ValueError("indexer block size differs from the scheduler's")
        self.overlap_score_weight = overlap_score_weight
        self.tier_weights = tier_weights if tier_weights is not None else TierWeights()
        self.temperature = temperature
        self.sequences = MultiWorkerSequences()
        self._rng = rng or random.Random()
        self._workers: dict[int, KvWorkerSpec] = {}
        self._metrics: dict[int, tuple[float, LoadMetrics]] = {}
        self._reported_k: dict[int, int] = {}  # K in force, from each worker's last report
        self._metrics_ttl = load_metrics_ttl_s
        self._hold_off = load_report_hold_off_s
        self._released_at: dict[int, float] = {}  # worker id -> last time a request ended
        self._clock = clock
        self.routed: dict[int, RoutingTally] = {}
        self.busy = busy if busy is not None else BusyThresholds()
        self.busy_refusals = 0  # requests refused because every candidate was busy
        self.prediction = prediction if prediction is not None else CachePrediction()
        self.anticipated = AnticipatedBlocks(self.prediction.resolved_ttl_s, clock)
        self._observers: list[BookingObserver] = []

    # ------------------------------------------------------------------ observers

    def add_booking_observer(self, observer: BookingObserver) -> None:
        """Tell `observer` of every change of this scheduler's own bookings from now on."""
        self._observers.append(observer)

    def remove_booking_observer(self, observer: BookingObserver) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def _notify(self, change: BookingChange) -> None:
        for observer in self._observers:
            observer.booking_changed(change)

    # ------------------------------------------------------------------ inputs

    def update_worker(self, config: KvWorkerSpec) -> None:
        """A worker registered or changed its card."""
        if config.block_size != self.block_size:
            log.warning(
                "worker %d uses block size %d, router %d: its cache cannot be matched",
                config.worker_id,
                config.block_size,
                self.block_size,
            )
        self._workers[config.worker_id] = config

    def remove_worker(self, worker_id: int) -> None:
        """A worker's lease expired: forget its cache, its books and its metrics."""
        self._workers.pop(worker_id, None)
        self._metrics.pop(worker_id, None)
        self._reported_k.pop(worker_id, None)
        self._released_at.pop(worker_id, None)
        self.indexer.remove_worker(worker_id)
        orphaned = self.sequences.remove_worker(worker_id)
        self.anticipated.remove_worker(worker_id)
        # Their requests end without a `free` that finds them: tell observers now (an
        # observer ignores the keys of bookings it did not make).
        for request_id in orphaned:
            self._notify(SequenceFreed(request_id))

    def apply_event(self, event: RouterEvent) -> None:
        """A worker's KV cache event (from its relay). Stored blocks the router was
        anticipating there (on its device tier) are confirmed: the index holds them from
        now on; a cleared cache keeps nothing that was anticipated either."""
        self.indexer.apply(event)
        if isinstance(event.data, KvBlockStored) and event.data.medium is KvMedium.GPU:
            self.anticipated.confirm(event.worker_id, event.data.block_hashes)
        elif isinstance(event.data, KvAllCleared):
            self.anticipated.remove_worker(event.worker_id)

    def update_load(self, metrics: LoadMetrics) -> None:
        """A worker's own load report; used while younger than the TTL. An adaptive
        worker's K in force re-books the speculative slots of its requests in flight."""
        self._metrics[metrics.worker_id] = (self._clock(), metrics)
        if metrics.num_speculative_tokens is None:
            return
        self._reported_k[metrics.worker_id] = metrics.num_speculative_tokens
        seqs = self.sequences.get(metrics.worker_id)
        if seqs is not None and self.worker_spec(metrics.worker_id).is_adaptive:
            seqs.set_speculative_depth(self.speculative_depth_of(metrics.worker_id))

    def speculative_depth_of(self, worker_id: int, batch_size: int = 1) -> int:
        """K on `worker_id` with `batch_size` requests: the K an adaptive worker last
        reported in force, else its card's (dynamic speculation changes K with the batch)."""
        return speculative_depth(
            self.worker_spec(worker_id).speculative, batch_size, self._reported_k.get(worker_id)
        )

    # ------------------------------------------------------------------ decisions

    def score(self, token_ids: Sequence[int], worker_ids: Sequence[int]) -> list[WorkerScore]:
        """Every candidate's cost for a request, without booking anything."""
        if not token_ids:
            raise ValueError("a request needs at least one token")
        return self._score_all(
            token_ids, compute_block_hashes(token_ids, self.block_size), worker_ids
        )

    def preview(self, token_ids: Sequence[int], worker_ids: Sequence[int]) -> PlacementPreview:
        """The worker `schedule` would choose now at temperature 0 (the lowest cost; the
        first of equals), what it would reuse of the prompt and its queued prefill
        tokens, with nothing booked and no refusal counted. When every candidate is busy,
        the cheapest of them, marked busy."""
        if not worker_ids:
            raise ValueError("no worker to choose from")
        free = [w for w in worker_ids if self.busy_reason(w) is None]
        best = min(self.score(token_ids, free or worker_ids), key=lambda s: s.cost)
        seqs = self.sequences.get(best.worker_id)
        cached = best.overlap_blocks * self.worker_spec(best.worker_id).block_size
        return PlacementPreview(
            worker_id=best.worker_id,
            cached_tokens=min(cached, len(token_ids)),
            queued_prefill_tokens=seqs.prefill_tokens if seqs is not None else 0,
            busy=not free,
        )

    def schedule(
        self, request_id: str, token_ids: Sequence[int], worker_ids: Sequence[int]
    ) -> RoutingDecision:
        """Choose a worker for the request and book it there until `free`."""
        if not worker_ids:
            raise ValueError("no worker to choose from")
        if not token_ids:
            raise ValueError("a request needs at least one token")
        self.free(request_id)  # a retried request is re-booked, not counted twice
        worker_ids = self.not_busy(worker_ids)
        hashes = compute_block_hashes(token_ids, self.block_size)
        scores = self._score_all(token_ids, hashes, worker_ids)
        best = choose(scores, self.temperature, self._rng)
        self._book(request_id, best, token_ids, hashes)
        decision = RoutingDecision(
            worker_id=best.worker_id,
            overlap_blocks=best.overlap_blocks,
            request_blocks=num_blocks_spanned(len(token_ids), self.block_size),
            scores=tuple(scores),
        )
        self.routed.setdefault(best.worker_id, RoutingTally()).add(decision)
        return decision

    def not_busy(self, worker_ids: Sequence[int]) -> Sequence[int]:
        """The candidates that are not busy; `AllWorkersBusyError` when none is."""
        if not self.busy.enabled:
            return worker_ids
        reasons = {w: self.busy_reason(w) for w in worker_ids}
        free = [w for w in worker_ids if reasons[w] is None]
        if free:
            return free
        self.busy_refusals += 1
        why = "; ".join(f"{w:016x}: {reason}" for w, reason in reasons.items())
        raise AllWorkersBusyError(f"all {len(worker_ids)} workers are busy ({why})")

    def busy_reason(self, worker_id: int) -> str | None:
        """Why the worker counts as busy now (None: it does not, or its load is unknown)."""
        load = self._recent_load(worker_id)
        if load is None:
            return None
        seqs = self.sequences.get(worker_id)
        if seqs is None:
            return self.busy.busy_reason(load)
        running_at_once = self.worker_spec(worker_id).max_num_seqs
        waiting = max(0, seqs.active_requests - running_at_once) if running_at_once else 0
        return self.busy.busy_reason(load, seqs.active_blocks, waiting)

    def mark_prefill_completed(self, request_id: str, num_new_tokens: int = 0) -> None:
        """The request's first output arrived: its prefill is no longer pending, and the
        `num_new_tokens` it produced grow its context."""
        if self.apply_prefill(request_id, num_new_tokens):
            self._notify(SequencePrefilled(request_id, num_new_tokens))

    def free(self, request_id: str) -> bool:
        """The request ended (finished, failed or cancelled): release its blocks (see
        `release`) and tell the observers. False when it was not booked."""
        freed = self.release(request_id)
        if freed:
            self._notify(SequenceFreed(request_id))
        return freed

    def knows_worker(self, worker_id: int) -> bool:
        """Whether `worker_id` is a worker this scheduler has the card of."""
        return worker_id in self._workers

    def apply_booking(self, key: str, booking: SequenceBooked) -> bool:
        """Book `booking` under `key` (replacing what `key` held): this scheduler's own
        decision, or one another replica made (then `key` is namespaced by the replica, so
        it cannot meet a local request id). Its blocks count on the worker as if routed
        from here, and its not yet reported blocks as coming there. False (nothing booked)
        when the booking's block size is not the one this scheduler keeps the worker's
        books in; `ValueError` when its hashes do not fit its prompt length."""
        config = self.worker_spec(booking.worker_id)
        if booking.block_size != config.block_size:
            return False
        self.release(key)  # a retried or re-announced request is re-booked, not doubled
        self.sequences.ensure_worker(
            booking.worker_id, config.block_size, self.speculative_depth_of(booking.worker_id)
        )
        self.sequences.add_request(
            booking.worker_id,
            key,
            booking.prompt_len,
            block_hashes=booking.block_hashes,
            overlap_blocks=booking.overlap_blocks,
            num_speculative_tokens=booking.num_speculative_tokens,
        )
        # Everything the events have not reported there yet will be (or stays) cached:
        # refreshed on every use, so without events a prefix in use does not expire.
        self.anticipated.add(booking.worker_id, booking.block_hashes[booking.cached_blocks :])
        if booking.first_output_tokens is not None:
            self.apply_prefill(key, booking.first_output_tokens)
        return True

    def apply_prefill(self, key: str, num_new_tokens: int = 0) -> bool:
        """`mark_prefill_completed` without telling observers; False if `key` is not
        booked."""
        if self.sequences.worker_of(key) is None:
            return False
        self.sequences.mark_prefill_completed(key)
        self.sequences.append_tokens(key, num_new_tokens)
        return True

    def release(self, request_id: str) -> bool:
        """Release a booking's blocks without telling observers. One that ended before
        its first output may never have computed its prompt, so the blocks it brought
        stop counting as coming (unless a request still in flight there holds them).
        False when it was not booked."""
        worker_id = self.sequences.worker_of(request_id)
        if worker_id is None:
            return False
        self._released_at[worker_id] = self._clock()
        seqs = self.sequences.get(worker_id)
        state = seqs.get(request_id) if seqs is not None else None
        freed = self.sequences.free(request_id)
        if seqs is not None and state is not None and state.prefill_pending:
            brought = state.shared_hashes[state.overlap_blocks :]
            self.anticipated.drop(worker_id, [h for h in brought if not seqs.pins(h)])
        return freed

    def worker_spec(self, worker_id: int) -> KvWorkerSpec:
        """The worker's config; an unknown worker (no card yet) has no speculation."""
        config = self._workers.get(worker_id)
        return config if config is not None else KvWorkerSpec(worker_id, self.block_size)

    # ------------------------------------------------------------------ views

    def debug_state(self) -> dict[str, Any]:
        """A JSON-able picture of what the router believes, per worker: cached blocks
        (indexer), booked load (speculative slots included), the worker's own last load
        report, and what was routed there. For `GET /debug/kv`, not for decisions."""
        total = RoutingTally.sum(self.routed.values())
        return {
            "block_size": self.block_size,
            "overlap_score_weight": self.overlap_score_weight,
            "tier_weights": self.tier_weights.as_dict(),
            "temperature": self.temperature,
            "busy_thresholds": self.busy.as_dict(),
            "busy_refusals": self.busy_refusals,
            "unique_blocks": self.indexer.num_unique_blocks(),
            "indexer": asdict(self.indexer.stats),
            "kv_events": self.prediction.kv_events,
            "anticipated": self.anticipated.stats(),
            "routing": total.as_dict(),
            "workers": {
                f"{worker_id:016x}": self._worker_view(worker_id)
                for worker_id in sorted(self._known_workers())
            },
        }

    def _known_workers(self) -> set[int]:
        return (
            set(self._workers)
            | set(self.indexer.workers())
            | set(self.sequences.workers())
            | set(self._metrics)
            | set(self.anticipated.workers())
        )

    def _worker_view(self, worker_id: int) -> dict[str, Any]:
        seqs = self.sequences.get(worker_id)
        tally = self.routed.get(worker_id, RoutingTally())
        return {
            "worker_id": worker_id,
            "cached_blocks": self.indexer.block_count(worker_id),
            "cached_blocks_by_tier": self.indexer.tier_counts(worker_id),
            "anticipated_blocks": self.anticipated.block_count(worker_id),
            "active_blocks": seqs.active_blocks if seqs is not None else 0,
            "active_requests": seqs.active_requests if seqs is not None else 0,
            "num_speculative_tokens": self.speculative_depth_of(worker_id),
            # The K each request in flight is booked with (one value but while a new K
            # reaches a worker that does not adapt: its requests keep the K they began with).
            "booked_speculative_tokens": sorted(
                {state.num_speculative_tokens for state in seqs} if seqs is not None else ()
            ),
            "routed": tally.as_dict(),
            "load": self._load_view(worker_id),
            "busy": self.busy_reason(worker_id) if self.busy.enabled else None,
        }

    def _load_view(self, worker_id: int) -> dict[str, Any] | None:
        entry = self._metrics.get(worker_id)
        if entry is None:
            return None
        received, metrics = entry
        return {
            "active_requests": metrics.active_requests,
            "waiting_requests": metrics.waiting_requests,
            "active_blocks": metrics.active_blocks,
            "total_blocks": metrics.total_blocks,
            "kv_usage": metrics.kv_usage,
            "num_speculative_tokens": metrics.num_speculative_tokens,
            "age_s": round(self._clock() - received, 3),
        }

    # ------------------------------------------------------------------ internals

    def _score_all(
        self, token_ids: Sequence[int], hashes: list[int], worker_ids: Sequence[int]
    ) -> list[WorkerScore]:
        found = self.indexer.find_matches(hashes)
        return [self._score_worker(w, token_ids, hashes, found) for w in worker_ids]

    def _score_worker(
        self, worker_id: int, token_ids: Sequence[int], hashes: list[int], found: OverlapScores
    ) -> WorkerScore:
        overlap, tiers = found.get(worker_id), found.tier_match(worker_id)  # any tier
        config = self.worker_spec(worker_id)
        seqs = self.sequences.ensure_worker(
            worker_id, config.block_size, self.speculative_depth_of(worker_id)
        )
        k = self.speculative_depth_of(worker_id, seqs.active_requests + 1)
        if config.block_size != self.block_size:
            overlap, tiers = 0, None
            hashes = compute_block_hashes(token_ids, config.block_size)
        matched, overlap = overlap, tiers.device_prefix if tiers is not None else overlap
        cached = overlap
        # Blocks a request in flight here is computing, and those a request routed here
        # lately brought (no event yet, or ever without events) count as overlap: else
        # requests of one prefix would split over workers before its events land.
        overlap = max(overlap, seqs.pinned_prefix_blocks(hashes))
        overlap = self.anticipated.extend_prefix(worker_id, hashes, overlap)  # device tier
        matched = config.reusable_prefix_blocks(max(matched, overlap))  # what it won't compute
        overlap = min(overlap, matched)
        value = self.tier_weights.value(tiers, overlap, matched)  # offloaded blocks weigh less
        cached = min(cached, overlap)
        request_blocks = num_blocks_spanned(len(token_ids), config.block_size)
        prefill_blocks = request_blocks - value.weighted
        active = seqs.potential_blocks(hashes, len(token_ids), k)
        active += self._unbooked_load(worker_id, seqs.active_blocks)
        cost = self.overlap_score_weight * prefill_blocks + active
        return WorkerScore(worker_id, overlap, prefill_blocks, active, k, cost, cached, *value)

    def _recent_load(self, worker_id: int) -> LoadMetrics | None:
        """The worker's own last load report, unless it is older than the TTL."""
        entry = self._metrics.get(worker_id)
        if entry is None:
            return None
        received, metrics = entry
        return metrics if self._clock() - received <= self._metrics_ttl else None

    def _unbooked_load(self, worker_id: int, booked_blocks: int) -> int:
        """Blocks the worker reports beyond what this router booked there (requests
        from other frontends); 0 without a recent report, or with one that may still
        count a request this router released since."""
        entry = self._metrics.get(worker_id)
        if entry is None:
            return 0
        received, metrics = entry
        if self._clock() - received > self._metrics_ttl:
            return 0
        if received < self._released_at.get(worker_id, -math.inf) + self._hold_off:
            return 0  # may predate a release this router already booked
        return max(0, metrics.active_blocks - booked_blocks)

    def _book(
        self, request_id: str, best: WorkerScore, token_ids: Sequence[int], hashes: list[int]
    ) -> None:
        config = self.worker_spec(best.worker_id)
        if config.block_size != self.block_size:
            hashes = compute_block_hashes(token_ids, config.block_size)
        booking = SequenceBooked(
            request_id=request_id,
            worker_id=best.worker_id,
            block_size=config.block_size,
            prompt_len=len(token_ids),
            block_hashes=hashes,
            overlap_blocks=best.overlap_blocks,
            cached_blocks=best.cached_blocks,
            num_speculative_tokens=best.num_speculative_tokens,
        )
        self.apply_booking(request_id, booking)
        self._notify(booking)
