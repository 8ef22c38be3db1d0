"""`MultiWorkerSequences`: the `ActiveSequences` of every worker of one model, by request.

The router books a request on the worker it chose but releases it by request id alone
(`Router.on_finished` does not say where the request went), so it needs an index from
request to worker over the per-worker books. That index, and creating, resizing and
forgetting each worker's books, live here; what one worker's requests hold (the slot
model) stays in `active_sequences`, which the mocker engine uses on its own.
"""

from __future__ import annotations

from typing import Unpack

from dynamo.llm.kv_router.active_sequences import (
    ActiveSequences,
    RequestOptions,
    SequenceState,
    WorkerLoad,
)


class MultiWorkerSequences:
    """`ActiveSequences` for every worker of one model, plus which request runs where.

    The router books a request on the worker it chose and releases it by request id
    alone, since `Router.on_finished` does not say where the request went.
    """

    def __init__(self) -> None:
        self._workers: dict[int, ActiveSequences] = {}
        self._worker_of: dict[str, int] = {}

    def ensure_worker(
        self, worker_id: int, block_size: int, num_speculative_tokens: int = 0
    ) -> ActiveSequences:
        """The books of `worker_id`, created on first use; a changed K applies to
        requests added from now on (requests in flight keep the K they started with)."""
        seqs = self._workers.get(worker_id)
        if seqs is None or seqs.block_size != block_size:
            if seqs is not None and seqs.active_requests:
                raise ValueError(f"worker {worker_id} changed block size with requests in flight")
            seqs = ActiveSequences(block_size, num_speculative_tokens)
            self._workers[worker_id] = seqs
        seqs.num_speculative_tokens = num_speculative_tokens
        return seqs

    def get(self, worker_id: int) -> ActiveSequences | None:
        return self._workers.get(worker_id)

    def add_request(
        self, worker_id: int, request_id: str, prompt_len: int, **options: Unpack[RequestOptions]
    ) -> SequenceState:
        """Book `request_id` on `worker_id` (made known by `ensure_worker`); see
        `ActiveSequences.add_request`, which takes the options."""
        if request_id in self._worker_of:
            raise ValueError(f"request {request_id!r} is already active")
        state = self._workers[worker_id].add_request(request_id, prompt_len, **options)
        self._worker_of[request_id] = worker_id
        return state

    def worker_of(self, request_id: str) -> int | None:
        return self._worker_of.get(request_id)

    def mark_prefill_completed(self, request_id: str) -> None:
        worker_id = self._worker_of.get(request_id)
        if worker_id is not None:
            self._workers[worker_id].mark_prefill_completed(request_id)

    def append_tokens(self, request_id: str, num_tokens: int) -> None:
        worker_id = self._worker_of.get(request_id)
        if worker_id is not None:
            self._workers[worker_id].append_tokens(request_id, num_tokens)

    def free(self, request_id: str) -> bool:
        """Release a request wherever it runs; False when it is not booked."""
        worker_id = self._worker_of.pop(request_id, None)
        if worker_id is None:
            return False
        return self._workers[worker_id].free(request_id)

    def remove_worker(self, worker_id: int) -> list[str]:
        """Forget a worker that went away; returns the request ids that were on it."""
        seqs = self._workers.pop(worker_id, None)
        if seqs is None:
            return []
        orphaned = [state.request_id for state in seqs]
        for request_id in orphaned:
            self._worker_of.pop(request_id, None)
        return orphaned

    def loads(self) -> dict[int, WorkerLoad]:
        """Per worker: active blocks (speculative slots included), requests, prefill tokens."""
        return {worker_id: seqs.load() for worker_id, seqs in self._workers.items()}

    def workers(self) -> list[int]:
        return list(self._workers)
