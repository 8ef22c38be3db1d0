"""Dynamic speculation chosen from measurements, end to end on the embedded model.

Claims: `python -m dynamo.vllm.profile_spec` sweeps the real engine with n-gram (no
speculation, K = 0 and K = 1 at batch sizes 1 and 32) within the suite's budget and writes
a profile whose schedule is the goodput-maximising one for its own measurements, with a
plot; a worker started with that profile runs its schedule, its card tells the KV router
the K it runs idle, and its `/metrics` show the K in force and the profile's expected
acceptance; and the K in force follows a profile's schedule as the running batch grows
under load, changing where the schedule changes.

The sweep is small (three engines, 32 tokens per request), so its numbers are noisy and its
schedule may come out constant: on these 2 cores a K=1 step costs 2-7% more than a plain
one at batch 1 and ~15% more at batch 32, while n-gram on the bundled prompts gains ~5%
tokens per step, so K=1 wins or loses at batch 1 by noise. What does not depend on noise is
asserted exactly: the schedule is `choose_schedule` of the measured numbers, the worker runs
it, and every scrape's K is the schedule's K for that scrape's batch. That K changes with
load is shown by a second worker whose profile carries the same measurements with a
schedule the test sets (K=1 up to batch 8, none above). When the sweep comes out K=0
everywhere (seen once, on a loaded machine), the measured worker must refuse it instead.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from e2e_prompts import chat_ids, greedy_request

from dynamo.llm.protocols import LLMEngineOutput
from dynamo.llm.speculation_profile import (
    SpeculationProfile,
    choose_schedule,
    k_for_batch,
    load_profile,
    never_speculates,
    save_profile,
)
from dynamo.runtime import DistributedRuntime
from dynamo.testing.command_lines import cpu_engine_flags
from dynamo.testing.http import http_get, kv_router_view, metric_values
from dynamo.testing.processes import FrontendProcess, WorkerProcess, child_env, stop_all

NAMESPACE = "e2e-specprof"
COMPONENT = "profiled"
LOADED = "scheduled"  # the second worker, with the test's schedule
SET_SCHEDULE = [[1, 8, 1], [9, 32, 0]]
OUTPUT_TOKENS = 96
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


@dataclass
class Cluster:
    frontend: FrontendProcess
    measured: WorkerProcess  # runs the measured profile, or refused it (see `refusal`)
    scheduled: WorkerProcess  # runs the measurements with `SET_SCHEDULE`
    refusal: str | None  # the measured worker's error line when it refused its profile


@pytest.fixture(scope="module")
def cluster(
    embedded_model: Path, nats_url: str, e2e_log_dir: Path, profile_path: Path
) -> Iterator[Cluster]:
    """A frontend (kv mode) over the worker with the measured profile, and beside it the
    worker whose profile carries `SET_SCHEDULE`; both engines start in parallel. When the
    noisy sweep found that speculation never pays (K=0 everywhere), the measured worker
    must refuse its profile at start with the documented error (exit code 2)."""
    flags = cpu_engine_flags()
    flags[flags.index("--max-num-seqs") + 1] = str(BATCH)
    set_path = profile_path.with_name("ngram.set-schedule.profile.json")
    save_profile(msgspec.structs.replace(load_profile(profile_path), schedule=SET_SCHEDULE),
                 set_path)  # fmt: skip
    workers = [
        WorkerProcess(
            f"{component}-worker", embedded_model, nats_url, e2e_log_dir,
            namespace=NAMESPACE, component=component, engine_flags=flags,
            extra=["--speculative-config", json.dumps(NGRAM), "--speculation-profile", str(path)],
        )
        for component, path in ((COMPONENT, profile_path), (LOADED, set_path))
    ]  # fmt: skip
    frontend = FrontendProcess(
        "profiled-frontend", nats_url, e2e_log_dir, namespace=NAMESPACE,
        extra=["--router-mode", "kv"],
    )  # fmt: skip
    refusal = None
    try:
        if never_speculates(load_profile(profile_path).schedule):
            assert workers[0].popen.wait(120) == 2, workers[0].log_tail()
            refusal = workers[0].log_tail().strip().splitlines()[-1]
        else:
            workers[0].wait_ready()
        workers[1].wait_ready()
        frontend.wait_for_model(MODEL)
        yield Cluster(frontend, workers[0], workers[1], refusal)
    finally:
        frontend.stop()
        stop_all(workers)


def test_profile_schedule_is_the_best_for_its_own_measurements(
    profile: SpeculationProfile, profile_path: Path
) -> None:
    assert profile.method == "ngram" and profile.batch_sizes == [1, BATCH]
    assert [t.k for t in profile.step_times] == [0, 1]
    assert len(profile.no_speculation_step_ms) == 2
    assert 0.0 < profile.drafted_fraction < 1.0  # n-gram drafts only where the context matches
    assert all(ms > 0 for t in profile.step_times for ms in t.step_ms)
    assert 0.0 < profile.acceptance_per_position[0] < 1.0
    assert profile.schedule == choose_schedule(profile)
    assert profile.schedule[-1][1] == BATCH
    png = profile_path.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def worker_k_and_running(worker: WorkerProcess) -> tuple[float, float]:
    """The K in force and the running batch from ONE scrape, so they belong together."""
    _, text = http_get(worker.metrics_url)
    k = metric_values(text, "dynamo_worker_spec_decode_k")
    running = metric_values(text, "dynamo_worker_running_requests")
    assert k and running, "the worker exports no K in force or running batch"
    return k[0], running[0]


def test_worker_runs_the_profile_and_the_router_books_its_idle_k(
    cluster: Cluster, profile: SpeculationProfile
) -> None:
    if cluster.refusal is not None:
        # The sweep's noise decided against speculation everywhere (module docstring).
        assert cluster.refusal.startswith("error: --speculation-profile: speculation never")
        assert "K=0 everywhere" in cluster.refusal
        print(f"measured schedule {profile.schedule}: the worker refused it, as it must")
        return
    frontend, worker = cluster.frontend, cluster.measured
    idle_k = k_for_batch(profile.schedule, 1)
    frontend.wait_kv_router_workers(MODEL, ENDPOINT, 1)
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
    cluster: Cluster, nats_url: str, tokenizer
) -> None:
    worker = cluster.scheduled
    runtime = await DistributedRuntime.connect(nats_url)
    try:
        client = await runtime.namespace(NAMESPACE).component(LOADED).endpoint("generate").client()
        await client.wait_for_instances(timeout=30)

        async def one(i: int) -> int:
            ids = chat_ids(tokenizer, f"Tell story number {i} about a cat.")
            req = greedy_request(ids, OUTPUT_TOKENS, model=MODEL, ignore_eos=True)
            tokens = 0
            async for out in client.round_robin(req, response_type=LLMEngineOutput):
                tokens += len(out.token_ids)
            return tokens

        seen: list[tuple[float, float]] = []
        requests = asyncio.gather(*(one(i) for i in range(BATCH)))
        while not requests.done():
            seen.append(await asyncio.to_thread(worker_k_and_running, worker))
            await asyncio.sleep(0.1)
        assert await requests == [OUTPUT_TOKENS] * BATCH
    finally:
        await runtime.shutdown()
    for k, running in seen:
        assert k == k_for_batch(SET_SCHEDULE, max(int(running), 1)), (k, running)
    peak = max(int(running) for _, running in seen)
    assert peak > SET_SCHEDULE[0][1], f"the load never passed batch 8: running at most {peak}"
    assert {k for k, _ in seen} == {0, 1}, f"K did not follow the load: {seen}"
