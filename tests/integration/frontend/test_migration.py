"""Request migration: a worker SIGKILLed mid-stream is survived when the model allows it.

Two scripted worker processes serve a model whose card advertises `migration_limit=1`.
A streaming completion starts on one; that process is killed; the frontend notices the
instance gone (lease expiry), resends prompt + generated tokens to the other worker, and
the client receives one uninterrupted, correct token sequence.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.service import FrontendConfig, run_frontend
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.ports import free_port
from dynamo.testing.http import wait_for_instances_async

WORKER = Path(__file__).with_name("migration_worker.py")
NAMESPACE = "migrate"
PROMPT = list(range(200, 216))  # token ids
MAX_TOKENS = 40


def start_worker(nats_url: str, model_dir: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), nats_url, NAMESPACE, str(model_dir), str(len(PROMPT))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc, int(line.split()[1])


@pytest.fixture
def model_dir() -> Path:
    from dynamo.llm.models import resolve_model

    return Path(resolve_model("smollm2-135m-instruct"))


async def test_stream_survives_a_killed_worker(
    nats_url: str, model_dir: Path, tmp_path: Path
) -> None:
    workers = [start_worker(nats_url, model_dir) for _ in range(2)]
    watcher = await DistributedRuntime.connect(nats_url, name="migration-test")
    serving: asyncio.Queue[int] = asyncio.Queue()

    async def on_serving(msg) -> None:
        serving.put_nowait(int(msg.data))

    await watcher.subscribe(f"test.{NAMESPACE}.serving", on_serving)
    port = free_port()
    config = FrontendConfig(
        http=HttpSettings(host="127.0.0.1", port=port),
        namespace=NAMESPACE,
        nats_server=nats_url,
        tokenizer_cache=tmp_path / "tok",
    )
    stop = asyncio.Event()
    frontend = asyncio.create_task(run_frontend(config, stop))
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
    )
    try:
        # Both workers listed: the stream must have another one to move to (on a busy
        # machine the tokenizer download and the cards take seconds).
        await wait_for_instances_async(f"http://127.0.0.1:{port}", "migrate-test", 2, timeout=60)
        stream = await client.completions.create(
            model="migrate-test", prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, logprobs=None,
        )  # fmt: skip
        first_worker = await asyncio.wait_for(serving.get(), 10)
        victim = next(proc for proc, iid in workers if iid == first_worker)
        texts, usage, killed = [], None, False
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                if len(texts) == 5 and not killed:
                    os.kill(victim.pid, signal.SIGKILL)
                    killed = True
            if chunk.usage:
                usage = chunk.usage
        second_worker = await asyncio.wait_for(serving.get(), 1)
        assert second_worker != first_worker
        # One uninterrupted sequence: the script's first MAX_TOKENS tokens, decoded.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        expected = tokenizer.decode(list(range(1000, 1000 + MAX_TOKENS)))
        assert "".join(texts) == expected
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), MAX_TOKENS)
    finally:
        stop.set()
        await asyncio.wait_for(frontend, 15)
        await watcher.shutdown()
        for proc, _ in workers:
            proc.kill()
            proc.wait(5)
