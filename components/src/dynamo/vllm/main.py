"""`python -m dynamo.vllm`: a vLLM engine with speculative decoding served over NATS.

Start-up order matters: the engine loads first (tens of seconds, in a thread, while
`/health` answers 503), then the worker connects to NATS, serves its endpoints, and only
then registers the model card and turns healthy, so a frontend never routes to a worker
that cannot answer. Shutdown runs the other way round: deregister (and answer 503), drain
in-flight requests (bounded by `--drain-timeout`), stop the engine.
Exit codes: 0 after a signal, 1 when the engine died (seen by a request or, when idle, by
a watchdog; so an orchestrator restarts it), 2 for bad configuration (ours or vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from dynamo.llm.protocols import ModelCard, WorkerType

log = logging.getLogger("dynamo.vllm")

_WORKER_TYPES = {
    "agg": WorkerType.AGGREGATED,
    "prefill": WorkerType.PREFILL,
    "decode": WorkerType.DECODE,
}
ENGINE_WATCH_INTERVAL_S = 1.0


class Worker:
    """One worker process: engine + runtime endpoints + model card + system server."""

    def __init__(self, cfg) -> None:  # cfg: dynamo.vllm.args.WorkerConfig
        from dynamo.vllm.engine import VllmEngine
        from dynamo.vllm.handlers import RequestCounters

        self.cfg = cfg
        self.worker_type = _WORKER_TYPES[cfg.disaggregation_mode]
        self.engine = VllmEngine(cfg.engine_args)
        self.counters = RequestCounters()
        self.runtime = None
        self.served: list = []
        self.card: ModelCard | None = None
        self.system = None
        self.kv_relay = None
        self.load_publisher = None
        self.kv_janitor = None
        self._stop = asyncio.Event()
        self.exit_code = 0

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self, exit_code: int = 0, reason: str = "") -> None:
        if not self._stop.is_set():
            log.info("stopping%s", f": {reason}" if reason else "")
            self.exit_code = exit_code
            self._stop.set()

    def _on_engine_dead(self, exc: BaseException) -> None:
        self.request_stop(1, f"engine dead ({exc})")

    def health(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "shutting down"
        if not self.engine.is_ready:
            return False, "engine not ready"
        if self.runtime is None or not self.runtime.is_connected:
            return False, "not connected to NATS"
        if self.card is None:
            return False, "not registered"
        return True, "ready"

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, 0, signal.Signals(sig).name)
        watchdog: asyncio.Task | None = None
        try:
            await self._start_system_server()
            await self._start_engine()
            if self._stop.is_set():
                return self.exit_code
            await self._start_serving()
            watchdog = asyncio.create_task(self._watch_engine(), name="engine-watchdog")
            await self._stop.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._shutdown()
        return self.exit_code

    async def _start_engine(self) -> None:
        """Start the engine in a thread: loading takes tens of seconds, and meanwhile the
        event loop keeps answering `/health` (503) and handling SIGTERM. A stop requested
        during loading takes effect once `start()` returns (a load cannot be interrupted)."""
        from dynamo.vllm.spec_config import ConfigError

        try:
            await asyncio.to_thread(self.engine.start)
        except ConfigError:
            self.exit_code = 2
            raise
        self.engine.attach_to_running_loop()

    async def _watch_engine(self, interval_s: float = ENGINE_WATCH_INTERVAL_S) -> None:
        """Stop with exit code 1 when the engine core dies while no request is running (a
        request that meets the dead engine stops the worker through the handler): an idle
        worker must not stay registered with nothing behind it."""
        while not self._stop.is_set():
            if self.engine.is_dead:
                self.request_stop(1, "engine dead (the vLLM engine core exited)")
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval_s)

    async def _start_system_server(self) -> None:
        if self.cfg.system_port is None:  # disabled; 0 picks a free port
            return
        from prometheus_client import REGISTRY

        from dynamo.runtime.system_server import SystemServer
        from dynamo.vllm.system_server import WorkerCollector

        # vLLM's own series live in the process-global registry; ours join them there.
        REGISTRY.register(
            WorkerCollector(
                self.engine.stats,
                self.counters,
                {"model": self.cfg.served_model_name, "worker_type": self.worker_type.value},
            )
        )
        self.system = SystemServer("0.0.0.0", self.cfg.system_port, self._health_fields, REGISTRY)
        await self.system.start()

    def _health_fields(self) -> tuple[bool, dict[str, str]]:
        ok, detail = self.health()
        return ok, {"detail": detail}

    async def _start_serving(self) -> None:
        from dynamo.llm.model_card import publish_model_card
        from dynamo.llm.protocols import PreprocessedRequest
        from dynamo.runtime import DistributedRuntime
        from dynamo.vllm.handlers import ClearKvBlocksHandler, GenerateHandler

        cfg = self.cfg
        self.runtime = await DistributedRuntime.connect(
            cfg.nats_server, lease_ttl=cfg.lease_ttl, name="vllm-worker", wait_for_server=30
        )
        component = self.runtime.namespace(cfg.namespace).component(cfg.component)
        self.kv_janitor = self._kv_janitor()
        generate = GenerateHandler(
            self.engine,
            self.worker_type,
            on_engine_dead=self._on_engine_dead,
            counters=self.counters,
            kv_janitor=self.kv_janitor,
        )
        clear = ClearKvBlocksHandler(
            self.engine, self.runtime.instance_id, on_cleared=self._announce_kv_cleared
        )
        self.served.append(
            await component.endpoint(cfg.endpoint).serve(
                generate.generate, request_type=PreprocessedRequest
            )
        )
        self.served.append(await component.endpoint("clear_kv_blocks").serve(clear.clear))
        await self._start_kv_plumbing(component)
        card = self._model_card()
        await publish_model_card(self.runtime, card, Path(cfg.model_path))
        self.card = card  # only now is the worker healthy (see `health`)
        log.info(
            "serving %s as %s worker %x on %s/%s/%s",
            self.card.name,
            self.worker_type.value,
            self.runtime.instance_id,
            cfg.namespace,
            cfg.component,
            cfg.endpoint,
        )

    async def _announce_kv_cleared(self) -> None:
        if self.kv_relay is not None:
            await self.kv_relay.announce_cleared()

    def _kv_janitor(self):
        """Bounds the disk used by the CPU KV connector (None for other connectors)."""
        from dynamo.vllm.kv_transfer import (
            KvTransferJanitor,
            default_ttl,
            example_connector_storage,
        )

        storage = example_connector_storage(self.cfg.engine_args.kv_transfer_config)
        if storage is None or self.engine.facts is None:
            return None
        janitor = KvTransferJanitor(storage, self.engine.facts.block_size, ttl_s=default_ttl())
        janitor.start()
        log.info(
            "KV transfer directory %s: consumed entries deleted, others after %.0fs",
            storage,
            janitor.ttl_s,
        )
        return janitor

    async def _start_kv_plumbing(self, component) -> None:
        """KV events relay and load metrics publisher (present when the KV router lands)."""
        try:
            from dynamo.vllm.publishers import start_kv_publishers
        except ImportError:
            return
        self.kv_relay, self.load_publisher = await start_kv_publishers(self, component)

    def _model_card(self) -> ModelCard:
        facts = self.engine.facts
        assert facts is not None and self.runtime is not None
        eos = self._eos_token_ids()
        return ModelCard(
            name=self.cfg.served_model_name,
            namespace=self.cfg.namespace,
            component=self.cfg.component,
            endpoint=self.cfg.endpoint,
            instance_id=self.runtime.instance_id,
            worker_type=self.worker_type,
            source_path=str(self.cfg.model_path),
            context_length=facts.max_model_len,
            kv_block_size=facts.block_size,
            total_kv_blocks=facts.num_gpu_blocks,
            max_num_seqs=facts.max_num_seqs,
            eos_token_ids=eos,
            speculative=facts.speculative,
            system_port=self.system.port if self.system else None,
            migration_limit=self.cfg.migration_limit,
        )

    def _eos_token_ids(self) -> list[int]:
        try:
            gen = self.engine.engine.model_config.try_get_generation_config() or {}
            eos = gen.get("eos_token_id")
        except Exception:
            eos = None
        if eos is None:
            eos = self.engine.engine.model_config.hf_config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    async def _shutdown(self) -> None:
        """Deregister first so no new work arrives, drain, then stop the engine.

        The KV relay and load publisher stop before the NATS connection closes: the worker
        is leaving, and routers drop its blocks when its lease goes anyway."""
        for owner in (self.kv_relay, self.load_publisher, self.kv_janitor):
            if owner is not None:
                with contextlib.suppress(Exception):
                    await owner.stop()
        if self.runtime is not None:
            try:
                if self.card is not None:
                    from dynamo.llm.model_card import MODELS_BUCKET, card_key

                    await self.runtime.delete_leased(MODELS_BUCKET, card_key(self.card))
                await self.runtime.shutdown(drain_timeout=self.cfg.drain_timeout_s)
            except Exception as exc:
                log.warning("runtime shutdown: %s", exc)
        if self.system is not None:
            await self.system.stop()
        self.engine.shutdown()
        _remove_ipc_sockets(self.cfg.kv_events_endpoint, self.cfg.kv_events_replay_endpoint)
        log.info("worker stopped (exit code %d)", self.exit_code)


def _remove_ipc_sockets(*endpoints: str | None) -> None:
    """Delete the Unix socket files of ipc:// KV-event endpoints (vLLM leaves them)."""
    for endpoint in endpoints:
        if endpoint and endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(endpoint[len("ipc://") :])


def main(argv: list[str] | None = None) -> int:
    from dynamo.vllm.args import (
        ConfigError,
        parse_worker_args,
        resolved_config_lines,
        resolved_config_yaml,
    )

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = parse_worker_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        sys.stdout.write(resolved_config_yaml(cfg))
        return 0
    # Counters' `_created` timestamps are noise on /metrics (one extra series per counter).
    import prometheus_client

    prometheus_client.disable_created_metrics()
    for line in resolved_config_lines(cfg):
        log.info("config: %s", line)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        return asyncio.run(Worker(cfg).run())
    except ConfigError as exc:  # vLLM refused the configuration before loading anything
        print(f"error: {exc}", file=sys.stderr)
        return 2
