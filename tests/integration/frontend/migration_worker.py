"""A scripted worker process for the migration test.

    python migration_worker.py NATS_URL NAMESPACE MODEL_DIR PROMPT_LEN

Serves `generate` for model `migrate-test` (card advertises migration_limit=1). For a
request whose context holds `PROMPT_LEN + k` tokens it streams the script from position k,
so a request resumed elsewhere with the generated tokens appended continues the same text.
Announces every request it starts on `test.<ns>.serving` (payload: its instance id).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dynamo.llm.model_card import publish_model_card
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
)
from dynamo.runtime import DistributedRuntime

MODEL = "migrate-test"
SCRIPT = list(range(1000, 1100))  # token ids the "model" produces, in order
STEP_S = 0.05


async def main(url: str, namespace: str, model_dir: str, prompt_len: int) -> None:
    # A short lease, so the SIGKILLed worker is noticed in seconds; not shorter, so a
    # heartbeat delayed on a loaded test machine does not expire a live worker.
    runtime = await DistributedRuntime.connect(url, lease_ttl=2.0, name="migration-worker")

    async def generate(request: PreprocessedRequest, ctx):
        await runtime.publish(f"test.{namespace}.serving", str(runtime.instance_id).encode())
        start = len(request.token_ids) - prompt_len
        count = request.stop_conditions.max_tokens or 10
        for i in range(count):
            await asyncio.sleep(STEP_S)
            out = LLMEngineOutput(token_ids=[SCRIPT[start + i]])
            if i == count - 1:
                out.finish_reason = FinishReason.LENGTH
                out.completion_usage = CompletionUsage(
                    prompt_tokens=len(request.token_ids), completion_tokens=count,
                    total_tokens=len(request.token_ids) + count,
                )  # fmt: skip
            yield out

    endpoint = runtime.namespace(namespace).component("backend").endpoint("generate")
    served = await endpoint.serve(generate, request_type=PreprocessedRequest)
    card = ModelCard(
        name=MODEL, namespace=namespace, component="backend", endpoint="generate",
        instance_id=served.instance_id, context_length=4096, kv_block_size=32, migration_limit=1,
    )  # fmt: skip
    await publish_model_card(runtime, card, Path(model_dir))
    print("READY", runtime.instance_id, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
