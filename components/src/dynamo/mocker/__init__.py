"""The mocker: simulated engines with a vLLM worker's wire behaviour, for router and
scale tests (`python -m dynamo.mocker`, docs/mocker.md).

| module | job |
| --- | --- |
| `engine` | `MockEngine`: scheduling, step loop, slot accounting (pure asyncio) |
| `request` | one request: validation, limits, token stream, final output |
| `kv_cache` | `KvBlockPool`: blocks, prefix cache, LRU eviction, cache events |
| `acceptance`, `timing`, `tokens` | the speculative, step-time and token models |
| `config` | `MockEngineConfig` |
| `handoff`, `transfer` | disaggregated decode: a prefill worker's `disaggregated_params`, KV transfers in flight |
| `roles` | `--disaggregation-mode`: what a prefill / decode / aggregated worker registers as |
| `kv_events` | `KvEventForwarder`: engine events → the KV router's NATS stream |
| `backend` | `MockerBackend` (the engine glue) and `mocker_worker` (one simulated worker on NATS) |
| `args`, `main` | the command line, and the process (`dynamo.llm.worker.WorkerProcess`) |
| `metrics` | `MockerCollector`: the `/metrics` series of every simulated worker |

Only `kv_events`, `backend` and `main` touch NATS or HTTP; importing this package imports
neither.
"""

from dynamo.mocker.acceptance import AcceptanceModel
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.counters import EngineCounters
from dynamo.mocker.engine import MockEngine
from dynamo.mocker.kv_cache import KvBlockPool
from dynamo.mocker.request import InvalidRequest, RequestRejected
from dynamo.mocker.timing import TimingModel

__all__ = [
    "AcceptanceModel",
    "EngineCounters",
    "InvalidRequest",
    "KvBlockPool",
    "MockEngine",
    "MockEngineConfig",
    "RequestRejected",
    "TimingModel",
]
