"""`ServedWorker`: one engine registered in the system, from connecting to leaving.

Start-up order, so a frontend never sees a model it cannot reach: the engine loads, the
worker connects to NATS, serves `generate` and `clear_kv_blocks` (the instance is then
live), starts its KV-event and load publishers, and publishes its model card last (only
now is it healthy). `stop` runs the other way round: publishers, model card, then the
runtime's graceful shutdown (instances marked draining at once, requests in flight given
the drain timeout to finish), and the engine last.

After every reconnect to NATS the worker uploads its tokenizer files again (those the
broker lacks, retried with backoff): a broker restarted without its store has lost them,
while the runtime itself re-puts the instance and card keys, and the KV-event publisher
re-announces the cache (`KvEventPublisher.resync`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from dynamo.llm.kv_router.publisher import KvEventPublisher, LoadPublisher
from dynamo.llm.model_card import (
    publish_model_card,
    remove_model_card,
    upload_tokenizer_files,
)
from dynamo.llm.protocols import ClearKvBlocksResult, ModelCard, PreprocessedRequest
from dynamo.llm.worker.backend import (
    CLEAR_KV_BLOCKS_ENDPOINT,
    EngineBackend,
    EngineDescription,
    Stoppable,
    WorkerRegistration,
)
from dynamo.llm.worker.inflight import inflight_bound
from dynamo.runtime import Context, DistributedRuntime
from dynamo.runtime.backoff import retry_until_done
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

B = TypeVar("B", bound=EngineBackend)

PUBLISHER_STOP_S = 3.0
"""Bound on stopping a publisher: a lost cancellation must not hang the shutdown."""
CONNECT_WAIT_S = 30.0
"""How long a starting worker waits for NATS (processes often start together)."""


class ServedWorker(Generic[B]):
    """One backend behind its own runtime (instance id), endpoints and model card."""

    def __init__(self, backend: B, registration: WorkerRegistration, *, name: str) -> None:
        self.backend = backend
        self.registration = registration
        self.name = name
        self.runtime: DistributedRuntime | None = None
        self.card: ModelCard | None = None
        self.system_port: int | None = None  # advertised on the card (set before start)
        self._publishers: list[Stoppable] = []
        self._kv_events: KvEventPublisher | None = None
        self._stopping = False

    @property
    def instance_id(self) -> int:
        if self.runtime is None:
            raise RuntimeError(f"{self.name} is not started")
        return self.runtime.instance_id

    @property
    def instance_hex(self) -> str | None:
        """The instance id as logs and metrics show it (None before it connected)."""
        return self.runtime.instance_hex if self.runtime is not None else None

    def health(self) -> tuple[bool, str]:
        """(ready, why not): ready once registered, until it starts leaving."""
        if self._stopping:
            return False, "shutting down"
        dead = self.backend.dead_reason()
        if dead is not None:
            return False, f"engine dead ({dead})"
        if not self.backend.is_ready():
            return False, "engine not ready"
        if self.runtime is None or not self.runtime.is_connected:
            return False, "not connected to NATS"
        if self.card is None:
            return False, "not registered"
        return True, "ready"

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, wait_for_server: float = CONNECT_WAIT_S) -> ServedWorker[B]:
        reg = self.registration
        description = await self.backend.start()
        self.runtime = await DistributedRuntime.connect(
            reg.nats_server,
            lease_ttl=reg.lease_ttl,
            name=self.name,
            wait_for_server=wait_for_server,
            options=reg.nats_options,
        )
        component = self.runtime.namespace(reg.namespace).component(reg.component)
        worker_id = self.runtime.instance_id
        metadata = instance_metadata(reg)
        await component.endpoint(reg.endpoint).serve(
            self.backend.generate,
            request_type=PreprocessedRequest,
            metadata=metadata,
            max_inflight=inflight_bound(reg.max_inflight_requests, description.max_num_seqs),
            address=reg.advertise_host or "",
        )
        await component.endpoint(CLEAR_KV_BLOCKS_ENDPOINT).serve(
            self._clear_kv_blocks, metadata=metadata, address=reg.advertise_host or ""
        )
        if reg.publish_kv_events:
            publisher = KvEventPublisher(self.runtime, reg.namespace, reg.component, worker_id)
            self._kv_events = await publisher.start()
            events = await self.backend.start_kv_events(publisher)
            if events is not None:
                self._publishers.append(events)
        else:
            log.info("%s: kv events off: routers see its load but not its cache", self.name)
        load = LoadPublisher(
            self.runtime,
            reg.namespace,
            reg.component,
            worker_id,
            lambda: self.backend.load_metrics(worker_id),
        )
        self.backend.watch_load(load.changed)
        self._publishers.append(await load.start())
        card = self._model_card(description)
        await publish_model_card(self.runtime, card, reg.model_path)
        self.card = card
        self.runtime.add_reconnect_listener(self._restore_tokenizer_files)
        log.info(
            "%s: serving %s as %s worker %x on %s/%s/%s",
            self.name,
            card.name,
            reg.worker_type.value,
            worker_id,
            reg.namespace,
            reg.component,
            reg.endpoint,
        )
        return self

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Deregister, let requests in flight finish (bounded by `drain_timeout`, by
        default the registration's), disconnect, stop the engine. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self.runtime is not None:
            self.runtime.remove_reconnect_listener(self._restore_tokenizer_files)
        drain = self.registration.drain_timeout_s if drain_timeout is None else drain_timeout
        if self._kv_events is not None:
            self._kv_events.close()  # no re-announcing the cache of a worker that leaves
        for publisher in reversed(self._publishers):
            await _stop_within(publisher, PUBLISHER_STOP_S)
        self._publishers.clear()
        if self.runtime is not None:
            try:
                await self._leave(self.runtime, drain)
            except Exception as exc:
                log.warning("%s: runtime shutdown: %s", self.name, exc)
        await self.backend.stop()

    async def _leave(self, runtime: DistributedRuntime, drain_timeout: float) -> None:
        """Deregister and drain, unless the broker is gone or goes while we do it.

        A Ctrl-C or a killed launch script often stops the broker together with us:
        then there is nobody to deregister from or drain for, every NATS call would wait
        for its timeout (seconds each), and our keys expire with their leases anyway."""
        if runtime.is_connected:
            leave = asyncio.create_task(self._deregister(runtime, drain_timeout))
            lost = asyncio.create_task(runtime.wait_disconnected())
            try:
                await asyncio.wait({leave, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
            if leave.done():
                leave.result()
                return
            log.warning("%s: lost NATS while leaving; its keys expire with their leases", self.name)
            await cancel_and_wait(leave)
        await runtime.abandon()

    async def _deregister(self, runtime: DistributedRuntime, drain_timeout: float) -> None:
        if self.card is not None:
            await remove_model_card(runtime, self.card)
        await runtime.shutdown(drain_timeout=drain_timeout)

    # ------------------------------------------------------------------ internals

    async def _restore_tokenizer_files(self) -> None:
        """Reconnect listener: upload the tokenizer files the broker may have lost, until
        it works. Only the files: the card key is re-put by the runtime's lease keeper,
        and putting it here could race with `stop` removing it."""
        runtime = self.runtime
        if runtime is None:
            return
        model_path = self.registration.model_path

        async def upload() -> None:
            if not self._stopping:  # a worker that is leaving needs no files
                await upload_tokenizer_files(runtime, model_path)

        await retry_until_done(
            upload, what=f"{self.name}: re-uploading the tokenizer files of {model_path}"
        )

    async def _clear_kv_blocks(
        self, request: object, context: Context
    ) -> AsyncIterator[ClearKvBlocksResult]:
        """`clear_kv_blocks`: drop the prefix cache (used by tests, benchmarks and
        operators after a weight update); refused while requests run."""
        ok = await self.backend.clear_kv_blocks()
        message = "prefix cache cleared" if ok else "prefix cache not cleared (requests running)"
        log.info("%s: clear_kv_blocks: %s", self.name, message)
        yield ClearKvBlocksResult(worker_id=self.instance_id, cleared=ok, message=message)

    def _model_card(self, engine: EngineDescription) -> ModelCard:
        reg = self.registration
        return ModelCard(
            name=reg.served_model_name,
            namespace=reg.namespace,
            component=reg.component,
            endpoint=reg.endpoint,
            instance_id=self.instance_id,
            worker_type=reg.worker_type,
            source_path=str(reg.model_path),
            context_length=engine.context_length,
            kv_block_size=engine.kv_block_size,
            total_kv_blocks=engine.total_kv_blocks,
            max_num_seqs=engine.max_num_seqs,
            eos_token_ids=list(engine.eos_token_ids),
            speculative=engine.speculative,
            sampling_defaults=engine.sampling_defaults,
            system_port=self.system_port,
            migration_limit=reg.migration_limit,
            host=reg.advertise_host,
            kv_storage=engine.kv_storage,
        )


def instance_metadata(reg: WorkerRegistration) -> dict[str, str]:
    """What the worker's instance records advertise besides the runtime's own fields
    (`address`, the advertised host, is one of those): the sockets named in
    `advertised_addresses`, as `tcp://<advertised host>:<port>`."""
    return dict(reg.advertised_addresses)


async def _stop_within(owner: Stoppable, timeout: float) -> None:
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
