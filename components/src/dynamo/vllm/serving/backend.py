"""`VllmBackend`: the vLLM engine behind `dynamo.llm.worker`'s `EngineBackend` seam.

It loads the `AsyncLLM` (in a thread: tens of seconds on CPU, while the event loop keeps
answering `/health` with 503 and handling signals), serves `generate` through
`GenerateHandler`, relays vLLM's KV events, reports load from the engine's stats, bounds
the CPU KV connector's transfer directory, and shuts the engine down. Registration,
publishers, the model card, the system server and exit codes are `dynamo.llm.worker`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable

from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.kv_router.zmq_relay import KvEventRelay
from dynamo.llm.protocols import LLMEngineOutput, LoadMetrics, PreprocessedRequest, WorkerType
from dynamo.llm.worker import EngineDescription
from dynamo.llm.worker.roles import WORKER_TYPES
from dynamo.runtime import Context
from dynamo.vllm.config.args import VllmWorkerConfig
from dynamo.vllm.config.sampling_defaults import sampling_defaults_from
from dynamo.vllm.kv_transfer.janitor import KvTransferJanitor, default_ttl, disk_connector_storage
from dynamo.vllm.kv_transfer.storage_check import SharedStorageCheck, StorageProbeFile
from dynamo.vllm.serving.engine import EngineFacts, VllmEngine
from dynamo.vllm.serving.handlers import GenerateHandler, RequestCounters
from dynamo.vllm.serving.publishers import engine_load, relay_kv_events
from dynamo.vllm.speculative.adaptive_k import adaptive_entry, state_path_of
from dynamo.vllm.speculative.k_in_force import SpeculationSnapshot, SpeculationStateReader
from dynamo.vllm.speculative.monitor import SpeculationMonitor

log = logging.getLogger(__name__)


class VllmBackend:
    """One vLLM engine, configured by the worker's command line."""

    def __init__(self, cfg: VllmWorkerConfig) -> None:
        self.cfg = cfg
        self.worker_type = WORKER_TYPES[cfg.disaggregation_mode]
        self.engine = VllmEngine(cfg.engine_args)
        self.counters = RequestCounters()
        self._handler: GenerateHandler | None = None
        self._relay: KvEventRelay | None = None
        self._janitor: KvTransferJanitor | None = None
        self._probe: StorageProbeFile | None = None
        self._storage_check: SharedStorageCheck | None = None
        self._loading: asyncio.Future[EngineFacts] | None = None
        self._dead: str | None = None
        self._spec_state: SpeculationStateReader | None = None
        self.spec_monitor: SpeculationMonitor | None = None
        """K in force and acceptance against --speculation-profile; set once the engine
        runs (its resolved speculative config decides K)."""

    # ------------------------------------------------------------------ EngineBackend

    async def start(self) -> EngineDescription:
        """Load the engine. A stop requested meanwhile waits for the load to finish (it
        cannot be interrupted), then shuts the engine down (see `stop`)."""
        self._loading = asyncio.ensure_future(asyncio.to_thread(self.engine.start))
        facts = await asyncio.shield(self._loading)
        self.engine.attach_to_running_loop()
        adaptive = adaptive_entry(self.cfg.engine_args.additional_config)
        if adaptive is not None:
            self._spec_state = SpeculationStateReader(state_path_of(adaptive))
        self.spec_monitor = SpeculationMonitor.for_engine(
            self.cfg.speculation_profile, facts.speculative, adapted=self._adapted
        )
        self._janitor = self._start_kv_janitor(facts)
        self._handler = GenerateHandler(
            self.engine,
            self.worker_type,
            on_engine_dead=self._on_engine_dead,
            counters=self.counters,
            kv_janitor=self._janitor,
            kv_probe=self._probe.probe if self._probe else None,
            storage_check=self._storage_check,
        )
        return EngineDescription(
            context_length=facts.max_model_len,
            kv_block_size=facts.block_size,
            total_kv_blocks=facts.num_gpu_blocks,
            max_num_seqs=facts.max_num_seqs,
            eos_token_ids=self._eos_token_ids(),
            speculative=facts.speculative,
            sampling_defaults=sampling_defaults_from(facts.sampling_defaults),
            kv_storage=self._probe.probe if self._probe else None,
        )

    def is_ready(self) -> bool:
        return self.engine.is_ready

    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        if self.engine.is_dead:
            return "the vLLM engine core exited"
        return None

    def generate(
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if self._handler is None:
            raise RuntimeError("generate served before the engine started")
        return self._handler.generate(request, context)

    async def clear_kv_blocks(self) -> bool:
        ok = await self.engine.clear_kv_blocks()
        if ok and self._relay is not None:
            # vLLM sends its "all blocks cleared" event only with the next engine step,
            # which an idle engine never takes: the relay announces it at once instead.
            await self._relay.announce_cleared()
        return ok

    def load_metrics(self, worker_id: int) -> LoadMetrics:
        facts = self.engine.facts
        monitor = self.observe_speculation()
        return engine_load(
            worker_id,
            self.engine.stats,
            facts.num_gpu_blocks if facts else 0,
            monitor.k_in_force if monitor is not None and facts and facts.speculative else None,
        )

    def watch_load(self, changed: Callable[[], None]) -> None:
        self.engine.stats.watch(changed)

    def observe_speculation(self) -> SpeculationMonitor | None:
        """Feed the engine's latest batch size and counters to the monitor (at every load
        report and scrape, so its K and windows follow the engine without a timer)."""
        monitor = self.spec_monitor
        if monitor is not None:
            stats = self.engine.stats
            monitor.observe(stats.snapshot.running, stats.spec)
        return monitor

    async def start_kv_events(self, publisher: KvEventPublisher) -> KvEventRelay | None:
        endpoint = self.cfg.kv_events_endpoint
        facts = self.engine.facts
        if not endpoint or facts is None:
            return None
        self._relay = await relay_kv_events(
            publisher, facts.block_size, endpoint, self.cfg.kv_events_replay_endpoint
        )
        return self._relay

    async def stop(self) -> None:
        if self._loading is not None and not self._loading.done():
            log.info("waiting for the engine to finish loading before shutting it down")
            with contextlib.suppress(Exception):
                await self._loading
        if self._janitor is not None:
            with contextlib.suppress(Exception):
                await self._janitor.stop()
        if self._probe is not None:
            self._probe.remove()
        self.engine.shutdown()
        if self._spec_state is not None:
            self._spec_state.close(remove=True)
        _remove_ipc_sockets(self.cfg.kv_events_endpoint, self.cfg.kv_events_replay_endpoint)

    # ------------------------------------------------------------------ internals

    def _adapted(self) -> SpeculationSnapshot | None:
        """What the adaptive scheduler chose (None: not adaptive, or no decoding step
        yet)."""
        return self._spec_state.read() if self._spec_state is not None else None

    def _on_engine_dead(self, exc: BaseException) -> None:
        """A request met the dead engine: the process stops at the next watchdog tick."""
        self._dead = f"a request met a dead engine: {exc}"

    def _start_kv_janitor(self, facts: EngineFacts) -> KvTransferJanitor | None:
        """Bounds the disk used by the CPU KV connector (None for other connectors)."""
        storage = disk_connector_storage(self.cfg.engine_args.kv_transfer_config)
        if storage is None:
            return None
        janitor = KvTransferJanitor(storage, facts.block_size, ttl_s=default_ttl())
        # Prefill: a probe file decode workers look for under their own path; decode:
        # the check that looks (see dynamo.vllm.kv_transfer.storage_check).
        if self.worker_type is WorkerType.PREFILL:
            self._probe = janitor.probe = StorageProbeFile.create(storage, self.cfg.advertise_host)
        else:
            self._storage_check = SharedStorageCheck(storage, self.cfg.advertise_host)
        janitor.start()
        log.info(
            "KV transfer directory %s: consumed entries deleted, others after %.0fs",
            storage,
            janitor.ttl_s,
        )
        return janitor

    def _eos_token_ids(self) -> list[int]:
        model_config = self.engine.engine.model_config
        try:
            eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
        except Exception:  # a broken generation_config.json must not stop the worker
            eos = None
        if eos is None:
            eos = model_config.hf_config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _remove_ipc_sockets(*endpoints: str | None) -> None:
    """Delete the Unix socket files of ipc:// KV-event endpoints (vLLM leaves them)."""
    for endpoint in endpoints:
        if endpoint and endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(endpoint[len("ipc://") :])
