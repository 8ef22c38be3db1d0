"""`MockerBackend`: the simulated engine behind `dynamo.llm.worker`'s `EngineBackend` seam,
and `mocker_worker`, which registers one as a worker with the wire behaviour of a vLLM
worker (same endpoints, model card, KV events and load reports)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.kv_router.worker_spec import HIDDEN_STATE_DRAFTERS
from dynamo.llm.protocols import (
    KvEventData,
    LLMEngineOutput,
    LoadMetrics,
    PreprocessedRequest,
    SpeculativeInfo,
    WorkerType,
)
from dynamo.llm.worker import EngineDescription, ServedWorker, WorkerRegistration
from dynamo.mocker.args import WorkerSettings, fields_from
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.engine import MockEngine
from dynamo.mocker.kv_events import KvEventForwarder
from dynamo.mocker.request import InvalidRequest
from dynamo.runtime import Context, InvalidRequestError


class MockerBackend:
    """One `MockEngine`; its cache events go out through a `KvEventForwarder`."""

    def __init__(self, engine_config: MockEngineConfig, *, speculative_method: str) -> None:
        if engine_config.num_speculative_tokens and speculative_method in HIDDEN_STATE_DRAFTERS:
            # Simulate what vLLM does for the method this worker advertises.
            engine_config = dataclasses.replace(engine_config, drops_last_prefix_block=True)
        self.engine_config = engine_config
        self.speculative_method = speculative_method
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
        outputs = self.engine.generate(request, context.id or request.request_id)
        try:
            async for output in outputs:
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
        worker_type=WorkerType.AGGREGATED,
        drain_timeout_s=settings.drain_timeout,
    )
    backend = MockerBackend(engine_config, speculative_method=settings.speculative_method)
    return ServedWorker(backend, registration, name=name)
