"""MTP (multi-token prediction) served end to end on the tiny MiMo-shaped target.

The target is built in the test (`tiny_mtp`): its transformer blocks add nothing to the
residual, so greedy decoding without speculation is a fixed walk through the vocabulary,
next(t) = argmax(lm_head @ embed[t]), computable from the weights alone. That walk is the
"no speculation" reference (one engine cannot serve the same request with speculation off;
the offline measurement in `tiny_mtp`'s docstring showed vLLM without speculation produces
the same walk).

Three engines start together and serve through two frontends (KV router mode):
- aggregated, native `--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'`
  (two draft positions from the one MTP layer);
- disaggregated: a prefill worker (same native config: the MTP layer keeps KV of its own,
  which must be handed over with the target's) and a decode worker configured by a
  TensorRT-LLM-style `--extra-engine-args` file (`decoding_type: MTP`,
  `num_nextn_predict_layers: 1`), which the worker translates to vLLM's mtp with K=1.

Claims: greedy text equals the walk on every path; vLLM's accepted-draft counters grow
(every draft token is accepted, at every position: the MTP layer agrees with the target by
construction); the router books speculative slots with the K each worker runs (2 and 1);
the decode worker loads the prompt's KV from the prefill worker instead of computing it
(vLLM's external-prefix-cache hits: the tiny target's text does not depend on its KV, so
equal text alone would not show the transfer); and a transfer from a prefill worker
without the MTP layer is refused instead of killing the decode engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch
from e2e_prompts import greedy_request
from safetensors.torch import load_file
from tiny_mtp import build_tiny_mtp

from dynamo.frontend.engine.disagg import prefill_leg
from dynamo.llm.protocols import LLMEngineOutput, PrefillResult
from dynamo.runtime import DistributedRuntime
from dynamo.testing.command_lines import cpu_engine_flags
from dynamo.testing.http import http_post_json, kv_router_view
from dynamo.testing.processes import FrontendProcess, WorkerProcess, stop_all
from dynamo.testing.spec_counters import SpecCounters
from dynamo.vllm.kv_transfer.janitor import entry_name, transferred_tokens

MAX_MODEL_LEN = 512
MAX_TOKENS = 12
BLOCK = 32
# Over two KV blocks, so the disaggregated decode worker has whole blocks to load.
PROMPT = (
    "Tell me a story about a cat who lives in a lighthouse by the sea, keeps the lamp "
    "burning through every winter storm, and one night guides a lost fishing boat home. "
    "Keep it short, warm and simple, for a child at bedtime. Give the cat a name, the "
    "boat a colour and the storm a sound, and end with the cat asleep by the lamp at dawn."
)
NATIVE_K = 2  # more draft tokens than MTP layers: vLLM runs the one layer twice
ENGINE_FILE_K = 1
SERVED = "tiny-mtp"
NATIVE_SPEC = {"method": "mtp", "num_speculative_tokens": NATIVE_K}
ENGINE_FILE = f"""\
# TensorRT-LLM form, translated by the worker to vLLM's native method mtp.
speculative_config:
  decoding_type: MTP
  num_nextn_predict_layers: {ENGINE_FILE_K}
"""
AGG_NS = "e2e-mtp"
DISAGG_NS = "e2e-mtp-disagg"


@dataclass
class MtpStacks:
    """The module's engines and the frontends in front of them."""

    native: WorkerProcess
    prefill: WorkerProcess
    decode: WorkerProcess
    agg_frontend: FrontendProcess
    disagg_frontend: FrontendProcess


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Path:
    return build_tiny_mtp(tmp_path_factory.mktemp("mtp") / "tiny-mtp", embedded_model)


@pytest.fixture(scope="module")
def mtp_tokenizer(mtp_target: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(mtp_target))


@pytest.fixture(scope="module")
def transfer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Not created here: the workers create (and so own) it; see dynamo.vllm.kv_transfer.transfer_root.
    return tmp_path_factory.mktemp("mtp-kv") / "store"


@pytest.fixture(scope="module")
def stacks(
    mtp_target: Path,
    nats_url: str,
    e2e_log_dir: Path,
    transfer_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[MtpStacks]:
    scratch = tmp_path_factory.mktemp("mtp-stacks")
    engine_file = scratch / "mtp.yaml"
    engine_file.write_text(ENGINE_FILE)
    transfer = {"DYN_KV_SHARED_STORAGE_PATH": str(transfer_dir)}

    def worker(name: str, namespace: str, component: str, extra: list[str]) -> WorkerProcess:
        return WorkerProcess(
            f"worker-{name}", mtp_target, nats_url, e2e_log_dir,
            namespace=namespace, component=component, env=transfer,
            engine_flags=cpu_engine_flags(MAX_MODEL_LEN),
            extra=["--served-model-name", SERVED, *extra],
        )  # fmt: skip

    started: list[WorkerProcess | FrontendProcess] = []
    try:
        native = worker(
            "mtp-native", AGG_NS, "backend", ["--speculative-config", json.dumps(NATIVE_SPEC)]
        )
        started.append(native)
        prefill = worker(
            "mtp-prefill",
            DISAGG_NS,
            "prefill",
            ["--is-prefill-worker", "--speculative-config", json.dumps(NATIVE_SPEC)],
        )
        started.append(prefill)
        decode = worker("mtp-decode", DISAGG_NS, "backend",
                        ["--is-decode-worker", "--extra-engine-args", str(engine_file)])  # fmt: skip
        started.append(decode)
        for w in (native, prefill, decode):
            w.wait_ready()
        agg_frontend = FrontendProcess(
            "frontend-mtp", nats_url, e2e_log_dir, namespace=AGG_NS, extra=["--router-mode", "kv"]
        )
        started.append(agg_frontend)
        disagg_frontend = FrontendProcess(
            "frontend-mtp-disagg", nats_url, e2e_log_dir, namespace=DISAGG_NS,
            extra=["--router-mode", "kv", "--disagg-prefill", "remote"],
        )  # fmt: skip
        started.append(disagg_frontend)
        for frontend in (agg_frontend, disagg_frontend):
            frontend.wait_for_model(SERVED)
        yield MtpStacks(native, prefill, decode, agg_frontend, disagg_frontend)
    finally:
        stop_all(reversed(started))


def complete(frontend: FrontendProcess) -> dict:
    body = {
        "model": SERVED,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    status, text = http_post_json(f"{frontend.base_url}/v1/completions", body, timeout=120)
    assert status == 200, text
    return json.loads(text)


def reference_walk(target: Path, last_prompt_token: int, count: int) -> list[int]:
    """Greedy tokens without speculation: every block of the tiny target is a no-op on the
    residual and RMS norm only rescales, so next(t) = argmax(lm_head @ embed[t])."""
    weights = load_file(str(target / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    tokens, token = [], last_prompt_token
    for _ in range(count):
        token = int(torch.argmax(head @ embed[token]))
        tokens.append(token)
    return tokens


def expected_text(target: Path, tokenizer) -> str:
    last = tokenizer(PROMPT)["input_ids"][-1]
    return tokenizer.decode(reference_walk(target, last, MAX_TOKENS), skip_special_tokens=True)


def router_k(frontend: FrontendProcess, namespace: str) -> list[int]:
    """The K the frontend's KV router books speculative slots with, per worker."""
    view = kv_router_view(frontend.base_url, SERVED, f"{namespace}/backend/generate")
    return [w["num_speculative_tokens"] for w in view["workers"].values()]


def test_native_mtp_greedy_equals_no_speculation_and_accepts(
    stacks: MtpStacks, mtp_target: Path, mtp_tokenizer
) -> None:
    before = SpecCounters.read(stacks.native, NATIVE_K)
    text = complete(stacks.agg_frontend)["choices"][0]["text"]
    grown = SpecCounters.read(stacks.native, NATIVE_K) - before
    assert text == expected_text(mtp_target, mtp_tokenizer)
    print(f"MTP K={NATIVE_K} aggregated: {grown}")
    assert grown.drafts > 0
    # The tiny target's MTP layer agrees with the target: every draft token is accepted,
    # at every position (K=2 reuses the one MTP layer for the second position).
    assert grown.per_position == (grown.drafts,) * NATIVE_K
    assert grown.accepted == grown.drafts * NATIVE_K


def test_router_books_the_k_that_runs(stacks: MtpStacks) -> None:
    assert router_k(stacks.agg_frontend, AGG_NS) == [NATIVE_K]
    assert router_k(stacks.disagg_frontend, DISAGG_NS) == [ENGINE_FILE_K]


def test_the_router_predicts_the_prefix_hit_mtp_really_reuses(stacks: MtpStacks) -> None:
    """vLLM drops the last block of a prefix-cache hit for MTP (its drafter needs the
    target's hidden states there) and the worker's card says so: a 165-token prompt
    (5 full blocks of 32) sent twice is reused 4 blocks deep, and the KV router, which
    sees all 5 cached, predicts those 4."""
    ids = [1000 + i for i in range(165)]
    endpoint = f"{AGG_NS}/backend/generate"

    def predicted_overlap() -> int:
        return kv_router_view(stacks.agg_frontend.base_url, SERVED, endpoint)["routing"][
            "overlap_blocks"
        ]

    def cached_tokens() -> int:
        body = {"model": SERVED, "prompt": ids, "max_tokens": 2, "temperature": 0.0}
        status, text = http_post_json(f"{stacks.agg_frontend.base_url}/v1/completions", body)
        assert status == 200, text
        return json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens() == 0
    before = predicted_overlap()
    assert cached_tokens() == 4 * BLOCK
    assert predicted_overlap() - before == 4


def test_engine_file_dry_run_resolves_to_mtp(mtp_target: Path, tmp_path: Path) -> None:
    from dynamo.vllm.config.args import parse_worker_args

    path = tmp_path / "mtp.yaml"
    path.write_text(ENGINE_FILE)
    cfg = parse_worker_args(
        ["--model", str(mtp_target), "--extra-engine-args", str(path), "--dry-run"]
    )
    assert cfg.speculative_config == {"method": "mtp", "num_speculative_tokens": ENGINE_FILE_K}


def test_disaggregated_mtp_decodes_transferred_kv_and_equals_aggregated(
    stacks: MtpStacks, mtp_target: Path, mtp_tokenizer
) -> None:
    hits_before = stacks.decode.metric("vllm:external_prefix_cache_hits_total")
    remote_before = remote_prefills(stacks.decode)
    before = SpecCounters.read(stacks.decode, ENGINE_FILE_K)
    result = complete(stacks.disagg_frontend)
    grown = SpecCounters.read(stacks.decode, ENGINE_FILE_K) - before
    prompt_tokens = result["usage"]["prompt_tokens"]
    transferred = transferred_tokens(prompt_tokens, BLOCK)
    assert transferred >= 2 * BLOCK
    hits = stacks.decode.metric("vllm:external_prefix_cache_hits_total") - hits_before
    print(f"disaggregated MTP: {prompt_tokens} prompt tokens, {hits} loaded, counters {grown}")
    assert hits == transferred
    assert remote_prefills(stacks.decode) == {
        **remote_before,
        "loaded": remote_before["loaded"] + 1,
    }
    assert result["choices"][0]["text"] == expected_text(mtp_target, mtp_tokenizer)
    aggregated = complete(stacks.agg_frontend)["choices"][0]["text"]
    assert result["choices"][0]["text"] == aggregated
    assert grown.drafts > 0
    assert grown.accepted == grown.drafts and grown.per_position == (grown.drafts,)


def remote_prefills(worker: WorkerProcess) -> dict[str, float]:
    """The decode worker's remote prefills by outcome (loaded / refused)."""
    name = "dynamo_worker_remote_prefills_total"
    return {o: worker.metric(name, outcome=o) for o in ("loaded", "refused")}


def layout_without_speculation(target: Path) -> str:
    """The KV layout a prefill worker started without MTP reports for the tiny target."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from dynamo.vllm.kv_transfer.layout import describe_kv_layout

    args = AsyncEngineArgs(
        model=str(target), enforce_eager=True, block_size=BLOCK, max_model_len=MAX_MODEL_LEN
    )
    return describe_kv_layout(args.create_engine_config())


async def engine_outputs(
    runtime: DistributedRuntime, component: str, request
) -> list[LLMEngineOutput]:
    endpoint = runtime.namespace(DISAGG_NS).component(component).endpoint("generate")
    client = await endpoint.client()
    await client.wait_for_instances(timeout=30)
    return [out async for out in client.round_robin(request, response_type=LLMEngineOutput)]


async def test_decode_computes_the_prompt_when_the_prefill_worker_lacks_the_mtp_layer(
    runtime: DistributedRuntime,
    stacks: MtpStacks,
    mtp_target: Path,
    mtp_tokenizer,
    transfer_dir: Path,
) -> None:
    """What a prefill worker started without MTP hands over: a KV file per target layer,
    none for the MTP layer (`model.layers.2`), and its own layout. vLLM's connector would
    fail the decode engine on the missing file; the decode worker refuses the transfer,
    computes the prompt itself and stays up."""
    from dynamo.vllm.kv_transfer.layout import KV_LAYOUT_PARAM

    ids = mtp_tokenizer("Once more: " + PROMPT)["input_ids"]  # no block in any cache yet
    request = greedy_request(ids, MAX_TOKENS, model=SERVED, ignore_eos=True)
    (prefilled,) = [o for o in await engine_outputs(runtime, "prefill", prefill_leg(request))
                    if o.disaggregated_params]  # fmt: skip
    params = dict(prefilled.disaggregated_params or {})
    plain = layout_without_speculation(mtp_target)
    assert params[KV_LAYOUT_PARAM] != plain, "MTP adds a layer a plain prefill worker lacks"
    entry = transfer_dir / entry_name(ids, BLOCK)
    (entry / "model.layers.2.self_attn.attn.safetensors").unlink()
    params[KV_LAYOUT_PARAM] = plain

    before = remote_prefills(stacks.decode)
    hits_before = stacks.decode.metric("vllm:external_prefix_cache_hits_total")
    request = greedy_request(ids, MAX_TOKENS, model=SERVED, ignore_eos=True)
    decode_request = msgspec.structs.replace(request, prefill_result=PrefillResult(params))
    outputs = await engine_outputs(runtime, "backend", decode_request)
    tokens = [t for o in outputs for t in o.token_ids]
    assert tokens == reference_walk(mtp_target, ids[-1], MAX_TOKENS)
    usage = outputs[-1].completion_usage
    cached = (
        usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    )
    assert cached == 0, "the prompt was computed here, not loaded"
    assert stacks.decode.metric("vllm:external_prefix_cache_hits_total") == hits_before
    assert remote_prefills(stacks.decode) == {**before, "refused": before["refused"] + 1}
    assert not entry.exists()
