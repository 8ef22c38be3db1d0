"""A scripted worker process for the migration and stream-fault tests.

    python migration_worker.py NATS_URL NAMESPACE MODEL_DIR PROMPT_LEN
        [--model NAME] [--stall-after N] [--drop-card-after N] [--migration-limit N]

Serves `generate` for model NAME (default `migrate-test`; its card advertises the
migration limit, default 1). For a request whose context holds `PROMPT_LEN + k` tokens it
streams the script from position k, so a request resumed elsewhere with the generated
tokens appended continues the same text.

`--stall-after N`: a request starting at script position 0 sends N tokens and then goes
silent while the process keeps heartbeating (a hung engine); a continuation (a migrated
request) is served normally. `--drop-card-after N`: after N tokens of a fresh request the
worker removes its model card (as a draining worker does first) and streams on, so a test
controls that the card goes before the instance. Announces on `test.<ns>.serving` every request it starts and
on `test.<ns>.cancelled` every request cancelled in flight (payload: its instance id).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from dynamo.llm.model_card import publish_model_card, remove_model_card
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("nats_url")
    parser.add_argument("namespace")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("prompt_len", type=int)
    parser.add_argument("--model", default=MODEL, help="Served model name.")
    parser.add_argument(
        "--stall-after", type=int, default=None, help="Go silent after this many tokens."
    )
    parser.add_argument(
        "--drop-card-after", type=int, default=None, help="Remove the card after this many tokens."
    )
    parser.add_argument("--migration-limit", type=int, default=1, help="Advertised on the card.")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    namespace, prompt_len = args.namespace, args.prompt_len
    # A short lease, so the SIGKILLed worker is noticed in seconds; not shorter, so a
    # heartbeat delayed on a loaded test machine does not expire a live worker.
    runtime = await DistributedRuntime.connect(
        args.nats_url, lease_ttl=2.0, name="migration-worker"
    )
    me = str(runtime.instance_id).encode()
    cards: list[ModelCard] = []  # this worker's card, once published
    announcements: set[asyncio.Task[None]] = set()

    def announce(subject: str) -> None:
        task = asyncio.ensure_future(runtime.publish(f"test.{namespace}.{subject}", me))
        announcements.add(task)
        task.add_done_callback(announcements.discard)

    async def generate(request: PreprocessedRequest, ctx):
        announce("serving")
        start = len(request.token_ids) - prompt_len
        count = request.stop_conditions.max_tokens or 10
        finished = False
        try:
            for i in range(count):
                if start == 0 and i == args.stall_after:
                    await asyncio.Event().wait()  # silent, lease still heartbeating
                if start == 0 and i == args.drop_card_after and cards:
                    await remove_model_card(runtime, cards.pop())
                await asyncio.sleep(STEP_S)
                out = LLMEngineOutput(token_ids=[SCRIPT[start + i]])
                if i == count - 1:
                    out.finish_reason = FinishReason.LENGTH
                    out.completion_usage = CompletionUsage(
                        prompt_tokens=len(request.token_ids), completion_tokens=count,
                        total_tokens=len(request.token_ids) + count,
                    )  # fmt: skip
                yield out
            finished = True
        finally:
            if not finished:
                announce("cancelled")

    endpoint = runtime.namespace(namespace).component("backend").endpoint("generate")
    served = await endpoint.serve(generate, request_type=PreprocessedRequest)
    card = ModelCard(
        name=args.model, namespace=namespace, component="backend", endpoint="generate",
        instance_id=served.instance_id, context_length=4096, kv_block_size=32,
        migration_limit=args.migration_limit,
    )  # fmt: skip
    await publish_model_card(runtime, card, args.model_dir)
    cards.append(card)
    print("READY", runtime.instance_id, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
