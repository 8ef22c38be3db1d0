"""The frontend process logic against a real nats-server: a worker registers a model card
(tokenizer files through the object store), the frontend discovers it, serves OpenAI
requests over the runtime, cancels on client disconnect, and forgets the model when the
card goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai

from dynamo.frontend.engine.routing import RouterMode
from dynamo.frontend.preprocess.tokenizer_setup import load_tokenizer
from dynamo.llm.model_card import publish_model_card, remove_model_card
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
)
from dynamo.runtime import DistributedRuntime
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.waiting import wait_until_async

MODEL = "smollm2-nats"
REPLY = "Hello from a worker over NATS."
POLL_S = 0.1


class Worker:
    """A scripted worker: real token ids for REPLY, one per step, EOS at the end."""

    def __init__(self, tokenizer: Any, delay: float = 0.0) -> None:
        self.ids = tokenizer.backend_tokenizer.encode(REPLY, add_special_tokens=False).ids
        self.delay = delay
        self.requests: list[PreprocessedRequest] = []
        self.stopped: list[str] = []

    async def generate(
        self, request: PreprocessedRequest, ctx: Any
    ) -> AsyncIterator[LLMEngineOutput]:
        self.requests.append(request)
        ids = [*self.ids, 2] if not self.delay else self.ids * 500
        try:
            for i, token in enumerate(ids):
                if ctx.is_stopped():
                    self.stopped.append(request.request_id)
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
                out = LLMEngineOutput(token_ids=[token])
                if i == len(ids) - 1:
                    out.finish_reason = FinishReason.EOS
                    out.completion_usage = CompletionUsage(
                        prompt_tokens=len(request.token_ids),
                        completion_tokens=len(ids),
                        total_tokens=len(request.token_ids) + len(ids),
                    )
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            self.stopped.append(request.request_id)
            raise


async def test_frontend_serves_a_worker_discovered_over_nats(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(embedded_model)
    worker_rt = await DistributedRuntime.connect(nats_url, lease_ttl=2.0)
    frontend = InLoopFrontend.start(
        nats_url, "fe-test", tmp_path / "tok", router_mode=RouterMode.ROUND_ROBIN
    )
    served = None
    try:
        worker = Worker(tokenizer)
        endpoint = worker_rt.namespace("fe-test").component("backend").endpoint("generate")
        served = await endpoint.serve(worker.generate, request_type=PreprocessedRequest)
        card = ModelCard(
            name=MODEL,
            namespace="fe-test",
            component="backend",
            endpoint="generate",
            instance_id=served.instance_id,
            context_length=512,
            kv_block_size=32,
            eos_token_ids=[2],
        )
        card = await publish_model_card(worker_rt, card, embedded_model)

        async with openai.AsyncOpenAI(
            base_url=f"{frontend.base_url}/v1", api_key="x", max_retries=0
        ) as client:

            async def listed() -> bool:
                try:
                    return [m.id async for m in client.models.list()] == [MODEL]
                except openai.APIConnectionError:
                    return False

            await wait_until_async(
                listed, timeout=15, interval=POLL_S, what=f"the frontend to list only {MODEL}"
            )
            assert (tmp_path / "tok" / card.tokenizer_digest / "tokenizer.json").is_file()

            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}]
            )
            assert chat.choices[0].message.content == REPLY
            assert chat.choices[0].finish_reason == "stop"
            assert chat.usage is not None and chat.usage.completion_tokens == len(worker.ids) + 1
            sent = tokenizer.decode(worker.requests[-1].token_ids)
            assert sent.endswith("<|im_start|>assistant\n")

            stream = await client.completions.create(
                model=MODEL, prompt="Say hi", stream=True, stream_options={"include_usage": True}
            )
            texts = []
            async for chunk in stream:
                texts.extend(c.text for c in chunk.choices)
            assert "".join(texts) == REPLY

            # A client that goes away mid-stream cancels the request on the worker.
            worker.delay = 0.02
            stream = await client.completions.create(model=MODEL, prompt="Long", stream=True)
            async for _ in stream:
                break
            await stream.close()
            rid = worker.requests[-1].request_id

            async def worker_stopped() -> bool:
                return rid in worker.stopped

            await wait_until_async(
                worker_stopped,
                timeout=10,
                interval=POLL_S,
                what="the worker to see the abandoned stream cancelled",
            )

            # The card goes away with the worker: the model disappears.
            await remove_model_card(worker_rt, card)

            async def unlisted() -> bool:
                return [m.id async for m in client.models.list()] == []

            await wait_until_async(
                unlisted, timeout=15, interval=POLL_S, what="the frontend to forget the model"
            )
    finally:
        await frontend.stop()
        if served is not None:
            await served.stop(drain_timeout=1.0)
        await worker_rt.shutdown()
