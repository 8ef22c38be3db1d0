"""Dynamic speculation chosen from measurements, end to end on the embedded model.

Claims: `python -m dynamo.vllm.profile_spec` sweeps the real engine with n-gram (K = 0, 1
at batch sizes 1 and 32) within the suite's budget and writes a profile whose schedule is
the goodput-maximising one for its own measurements, with a plot; a worker started with
`--speculation-profile` runs that schedule, its card tells the KV router the K it runs
idle, and its `/metrics` show the K in force following the schedule as the running batch
grows under load.

The sweep is small (two engines, 32 tokens per request), so its numbers are noisy; what
does not depend on noise is asserted exactly (the schedule is `choose_schedule` of the
measured numbers, every scrape's K is the schedule's K for that scrape's batch). That K
changes with load relies on one measured fact: n-gram drafts (acceptance ~0.15 here) pay
at batch 1 and lose at batch 32 on these 2 cores, by wide margins in every run so far.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from dynamo.testing.http import http_get, kv_router_view, metric_values
from dynamo.testing.processes import FrontendProcess, WorkerProcess, child_env, cpu_engine_flags
from dynamo.vllm.speculation_profile import (
    SpeculationProfile,
    choose_schedule,
    k_for_batch,
    load_profile,
)

NAMESPACE = "e2e-specprof"
COMPONENT = "profiled"
MODEL = "smollm2-135m-instruct"
ENDPOINT = f"{NAMESPACE}/{COMPONENT}/generate"
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
BATCH = 32
PROFILE_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def profile_path(embedded_model: Path, e2e_log_dir: Path) -> Path:
    out = e2e_log_dir / "ngram.profile.json"
    argv = [
        sys.executable, "-m", "dynamo.vllm.profile_spec",
        "--model", str(embedded_model),
        "--speculative-config", json.dumps(NGRAM),
        "--batch-sizes", f"1,{BATCH}", "--max-k", "1", "--output-tokens", "32",
        "--max-batch-size", str(BATCH), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        argv, env=child_env(), capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S
    )
    assert done.returncode == 0, f"profiler failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "schedule (num_speculative_tokens_per_batch_size)" in done.stdout
    return out


@pytest.fixture(scope="module")
def profile(profile_path: Path) -> SpeculationProfile:
    return load_profile(profile_path)


@pytest.fixture(scope="module")
def cluster(
    embedded_model: Path, nats_url: str, e2e_log_dir: Path, profile_path: Path
) -> Iterator[tuple[FrontendProcess, WorkerProcess]]:
    flags = cpu_engine_flags()
    flags[flags.index("--max-num-seqs") + 1] = str(BATCH)
    worker = WorkerProcess(
        "profiled-worker", embedded_model, nats_url, e2e_log_dir,
        namespace=NAMESPACE, component=COMPONENT, engine_flags=flags,
        extra=["--speculative-config", json.dumps(NGRAM),
               "--speculation-profile", str(profile_path)],
    )  # fmt: skip
    frontend = FrontendProcess(
        "profiled-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE,
        extra=["--router-mode", "kv"],
    )  # fmt: skip
    try:
        worker.wait_ready()
        frontend.wait_for_model(MODEL)
        frontend.wait_kv_router_workers(MODEL, ENDPOINT, 1)
        yield frontend, worker
    finally:
        frontend.stop()
        worker.stop()


def test_profile_schedule_is_the_best_for_its_own_measurements(
    profile: SpeculationProfile, profile_path: Path
) -> None:
    assert profile.method == "ngram" and profile.batch_sizes == [1, BATCH]
    assert [t.k for t in profile.step_times] == [0, 1]
    assert all(ms > 0 for t in profile.step_times for ms in t.step_ms)
    assert 0.0 < profile.acceptance_per_position[0] < 1.0
    assert profile.schedule == choose_schedule(profile)
    assert profile.schedule[-1][1] == BATCH
    png = profile_path.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_schedule_drafts_at_batch_one_and_not_at_full_batch(profile: SpeculationProfile) -> None:
    numbers = f"step ms {[t.step_ms for t in profile.step_times]}, acceptance " + str(
        profile.acceptance_per_position
    )
    assert k_for_batch(profile.schedule, 1) == 1, numbers
    assert k_for_batch(profile.schedule, BATCH) == 0, numbers


def worker_k_and_running(worker: WorkerProcess) -> tuple[float, float]:
    """The K in force and the running batch from ONE scrape, so they belong together."""
    _, text = http_get(worker.metrics_url)
    k = metric_values(text, "dynamo_worker_spec_decode_k")
    running = metric_values(text, "dynamo_worker_running_requests")
    assert k and running, "the worker exports no K in force or running batch"
    return k[0], running[0]


def test_worker_runs_the_profile_and_the_router_books_its_idle_k(
    cluster: tuple[FrontendProcess, WorkerProcess], profile: SpeculationProfile
) -> None:
    frontend, worker = cluster
    idle_k = k_for_batch(profile.schedule, 1)
    (view,) = kv_router_view(frontend.base_url, MODEL, ENDPOINT)["workers"].values()
    assert view["num_speculative_tokens"] == idle_k
    k, running = worker_k_and_running(worker)
    assert (k, running) == (idle_k, 0)
    expected = 1 + sum(profile.acceptance_per_position[:idle_k])
    (profiled,) = metric_values(
        http_get(worker.metrics_url)[1], "dynamo_worker_spec_decode_profile_acceptance_length"
    )
    assert profiled == pytest.approx(expected, abs=1e-3)


async def test_k_in_force_follows_the_schedule_as_load_grows(
    cluster: tuple[FrontendProcess, WorkerProcess], profile: SpeculationProfile
) -> None:
    frontend, worker = cluster
    client = openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="x", max_retries=0)

    async def one(i: int) -> int:
        reply = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=160,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.usage.completion_tokens

    seen: list[tuple[float, float]] = []

    async def scrape_until(requests: asyncio.Future) -> None:
        while not requests.done():
            seen.append(await asyncio.to_thread(worker_k_and_running, worker))
            await asyncio.sleep(0.1)

    requests = asyncio.gather(*(one(i) for i in range(BATCH)))
    await scrape_until(requests)
    assert await requests == [160] * BATCH
    for k, running in seen:
        assert k == k_for_batch(profile.schedule, max(int(running), 1)), (k, running)
    peak = max(int(running) for _, running in seen)
    assert peak >= BATCH // 2, f"the load never filled the batch: running at most {peak}"
    ks = {k for k, _ in seen}
    assert ks == {k_for_batch(profile.schedule, b) for b in range(1, peak + 1)}, seen
    assert len(ks) > 1, f"K never changed under load: {seen}"
