"""One simulated worker on NATS: a `MockEngine` behind the same endpoints, model card,
KV events and load reports as a vLLM worker (`dynamo.vllm.main.Worker`).

Start-up order is the vLLM worker's: engine, NATS connection, endpoints, KV events and
load, and the model card last, so a frontend never sees a model it cannot reach. `stop`
runs the other way round: publishers, model card, then the runtime's graceful shutdown
(instances marked draining at once, requests in flight given `drain_timeout` to finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynamo.llm.kv_router.publisher import KvEventPublisher, LoadPublisher
from dynamo.llm.model_card import publish_model_card, remove_model_card
from dynamo.llm.protocols import (
    ClearKvBlocksResult,
    KvEventData,
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
    SpeculativeInfo,
    WorkerType,
)
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.engine import MockEngine
from dynamo.mocker.kv_events import KvEventForwarder
from dynamo.runtime import DistributedRuntime

log = logging.getLogger(__name__)

PUBLISHER_STOP_S = 3.0
"""Bound on stopping a publisher: a lost cancellation must not hang the shutdown."""
DISCONNECTED_STOP_S = 1.0
"""How long `stop` waits for the runtime to close when NATS is already unreachable."""


class MockerWorker:
    """A simulated worker: one runtime (own instance id), one engine, one model card."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine_config: MockEngineConfig,
        *,
        model_path: Path,
        served_model_name: str,
        name: str = "mocker",
    ) -> None:
        self.settings = settings
        self.engine_config = engine_config
        self.model_path = Path(model_path)
        self.served_model_name = served_model_name
        self.name = name
        self.engine = MockEngine(engine_config, on_kv_events=self._on_kv_events)
        self.runtime: DistributedRuntime | None = None
        self.card: ModelCard | None = None
        self.kv_events: KvEventForwarder | None = None
        self.load_publisher: LoadPublisher | None = None
        self.system_port: int | None = None
        self._stopping = False

    @property
    def instance_id(self) -> int:
        if self.runtime is None:
            raise RuntimeError("worker not started")
        return self.runtime.instance_id

    def health(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        if not self.engine.is_running:
            return False, "engine not running"
        if self.runtime is None or not self.runtime.is_connected:
            return False, "not connected to NATS"
        if self.card is None:
            return False, "not registered"
        return True, "ready"

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, wait_for_server: float = 30.0) -> MockerWorker:
        s = self.settings
        await self.engine.start()
        self.runtime = await DistributedRuntime.connect(
            s.nats_server, lease_ttl=s.lease_ttl, name=self.name, wait_for_server=wait_for_server
        )
        component = self.runtime.namespace(s.namespace).component(s.component)
        worker_id = self.runtime.instance_id
        if s.publish_kv_events:
            publisher = await KvEventPublisher(
                self.runtime, s.namespace, s.component, worker_id
            ).start()
            self.kv_events = KvEventForwarder(publisher, worker_id).start()
        await component.endpoint(s.endpoint).serve(self.generate, request_type=PreprocessedRequest)
        await component.endpoint("clear_kv_blocks").serve(self.clear_kv_blocks)
        self.load_publisher = await LoadPublisher(
            self.runtime,
            s.namespace,
            s.component,
            worker_id,
            lambda: self.engine.load_metrics(worker_id),
        ).start()
        card = self._model_card()
        await publish_model_card(self.runtime, card, self.model_path)
        self.card = card
        log.info(
            "%s: serving %s as worker %x on %s/%s/%s",
            self.name,
            card.name,
            worker_id,
            s.namespace,
            s.component,
            s.endpoint,
        )
        return self

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Deregister, let requests in flight finish (bounded), disconnect (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        drain = self.settings.drain_timeout if drain_timeout is None else drain_timeout
        for owner in (self.load_publisher, self.kv_events):
            if owner is not None:
                await _stop_within(owner, PUBLISHER_STOP_S)
        if self.runtime is not None:
            try:
                await self._leave(self.runtime, drain)
            except Exception as exc:
                log.warning("%s: runtime shutdown: %s", self.name, exc)
        await self.engine.stop()

    async def _leave(self, runtime: DistributedRuntime, drain_timeout: float) -> None:
        if runtime.is_connected:
            if self.card is not None:
                await remove_model_card(runtime, self.card)
            await runtime.shutdown(drain_timeout=drain_timeout)
            return
        # The broker is gone (a Ctrl-C often stops it together with us): there is nobody
        # to deregister from or drain for, and every NATS call would wait for its
        # timeout. Our keys expire with their leases.
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(runtime.shutdown(drain_timeout=0), DISCONNECTED_STOP_S)

    # ------------------------------------------------------------------ endpoints

    async def generate(
        self, request: PreprocessedRequest, ctx: Any
    ) -> AsyncIterator[LLMEngineOutput]:
        """`generate`: the engine's outputs as they come. When the client goes away the
        runtime closes this generator; closing the engine stream aborts the request,
        which frees its KV blocks at once."""
        request_id = getattr(ctx, "id", None) or request.request_id
        outputs = self.engine.generate(request, request_id)
        try:
            async for output in outputs:
                yield output
                if ctx.is_stopped():
                    return
        finally:
            await outputs.aclose()

    async def clear_kv_blocks(self, request: Any, ctx: Any) -> AsyncIterator[ClearKvBlocksResult]:
        """`clear_kv_blocks`: drop the simulated prefix cache (refused while requests run)."""
        ok = self.engine.clear_kv_blocks()
        message = "prefix cache cleared" if ok else "prefix cache not cleared (requests running)"
        log.info("%s: clear_kv_blocks: %s", self.name, message)
        yield ClearKvBlocksResult(worker_id=self.instance_id, cleared=ok, message=message)

    # ------------------------------------------------------------------ internals

    def _on_kv_events(self, events: list[KvEventData]) -> None:
        if self.kv_events is not None:
            self.kv_events.submit(events)

    def _model_card(self) -> ModelCard:
        cfg = self.engine_config
        s = self.settings
        k = cfg.num_speculative_tokens
        return ModelCard(
            name=self.served_model_name,
            namespace=s.namespace,
            component=s.component,
            endpoint=s.endpoint,
            instance_id=self.instance_id,
            worker_type=WorkerType.AGGREGATED,
            source_path=str(self.model_path),
            context_length=cfg.max_model_len,
            kv_block_size=cfg.block_size,
            total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            eos_token_ids=list(cfg.eos_token_ids),
            speculative=SpeculativeInfo(method=s.speculative_method, num_speculative_tokens=k)
            if k
            else None,
            system_port=self.system_port,
        )


async def _stop_within(owner: Any, timeout: float) -> None:
    """`await owner.stop()`, but give up after `timeout` (logged) or on an error.
    `asyncio.wait` rather than `wait_for`: it never cancels, so it cannot hang on a
    cancellation the owner swallowed."""
    task = asyncio.ensure_future(owner.stop())
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        log.warning("%s did not stop within %.1fs", type(owner).__name__, timeout)
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        log.debug("%s.stop failed: %s", type(owner).__name__, task.exception())
