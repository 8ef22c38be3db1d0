"""`dynamo.llm.worker`: everything a worker process does besides running its engine.

A backend (the vLLM worker, the mocker, a third engine) implements `EngineBackend`: load
the engine, generate, clear the prefix cache, report load, hand over KV-cache events,
stop. The rest is written once here:

* `ServedWorker`: one registered worker: NATS connection, the `generate` and
  `clear_kv_blocks` endpoints, KV-event and load publishers, the model card (published
  last, so a frontend never sees a worker it cannot reach), and the reverse order on stop;
* `WorkerProcess`: one process of one or more served workers: signals, the system server
  (`/health`, `/live`, `/metrics`), an engine watchdog, ordered shutdown and exit codes
  (0 after a signal, 1 when a worker failed to start or an engine died, 2 for a
  configuration the engine refused).
"""

from dynamo.llm.worker.backend import (
    CLEAR_KV_BLOCKS_ENDPOINT,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MIGRATION_LIMIT,
    EngineBackend,
    EngineDescription,
    Stoppable,
    WorkerRegistration,
)
from dynamo.llm.worker.process import WorkerProcess, workers_health
from dynamo.llm.worker.served import ServedWorker

__all__ = [
    "CLEAR_KV_BLOCKS_ENDPOINT",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_MIGRATION_LIMIT",
    "EngineBackend",
    "EngineDescription",
    "ServedWorker",
    "Stoppable",
    "WorkerProcess",
    "WorkerRegistration",
    "workers_health",
]
