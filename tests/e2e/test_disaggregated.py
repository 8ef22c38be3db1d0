"""Disaggregated prefill/decode with real vLLM engines and a real KV transfer.

Two prefill workers and a decode worker (n-gram speculation) share a KV-transfer directory
(vLLM's ExampleConnector, the CPU connector); a frontend in kv mode sends each request to
a prefill worker first (chosen by cache overlap), then to the decode worker with the
prefill's result.

Claims: the decode worker loads the prompt's KV through the connector instead of
recomputing it; greedy output equals an aggregated worker's with the same speculative
config and the same prompt split (cached whole blocks + computed tail), so only the
transfer can make them differ, not bf16 rounding of differently shaped work; the transfer
directory is emptied as entries are consumed and orphaned entries expire; a request
sharing a long prefix with an earlier one is prefilled on the prefill worker that caches
it; a disaggregated request gets its `prompt_logprobs`; each prefill worker's probe of its transfer directory is found by the decode side's
shared-directory check (and would be refused from another directory); an entry that
breaks between an engine's match and its load is recomputed, not fatal; when the prefill
workers are killed, requests still succeed (decode prefills itself) and the fallback
counter says so. The module's main frontend sends every prompt to a prefill worker
(`--disagg-prefill remote`); a second one, on the default conditional policy, keeps a short
prompt and a prompt the decode worker caches on the decode worker and sends a long one to
a prefill worker.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_prompts import chat_ids, greedy_request

from dynamo.llm.model_card import ModelCardWatcher
from dynamo.llm.models import DEFAULT_MODEL
from dynamo.llm.protocols import (
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
    StopConditions,
    WorkerType,
)
from dynamo.runtime import DistributedRuntime
from dynamo.testing.http import (
    http_get,
    http_post_json,
    kv_router_views,
    routed_one_more,
    routed_totals,
    wait_prefix_indexed,
)
from dynamo.testing.processes import FrontendProcess, WorkerProcess, stop_all
from dynamo.testing.waiting import wait_until, wait_until_async
from dynamo.vllm.kv_transfer.janitor import entry_name, transferred_tokens
from dynamo.vllm.kv_transfer.storage_check import (
    PROBE_PREFIX,
    KvStorageNotSharedError,
    SharedStorageCheck,
)
from dynamo.vllm.kv_transfer.transfer_root import TransferRoot

NAMESPACE = "disagg"
PREFILL_ENDPOINT = f"{NAMESPACE}/prefill/generate"
POLL_S = 0.25
TRANSFER_TTL_S = 4
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
TOPICS = [
    "the Roman Empire",
    "the water cycle",
    "how bridges carry loads",
    "the history of printing",
]


def long_prompt(topic: str) -> str:
    """A prompt well over two KV blocks (32 tokens each), unique per test run."""
    return (
        f"[{uuid.uuid4().hex[:8]}] Explain {topic} to a curious student. Cover the main ideas, "
        "the key terms, two concrete examples, one common misconception and why it is wrong, "
        "and finish with a one-sentence summary. Keep the answer short and clear."
    )


@pytest.fixture(scope="module")
def transfer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Not created here: the workers create (and so own) it; see dynamo.vllm.kv_transfer.transfer_root.
    return tmp_path_factory.mktemp("kv-transfer") / "store"


@pytest.fixture(scope="module")
def disagg(
    embedded_model: Path, nats_url: str, e2e_log_dir: Path, transfer_dir: Path
) -> Iterator[dict[str, object]]:
    saved = {k: os.environ.get(k) for k in ("DYN_KV_SHARED_STORAGE_PATH", "DYN_KV_TRANSFER_TTL")}
    os.environ["DYN_KV_SHARED_STORAGE_PATH"] = str(transfer_dir)
    os.environ["DYN_KV_TRANSFER_TTL"] = str(TRANSFER_TTL_S)
    prefills: list[WorkerProcess] = []
    procs: dict[str, object] = {"prefill": prefills}
    workers: list[WorkerProcess] = []  # started ones, stopped side by side
    try:
        for i in range(2):
            prefills.append(WorkerProcess(
                f"disagg-prefill-{i}", embedded_model, nats_url, e2e_log_dir,
                namespace=NAMESPACE, component="prefill", extra=["--is-prefill-worker"],
            ))  # fmt: skip
        workers.extend(prefills)
        decode = procs["decode"] = WorkerProcess(
            "disagg-decode", embedded_model, nats_url, e2e_log_dir, namespace=NAMESPACE,
            component="backend", extra=["--is-decode-worker", "--speculative-config", json.dumps(NGRAM)],
        )  # fmt: skip
        workers.append(decode)
        for worker in workers:
            worker.wait_ready()
        frontend = procs["frontend"] = FrontendProcess(
            "disagg-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE,
            extra=["--router-mode", "kv", "--disagg-prefill", "remote"],
        )  # fmt: skip
        conditional = procs["conditional"] = FrontendProcess(
            "disagg-conditional-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE,
            extra=["--router-mode", "kv"],  # --disagg-prefill conditional, the default
        )  # fmt: skip
        for proc in (frontend, conditional):
            proc.wait_for_model(DEFAULT_MODEL)
            proc.wait_kv_router_workers(DEFAULT_MODEL, PREFILL_ENDPOINT, 2)
        yield procs
    finally:
        for name in ("frontend", "conditional"):
            proc = procs.get(name)
            if isinstance(proc, FrontendProcess):
                proc.stop()  # first, so the workers drain nothing new
        stop_all(workers)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def chat(frontend: FrontendProcess, prompt: str, max_tokens: int = 32) -> dict:
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    status, text = http_post_json(f"{frontend.base_url}/v1/chat/completions", body, timeout=120)
    assert status == 200, text
    return json.loads(text)


def prefill_routers(frontend: FrontendProcess) -> list[dict[str, Any]]:
    """The frontend's KV router for the prefill workers (`GET /debug/kv`), one per
    frontend process (N with `--http-workers N`)."""
    return kv_router_views(frontend.base_url, DEFAULT_MODEL, PREFILL_ENDPOINT)


def prefill_routed(frontend: FrontendProcess) -> dict[str, int]:
    """Prefill legs the routers sent to each prefill worker so far."""
    return routed_totals(prefill_routers(frontend))


def prefill_indexed(frontend: FrontendProcess, worker: str) -> int:
    """Blocks of prefill worker `worker` the least caught-up frontend process indexed."""
    return min(router["workers"][worker]["cached_blocks"] for router in prefill_routers(frontend))


def partition_stable_prompt(tokenizer, topic: str) -> str:
    """A long prompt whose KV split matches between the connector and local prefix caching.

    Local prefix caching reuses whole blocks of the first N-1 tokens; the connector whole
    blocks of the first N-2. They agree unless N-1 is a multiple of the block size, so
    such prompts get one more word.
    """
    prompt = long_prompt(topic)
    while (len(chat_ids(tokenizer, prompt)) - 1) % 32 == 0:
        prompt += " Thanks."
    return prompt


async def _generate(client, ids: list[int], max_tokens: int) -> list[LLMEngineOutput]:
    request = greedy_request(ids, max_tokens, model=DEFAULT_MODEL)
    return [out async for out in client.round_robin(request, response_type=LLMEngineOutput)]


async def aggregated_reference(
    nats_url: str, tokenizer, prompt: str, max_tokens: int = 32, *, warm_prefix: bool = True
) -> tuple[str, int]:
    """Greedy output of an aggregated worker computing the prompt the way disagg does.

    The reference is the session's aggregated n-gram worker (the decode worker's
    speculative config). Its prompt is first computed whole by a one-token request, the
    way the prefill worker computes it; the real request then reuses the cached whole
    blocks and computes the tail, the way the decode worker does after loading the
    transferred blocks. Same numbers in the same shapes, so bf16 rounding cannot make
    the two differ; only a wrong or missing transfer can. Without `warm_prefix` the
    prompt is computed whole by the request itself (a decode worker that loaded nothing).
    Returns (text, cached tokens).
    """
    runtime = await DistributedRuntime.connect(nats_url)
    try:
        client = await runtime.namespace("e2e").component("spec").endpoint("generate").client()
        await client.wait_for_instances(timeout=60)
        ids = chat_ids(tokenizer, prompt)
        if warm_prefix:
            await _generate(client, ids, max_tokens=1)
        outputs = await _generate(client, ids, max_tokens)
        usage = outputs[-1].completion_usage
        details = usage.prompt_tokens_details if usage else None
        cached = details.cached_tokens if details else 0
        text = tokenizer.decode([t for o in outputs for t in o.token_ids], skip_special_tokens=True)
        return text, cached
    finally:
        await runtime.shutdown()


async def test_decode_loads_prompt_from_connector_and_matches_aggregated(
    disagg, ngram_worker, nats_url, tokenizer
):
    frontend, decode = disagg["frontend"], disagg["decode"]
    hits_before = decode.metric("vllm:external_prefix_cache_hits_total")
    fallbacks_before = frontend.metric("dynamo_frontend_prefill_fallbacks_total")
    for topic in TOPICS[:3]:
        prompt = partition_stable_prompt(tokenizer, topic)
        result = chat(frontend, prompt)
        usage = result["usage"]
        transferred = transferred_tokens(usage["prompt_tokens"], 32)
        assert transferred >= 64
        assert usage["prompt_tokens_details"]["cached_tokens"] == transferred
        expected, reference_cached = await aggregated_reference(nats_url, tokenizer, prompt)
        assert reference_cached == transferred, "reference did not split the prompt the same way"
        assert result["choices"][0]["message"]["content"] == expected
    hits = decode.metric("vllm:external_prefix_cache_hits_total") - hits_before
    assert hits >= 3 * 64, f"decode worker loaded only {hits} tokens through the connector"
    assert frontend.metric("dynamo_frontend_prefill_fallbacks_total") == fallbacks_before


async def test_transfer_directory_stays_bounded(disagg, nats_url, tokenizer, transfer_dir):
    frontend = disagg["frontend"]
    chat(frontend, long_prompt(TOPICS[3]), max_tokens=8)
    # Consumed entries are deleted when their request ends.
    wait_until(
        lambda: not TransferRoot(transfer_dir).entries(),
        timeout=5,
        interval=POLL_S,
        what=lambda: f"consumed transfers to be deleted; left: {list(transfer_dir.iterdir())}",
    )
    # A prefill whose decode never comes (the client went away) leaves an orphan entry...
    runtime = await DistributedRuntime.connect(nats_url)
    try:
        client = (
            await runtime.namespace(NAMESPACE).component("prefill").endpoint("generate").client()
        )
        await client.wait_for_instances(timeout=30)
        ids = tokenizer.encode(long_prompt("an orphaned prefill"))
        request = PreprocessedRequest(
            request_id=uuid.uuid4().hex, model=DEFAULT_MODEL, token_ids=ids,
            stop_conditions=StopConditions(max_tokens=1),
        )  # fmt: skip
        outputs = [out async for out in client.round_robin(request, response_type=LLMEngineOutput)]
        assert outputs[-1].disaggregated_params
    finally:
        await runtime.shutdown()
    assert TransferRoot(transfer_dir).entries()
    # ...which expires after the TTL.
    wait_until(
        lambda: not TransferRoot(transfer_dir).entries(),
        timeout=TRANSFER_TTL_S + 6,
        interval=POLL_S,
        what=lambda: f"the orphaned transfer to expire; left: {list(transfer_dir.iterdir())}",
    )


RECOVERED = "Recovered from KV load failure"  # vLLM's scheduler, under policy "recompute"


def recoveries(worker: WorkerProcess) -> int:
    return worker.log_path.read_text(errors="replace").count(RECOVERED)


def plant_broken_entry(transfer_dir: Path, ids: list[int]) -> Path:
    """An entry for `ids` whose layer file cannot be read: what a loader meets when the
    entry is deleted or damaged between the engine's match and its load. Dated in the
    future so no TTL sweep removes it before both engines have met it."""
    entry = transfer_dir / entry_name(ids, 32)
    entry.mkdir()
    (entry / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"not a safetensors file")
    later = time.time() + 600
    os.utime(entry, (later, later))
    return entry


async def test_engines_survive_an_entry_that_breaks_before_it_loads(
    disagg, ngram_worker, nats_url, tokenizer, transfer_dir
):
    """Both engines match the prompt's entry, fail to read it, and compute the prompt
    themselves (vLLM's ExampleConnector let the read error kill the engine); the answer
    is the one an aggregated worker gives for the prompt computed whole, and the decode
    worker, whose request the entry was handed to, consumes it."""
    frontend, decode, prefills = disagg["frontend"], disagg["decode"], disagg["prefill"]
    prompt = long_prompt("why leaves change colour")
    ids = chat_ids(tokenizer, prompt)
    entry = plant_broken_entry(transfer_dir, ids)
    decode_before = recoveries(decode)
    prefill_before = sum(recoveries(p) for p in prefills)

    result = chat(frontend, prompt)

    expected, _ = await aggregated_reference(nats_url, tokenizer, prompt, warm_prefix=False)
    assert result["choices"][0]["message"]["content"] == expected
    assert recoveries(decode) == decode_before + 1
    assert sum(recoveries(p) for p in prefills) == prefill_before + 1
    wait_until(
        lambda: not entry.exists(),
        timeout=5,
        interval=POLL_S,
        what="the decode worker to consume the entry its request was handed",
    )
    assert chat(frontend, long_prompt("tides"), max_tokens=4)["choices"][0]["message"]["content"]


async def test_prefill_workers_prove_the_decode_worker_shares_their_directory(
    disagg, nats_url, transfer_dir, tmp_path
):
    """Each prefill worker advertises a probe of its transfer directory on its card (and
    in every prefill result): here, where every worker shares one directory, the probe
    file the real worker wrote is found by the decode side's check (requests above went
    through it); a decode worker reading another directory (another host's /tmp) would
    refuse the same probe, naming both sides."""
    runtime = await DistributedRuntime.connect(nats_url)
    watcher = await ModelCardWatcher(runtime, NAMESPACE).start()
    try:
        await wait_until_async(
            lambda: len(prefill_cards(watcher)) == 2, timeout=10, what="both prefill cards"
        )
        cards = prefill_cards(watcher)
    finally:
        await watcher.close()
        await runtime.shutdown()
    for card in cards:
        probe = card.kv_storage
        assert probe is not None and probe.path == str(transfer_dir)
        assert card.host and probe.host == card.host
        assert (transfer_dir / f"{PROBE_PREFIX}{probe.token}").is_file()
        SharedStorageCheck(transfer_dir, "decode-host").check(probe)
        with pytest.raises(KvStorageNotSharedError, match=str(transfer_dir)):
            SharedStorageCheck(tmp_path, "other-host").check(probe)


def prefill_cards(watcher: ModelCardWatcher) -> list[ModelCard]:
    return [c for c in watcher.cards if c.worker_type is WorkerType.PREFILL]


def test_prefill_legs_follow_the_prefill_worker_that_caches_the_prefix(disagg):
    """kv mode routes prefill legs by cache overlap too: a request sharing a long prefix
    with an earlier one is prefilled where that prefix is cached, and reuses it there."""
    frontend, prefills = disagg["frontend"], disagg["prefill"]
    for topic in ("volcanoes", "sailing"):
        context = " ".join(f"Fact {i} about {topic}: it is item number {i}." for i in range(40))
        before = prefill_routed(frontend)
        first = chat(frontend, f"{context}\n\nQuestion: name one.", max_tokens=4)
        owner = routed_one_more(before, prefill_routed(frontend))
        blocks = wait_prefix_indexed(
            lambda o=owner: prefill_indexed(frontend, o),
            first["usage"]["prompt_tokens"],
            32,
            interval=POLL_S,
        )
        for question in ("name another.", "which is the most famous?"):
            reused_before = sum(
                w.metric("dynamo_worker_cached_prompt_tokens_total") for w in prefills
            )
            before = prefill_routed(frontend)
            chat(frontend, f"{context}\n\nQuestion: {question}", max_tokens=4)
            chosen = routed_one_more(before, prefill_routed(frontend))
            assert chosen == owner, f"{topic}: {question!r} prefilled on {chosen}, cache on {owner}"
            reused = sum(w.metric("dynamo_worker_cached_prompt_tokens_total") for w in prefills)
            assert reused - reused_before >= (blocks - 2) * 32, "the prefix was recomputed"


def test_a_disaggregated_request_gets_its_prompt_logprobs(disagg, tokenizer):
    """`prompt_logprobs` of a disaggregated request: every prompt token after the first has
    its logprob and rank, the prompt's own token first, as vLLM shapes them. Which worker
    computes them (the prefill worker when its leg succeeds, the decode worker when it
    prefills itself) is `DisaggregatedEngineClient`'s choice, unit-tested in
    `tests/unit/frontend/test_frontend_model_registry.py`; whether the decode worker then
    loaded the prompt's KV is not asserted here: in one fresh-clone run it computed the
    prompt itself (cached tokens 0), cause not pinned."""
    frontend = disagg["frontend"]
    prompt = long_prompt(TOPICS[3])
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    status, text = http_post_json(f"{frontend.base_url}/v1/chat/completions", body, timeout=120)
    assert status == 200, text
    result = json.loads(text)
    ids = chat_ids(tokenizer, prompt)
    positions = result["prompt_logprobs"]
    assert len(positions) == len(ids) == result["usage"]["prompt_tokens"]
    assert positions[0] is None
    for token, position in zip(ids[1:], positions[1:], strict=True):
        assert next(iter(position)) == str(token), "the prompt's own token comes first"
        assert 1 <= len(position) <= 2
        assert all(e["logprob"] <= 0 and e["rank"] >= 1 for e in position.values())


def conditional_prompt(tokenizer) -> tuple[str, int]:
    """A prompt of 300-400 tokens (over the default --disagg-local-prefill-tokens of 256),
    unique per run, and its token count."""
    facts = " ".join(
        f"Fact {i}: tides follow the moon, with a lag of {i} minutes." for i in range(14)
    )
    prompt = f"{long_prompt('tides')}\n\n{facts}"
    tokens = len(chat_ids(tokenizer, prompt))
    assert 300 <= tokens <= 400, tokens
    return prompt, tokens


def test_conditional_disaggregation_prefills_on_decode_what_is_short_or_cached(disagg, tokenizer):
    """The conditional frontend: a short prompt is prefilled by the decode worker; a long
    one by a prefill worker (the decode worker loads it through the connector); the same
    long prompt again by the decode worker, which now caches it and computes only the
    tail. Each decision is counted with its reason."""
    frontend, decode = disagg["conditional"], disagg["decode"]

    def decided(reason: str) -> float:
        return frontend.metric("dynamo_frontend_prefill_decisions_total", reason=reason)

    def loaded() -> float:
        return decode.metric("vllm:external_prefix_cache_hits_total")

    before = {r: decided(r) for r in ("short_prompt", "long_prompt", "cached_on_decode")}
    hits = loaded()
    chat(frontend, "Name three primary colours.", max_tokens=4)
    assert decided("short_prompt") == before["short_prompt"] + 1
    assert loaded() == hits, "a short prompt went through the connector"

    prompt, tokens = conditional_prompt(tokenizer)
    chat(frontend, prompt, max_tokens=4)
    assert decided("long_prompt") == before["long_prompt"] + 1
    assert loaded() - hits >= tokens - 2 * 32, "the long prompt was not transferred"

    hits = loaded()
    again = chat(frontend, prompt, max_tokens=4)
    assert decided("cached_on_decode") == before["cached_on_decode"] + 1
    assert loaded() == hits, "a prompt the decode worker caches went through the connector"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= tokens - 32
    view = json.loads(http_get(f"{frontend.base_url}/debug/kv")[1])["disaggregation"]
    decisions = view[DEFAULT_MODEL]["decisions"]
    assert decisions["cached_on_decode"] >= 1 and decisions["long_prompt"] >= 1


async def test_killed_prefill_workers_fall_back_to_local_prefill(disagg):
    frontend = disagg["frontend"]
    before = frontend.metric("dynamo_frontend_prefill_fallbacks_total")
    for prefill in disagg["prefill"]:
        prefill.kill()
    for topic in TOPICS[:2]:
        result = chat(frontend, long_prompt(topic), max_tokens=16)
        assert result["choices"][0]["message"]["content"]
        assert result["usage"]["completion_tokens"] > 0
    assert frontend.metric("dynamo_frontend_prefill_fallbacks_total") >= before + 2
