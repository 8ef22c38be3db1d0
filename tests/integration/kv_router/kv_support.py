"""Building blocks for KV-router integration tests: a worker made of a real NATS runtime,
a served endpoint (so it is a live instance) and vLLM's real `ZmqEventPublisher` relayed
by the worker's own glue (`dynamo.vllm.serving.publishers`), no engine needed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from vllm.distributed import kv_events as vllm_kv

from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.kv_router.zmq_relay import KvEventRelay
from dynamo.llm.protocols import ModelCard
from dynamo.runtime import DistributedRuntime
from dynamo.testing.waiting import wait_until_async
from dynamo.vllm.serving.publishers import relay_kv_events

B = 4  # block size of the simulated engines (small keeps the token lists readable)
COMPONENT = "backend"
ENDPOINT = "generate"
LEASE_TTL = 1.0
EVENT_TIMEOUT_S = 10.0  # for an event to go through NATS and reach whoever awaits it


async def events_arrive(condition: Callable[[], bool], what: str) -> None:
    """Wait until `condition` holds, as long as an event may take through NATS
    (`EVENT_TIMEOUT_S`); `what` names the wait in the timeout's message."""
    await wait_until_async(condition, timeout=EVENT_TIMEOUT_S, what=what)


def new_namespace() -> str:
    return "kv" + uuid.uuid4().hex[:8]


def prompt(n_blocks: int, offset: int = 0) -> list[int]:
    """Tokens of `n_blocks` full blocks; different offsets give disjoint prompts."""
    return list(range(offset, offset + n_blocks * B))


async def _idle(request: Any, ctx: Any) -> AsyncIterator[dict[str, Any]]:
    yield {"ok": True}


class SimWorker:
    """A live endpoint instance whose KV events come from vLLM's real ZMQ publisher."""

    def __init__(self, runtime: DistributedRuntime, namespace: str, tmp: Path) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.component = runtime.namespace(namespace).component(COMPONENT)
        self.instance_id = runtime.instance_id
        tag = f"{self.instance_id:x}"
        self.endpoint = f"ipc://{tmp}/pub-{tag}"
        self.replay_endpoint = f"ipc://{tmp}/replay-{tag}"
        self.vllm = vllm_kv.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=self.endpoint, replay_endpoint=self.replay_endpoint
        )
        self.relay: KvEventRelay | None = None
        self._next_hash = 1
        self._step = 0
        self._left = False

    @classmethod
    async def start(cls, nats_url: str, namespace: str, tmp: Path) -> SimWorker:
        runtime = await DistributedRuntime.connect(nats_url, lease_ttl=LEASE_TTL)
        worker = cls(runtime, namespace, tmp)
        await worker.component.endpoint(ENDPOINT).serve(_idle)
        await worker.start_relay()
        return worker

    async def start_relay(self) -> KvEventRelay:
        """Relay vLLM's events to this worker's subject with the worker's own glue
        (`dynamo.vllm.serving.publishers.relay_kv_events`), as a vLLM worker does on start."""
        publisher = await KvEventPublisher(
            self.runtime, self.namespace, COMPONENT, self.instance_id
        ).start()
        self.relay = await relay_kv_events(publisher, B, self.endpoint, self.replay_endpoint)
        return self.relay

    def card(self) -> ModelCard:
        return ModelCard(
            name="sim",
            namespace=self.namespace,
            component=COMPONENT,
            endpoint=ENDPOINT,
            instance_id=self.instance_id,
            kv_block_size=B,
        )

    def store(self, tokens: list[int]) -> list[bytes]:
        """Publish one engine step storing every full block of `tokens`, named with fresh
        vLLM-style (opaque bytes) block hashes. Returns those hashes."""
        hashes = []
        for _ in range(len(tokens) // B):
            hashes.append(self._next_hash.to_bytes(32, "big"))
            self._next_hash += 1
        event = vllm_kv.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens[: len(hashes) * B],
            block_size=B,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        )
        self._publish([event])
        return hashes

    def remove(self, hashes: list[bytes]) -> None:
        self._publish([vllm_kv.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)])

    def _publish(self, events: list[Any]) -> None:
        self._step += 1
        self.vllm.publish(vllm_kv.KVEventBatch(ts=float(self._step), events=events))

    async def wait_relayed(self) -> None:
        """Until every event published so far (one per step, plus the relay's opening
        `AllBlocksCleared`) is acknowledged by the JetStream stream."""
        relay = self.relay
        assert relay is not None
        await events_arrive(
            lambda: relay.stats.events_out >= 1 + self._step,
            f"the relay of worker {self.instance_id:x} to publish {1 + self._step} events",
        )

    async def leave(self) -> None:
        """Deregister (as a worker shutting down does) and stop publishing (idempotent)."""
        if self._left:
            return
        self._left = True
        if self.relay is not None:
            await self.relay.stop()
            self.relay = None
        await self.runtime.shutdown(drain_timeout=1.0)
        self.vllm.shutdown()
