"""`MockerBackend`: the simulated engine behind `dynamo.llm.worker`'s `EngineBackend` seam,
and `mocker_worker`, which registers one as a worker with the wire behaviour of a vLLM
worker (same endpoints, model card, KV events and load reports), in the role
(`--disaggregation-mode`) it registers with."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec

from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.kv_router.worker_spec import HIDDEN_STATE_DRAFTERS
from dynamo.llm.protocols import (
    FinishReason,
    KvEventData,
    LLMEngineOutput,
    LoadMetrics,
    PreprocessedRequest,
    SpeculativeInfo,
    WorkerType,
)
from dynamo.llm.worker import EngineDescription, ServedWorker, WorkerRegistration
from dynamo.llm.worker.roles import WORKER_TYPES
from dynamo.mocker.args import WorkerSettings, fields_from
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.engine import MockEngine
from dynamo.mocker.handoff import KvHandoff
from dynamo.mocker.kv_events import KvEventForwarder
from dynamo.mocker.request import InvalidRequest
from dynamo.runtime import Context, InvalidRequestError


class MockerBackend:
    """One `MockEngine`; its cache events go out through a `KvEventForwarder`.

    Its `worker_type` decides what a request's disaggregation fields do, as on a vLLM
    worker: a prefill worker serves every request as a prefill leg (one token, and
    `disaggregated_params` naming this engine's KV on the final output, whose token it
    keeps to itself: the decode worker produces the first token); a decode worker hands
    `prefill_result` to its engine, which loads instead of computing (`transfer`); an
    aggregated worker has no KV connector and ignores both."""

    def __init__(
        self,
        engine_config: MockEngineConfig,
        *,
        speculative_method: str,
        worker_type: WorkerType = WorkerType.AGGREGATED,
    ) -> None:
        if engine_config.num_speculative_tokens and speculative_method in HIDDEN_STATE_DRAFTERS:
            # Simulate what vLLM does for the method this worker advertises.
            engine_config = dataclasses.replace(engine_config, drops_last_prefix_block=True)
        self.engine_config = engine_config
        self.speculative_method = speculative_method
        self.worker_type = worker_type
        # Names the engine in its handoffs, as vLLM's `engine_id` (a uuid per engine).
        self.engine_id = uuid.uuid4().hex
        self.engine = MockEngine(engine_config, on_kv_events=self._on_kv_events)
        self.kv_events: KvEventForwarder | None = None

    async def start(self) -> EngineDescription:
        await self.engine.start()
        cfg = self.engine_config
        k = cfg.num_speculative_tokens
        return EngineDescription(
            context_length=cfg.max_model_len,
            kv_block_size=cfg.block_size,
            total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            eos_token_ids=list(cfg.eos_token_ids),
            speculative=SpeculativeInfo(
                method=self.speculative_method,
                num_speculative_tokens=k,
                drops_last_prefix_block=cfg.drops_last_prefix_block,
            )
            if k
            else None,
        )

    def is_ready(self) -> bool:
        return self.engine.is_running

    def dead_reason(self) -> str | None:
        return None if self.engine.dead is None else str(self.engine.dead)

    async def generate(
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """The engine's outputs as they come. When the client goes away the runtime
        closes this generator; closing the engine stream aborts the request, which frees
        its KV blocks at once. Parameters the engine refuses end the request as the
        client's error (`InvalidRequestError`: HTTP 400 at the frontend), as on vLLM."""
        request = self._for_role(request)
        prefill = self.worker_type is WorkerType.PREFILL
        outputs = self.engine.generate(request, context.id or request.request_id)
        try:
            async for output in outputs:
                if prefill and output.finish_reason in HANDED_OFF:
                    self._hand_off(output, len(request.token_ids))
                yield output
                if context.is_stopped():
                    return
        except InvalidRequest as exc:
            raise InvalidRequestError(str(exc)) from None
        finally:
            await outputs.aclose()

    async def clear_kv_blocks(self) -> bool:
        return self.engine.clear_kv_blocks()

    def load_metrics(self, worker_id: int) -> LoadMetrics:
        return self.engine.load_metrics(worker_id)

    def watch_load(self, changed: Callable[[], None]) -> None:
        self.engine.watch_load(changed)

    async def start_kv_events(self, publisher: KvEventPublisher) -> KvEventForwarder:
        self.kv_events = KvEventForwarder(publisher, publisher.worker_id).start()
        return self.kv_events

    async def stop(self) -> None:
        await self.engine.stop()

    def _on_kv_events(self, events: list[KvEventData]) -> None:
        if self.kv_events is not None:
            self.kv_events.submit(events)

    def _for_role(self, request: PreprocessedRequest) -> PreprocessedRequest:
        """The request as this worker's role serves it (see the class docstring): a
        prefill leg is one token with `do_remote_decode` (vLLM's prefill worker forces
        both); only a decode worker loads a `prefill_result`."""
        if self.worker_type is WorkerType.PREFILL:
            stop = msgspec.structs.replace(request.stop_conditions, max_tokens=1, min_tokens=None)
            return msgspec.structs.replace(
                request,
                stop_conditions=stop,
                kv_transfer_params={**(request.kv_transfer_params or {}), "do_remote_decode": True},
                prefill_result=None,
            )
        if self.worker_type is WorkerType.AGGREGATED and request.prefill_result is not None:
            return msgspec.structs.replace(request, prefill_result=None)
        return request

    def _hand_off(self, output: LLMEngineOutput, prompt_tokens: int) -> None:
        """Turn a prefill leg's final output into the handoff (`handoff.KvHandoff`)."""
        output.token_ids = []  # the decode worker produces the first token, as on vLLM
        output.log_probs = None
        handoff = KvHandoff(self.engine_id, prompt_tokens, self.engine_config.block_size)
        output.disaggregated_params = handoff.to_params()


HANDED_OFF = frozenset({FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS})
"""Finish reasons of a prefill leg whose prompt KV was computed (not cancelled or failed)."""


def mocker_worker(
    settings: WorkerSettings,
    engine_config: MockEngineConfig,
    *,
    model_path: Path,
    served_model_name: str,
    name: str = "mocker",
) -> ServedWorker[MockerBackend]:
    """One simulated worker, registered as `settings` say once started."""
    registration = fields_from(
        WorkerRegistration,
        settings,
        served_model_name=served_model_name,
        model_path=Path(model_path),
        worker_type=WORKER_TYPES[settings.disaggregation_mode],
        drain_timeout_s=settings.drain_timeout,
    )
    backend = MockerBackend(
        engine_config,
        speculative_method=settings.speculative_method,
        worker_type=registration.worker_type,
    )
    return ServedWorker(backend, registration, name=name)
