"""Speculative decoding through the frontend: no speculation vs n-gram vs Eagle3 (K = 1..5).

One stack per setup (a private nats-server, one `dynamo.vllm` worker with the CPU engine
flags, the frontend), measured one after the other on the same prompts: the held-out
prompts of the Eagle3 training tool (topics its training set never uses), sent by vLLM's
serving benchmark through the chat template to /v1/completions, greedy, `--ignore-eos`,
128 output tokens, at concurrency 1, 4 and 16. Per setup and concurrency: output tokens/s,
median TPOT, and the mean acceptance length (tokens per verification step) from the
frontend's speculative-decoding counters over the run. Eagle3 uses the head shipped for
the embedded model (`smollm2-135m-instruct-eagle3`).

Usage:

    .venv/bin/python benchmarks/spec_decode_bench.py            # full run (~25 min)
    .venv/bin/python benchmarks/spec_decode_bench.py --quick    # short smoke run
    .venv/bin/python benchmarks/spec_decode_bench.py --setups none,eagle3-k3
    .venv/bin/python benchmarks/spec_decode_bench.py --dynamic            # ~15 min
    .venv/bin/python benchmarks/spec_decode_bench.py --dynamic --quick
    .venv/bin/python benchmarks/spec_decode_bench.py --dynamic --static-k 1 --reprofile

Full runs write benchmarks/results/spec_decode.json and docs/images/spec_decode.png
(`--json` / `--plot` elsewhere).

`--dynamic` compares three setups instead: no speculation, Eagle3 with a static K
(`--static-k`, default 2) and Eagle3 with the K schedule of a measured speculation profile
(`--profile`, default the shipped
engine_configs/profiles/smollm2-135m-instruct/eagle3.profile.json: the worker gets the Eagle3
config without `num_speculative_tokens` plus `--speculation-profile`, and runs the K the
schedule gives for the current batch size). Same held-out prompts, 128 output tokens, at
concurrency 1, 4, 16 and 32 (12, 32, 64 and 96 requests; 3, 8, 16 and 32 with `--quick`),
every worker with `--max-num-seqs 32` so that 32 sequences run at once. When the profile
file is missing (or with `--reprofile`) it is made first by `python -m
dynamo.vllm.profile_spec` (batch sizes 1..32, K up to 3, 64 output tokens), about 4 more
minutes on 2 cores. Target, at every concurrency: the profiled schedule reaches >= 0.97x the
better of no speculation and static K, and beats static K wherever static K loses to no
speculation; one verdict line per concurrency and an overall PASS/MISS. Full runs write
benchmarks/results/spec_dynamic.json and docs/images/spec_dynamic.png (tokens/s and
median TPOT by concurrency, the profiled points labelled with their K).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dynamo.llm.speculation_profile import k_for_batch
from dynamo.runtime.ports import free_port
from dynamo.testing.http import http_get, metric_total
from dynamo.testing.processes import child_env
from dynamo.vllm.training.eagle3.prompts import held_out
from harness import (
    CPU_ENGINE_FLAGS,
    ROOT,
    BenchError,
    RunResult,
    Scenario,
    Stack,
    cpu_delta,
    dynamo_stack,
    format_table,
    guarded,
    host_info,
    levels_type,
    log_dir,
    resolve_model_arg,
    results_path,
    run_bench_serve,
    save_report,
    serving_parser,
    warn_if_busy,
)

HEAD = "smollm2-135m-instruct-eagle3"
OUTPUT_LEN = 128
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
SETUPS: dict[str, dict | None] = {
    "none": None,
    "ngram-k3": NGRAM,
    **{
        f"eagle3-k{k}": {"method": "eagle3", "model": HEAD, "num_speculative_tokens": k}
        for k in range(1, 6)
    },
}
DRAFTS = "dynamo_frontend_spec_decode_drafts_total"
K_STEPS = "dynamo_worker_spec_decode_k_steps"
ACCEPTED = "dynamo_frontend_spec_decode_accepted_tokens_total"
DEFAULT_PLOT = ROOT / "docs" / "images" / "spec_decode.png"
# Requests per concurrency level: a few rounds at each level in full runs.
SIZES = {1: 8, 4: 24, 16: 48}
QUICK_SIZES = {1: 3, 4: 8, 16: 16}

# --dynamic: none vs static K vs the profiled schedule.
DYNAMIC_SIZES = {1: 12, 4: 32, 16: 64, 32: 96}  # 3+ rounds at c=32
DYNAMIC_QUICK_SIZES = {1: 3, 4: 8, 16: 16, 32: 32}
DRAFTERS: dict[str, dict] = {  # no K: the profile's schedule gives it
    "eagle3": {"method": "eagle3", "model": HEAD},
    "ngram": {k: v for k, v in NGRAM.items() if k != "num_speculative_tokens"},
}
PROFILED = "eagle3-profiled"
PROFILES_DIR = ROOT / "engine_configs" / "profiles" / "smollm2-135m-instruct"
"""The profiles shipped for the embedded model (the launch presets run them)."""
DEFAULT_PROFILE = PROFILES_DIR / "eagle3.profile.json"
DEFAULT_DYNAMIC_PLOT = ROOT / "docs" / "images" / "spec_dynamic.png"


def dynamic_paths(drafter: str) -> tuple[str, Path, str, Path]:
    """Profiled label, default profile, results file name and default plot for a drafter
    (Eagle3 keeps the plain names)."""
    if drafter == "eagle3":
        return PROFILED, DEFAULT_PROFILE, "spec_dynamic.json", DEFAULT_DYNAMIC_PLOT
    return (f"{drafter}-profiled", PROFILES_DIR / f"{drafter}.profile.json",
            f"spec_dynamic_{drafter}.json",
            DEFAULT_DYNAMIC_PLOT.with_name(f"spec_dynamic_{drafter}.png"))  # fmt: skip


FLOOR = 0.97  # profiled >= FLOOR x the better of none and static K
PROFILE_BATCH_SIZES = "1,2,4,8,16,32"
PROFILE_MAX_K = 3
PROFILE_OUTPUT_TOKENS = 64


@dataclass(frozen=True)
class Point:
    setup: str
    concurrency: int
    requests: int
    output_tokens_per_s: float
    median_tpot_ms: float
    median_ttft_ms: float
    mean_acceptance_length: float | None  # None without speculation
    server_cpu_ms_per_token: float
    p90_tpot_ms: float | None = None
    k_steps: dict[str, int] | None = None  # an adaptive worker's decoding steps at each K


def scenarios(prompts: Path, sizes: dict[int, int]) -> list[Scenario]:
    """One run per concurrency level, `sizes` mapping each level to its request count."""
    return [
        Scenario(f"c{c}", c, n, seed=c, output_len=OUTPUT_LEN, prompts_file=prompts)
        for c, n in sizes.items()
    ]


def write_prompts(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held_out(count)))
    return path


def acceptance(stack: Stack) -> tuple[float, float]:
    return metric_total(stack.metrics_url, DRAFTS), metric_total(stack.metrics_url, ACCEPTED)


def measure_setup(
    label: str,
    spec: dict | None,
    runs: list[Scenario],
    model_dir: Path,
    served: str,
    logs: Path,
    timeout: float,
    *,
    worker_args: Sequence[str] = (),
    engine_flags: Sequence[str] = CPU_ENGINE_FLAGS,
) -> list[Point]:
    """Start one stack for `spec` (None: no speculation), the worker with `engine_flags`
    then `worker_args`, and measure every run of `runs` against it."""
    setup = (label, spec, list(worker_args), False)
    with started_setup(setup, model_dir, served, logs, timeout, engine_flags) as running:
        return [measure_run(running, scenario, model_dir, served, logs) for scenario in runs]


SetupSpec = tuple[str, dict | None, list[str], bool]
"""(label, speculative config or None, worker flags, adapts)."""


@contextlib.contextmanager
def started_setup(
    setup: SetupSpec,
    model_dir: Path,
    served: str,
    logs: Path,
    timeout: float,
    engine_flags: Sequence[str],
) -> Iterator[Served]:
    """One setup's stack (frontend, worker, NATS), up until the block ends; an adaptive
    worker gets a `--system-port` so that its steps at each K can be counted."""
    label, spec, worker_args, adapts = setup
    port = free_port() if adapts else None
    extra = [] if spec is None else ["--speculative-config", json.dumps(spec)]
    extra += [*worker_args, *(["--system-port", str(port)] if port else [])]
    print(f"{label}: {' '.join(extra) or 'no speculation'}", flush=True)
    with dynamo_stack(
        model_dir, served, {"worker": extra}, engine_flags=engine_flags,
        namespace="specbench" + uuid.uuid4().hex[:6], log_dir=logs, timeout=timeout,
    ) as stack:  # fmt: skip
        metrics = f"http://127.0.0.1:{port}/metrics" if port else None
        yield Served(label, spec is not None, stack, metrics)


@dataclass(frozen=True)
class Served:
    """A running stack of one setup, as a run measures it."""

    label: str
    speculates: bool
    stack: Stack
    worker_metrics: str | None  # an adaptive worker's /metrics (its Ks)


def measure_run(
    setup: Served, scenario: Scenario, model_dir: Path, served: str, logs: Path, log_as: str = ""
) -> Point:
    """One `vllm bench serve` run of `scenario` against `setup`, with the drafts, accepted
    tokens and (adaptive) Ks the worker counted meanwhile."""
    started = time.monotonic()
    stack, metrics = setup.stack, setup.worker_metrics
    steps_before = k_steps(metrics) if metrics else None
    drafts, accepted = acceptance(stack)
    cpu_before = stack.cpu_seconds()
    r: RunResult = run_bench_serve(
        stack.base_url, model_dir, served, scenario, logs, log_as or setup.label
    )
    r.server_cpu_s = cpu_delta(cpu_before, stack.cpu_seconds())
    drafts_after, accepted_after = acceptance(stack)
    steps = drafts_after - drafts
    length = 1 + (accepted_after - accepted) / steps if steps else None
    point = Point(
        setup.label, scenario.concurrency, r.completed, round(r.output_throughput, 2),
        round(r.median_tpot_ms, 2), round(r.median_ttft_ms, 1),
        round(length or 1.0, 3) if setup.speculates else None,
        round(r.cpu_ms_per_token, 2), round(r.p90_tpot_ms, 2),
        k_steps_between(steps_before, k_steps(metrics)) if metrics else None,
    )  # fmt: skip
    shown = "-" if point.mean_acceptance_length is None else point.mean_acceptance_length
    print(
        f"  {setup.label} c={scenario.concurrency}: {point.output_tokens_per_s:.1f} tok/s, "
        f"TPOT p50 {point.median_tpot_ms:.1f} ms, acceptance length {shown} "
        f"({time.monotonic() - started:.0f}s)",
        flush=True,
    )
    return point


def mean_point(points: Sequence[Point]) -> Point:
    """One setup's rounds at one concurrency as one point: rates and latencies averaged,
    requests and Ks summed."""
    first = points[0]
    mean = lambda values: round(statistics.fmean(values), 3)  # noqa: E731
    lengths = [p.mean_acceptance_length for p in points if p.mean_acceptance_length is not None]
    ks: dict[str, int] = {}
    for p in points:
        for k, n in (p.k_steps or {}).items():
            ks[k] = ks.get(k, 0) + n
    return Point(
        first.setup, first.concurrency, sum(p.requests for p in points),
        mean([p.output_tokens_per_s for p in points]), mean([p.median_tpot_ms for p in points]),
        mean([p.median_ttft_ms for p in points]), mean(lengths) if lengths else None,
        mean([p.server_cpu_ms_per_token for p in points]),
        mean([p.p90_tpot_ms or 0.0 for p in points]),
        dict(sorted(ks.items(), key=lambda kv: int(kv[0]))) if first.k_steps is not None else None,
    )  # fmt: skip


def k_steps(metrics_url: str) -> dict[str, int]:
    """An adaptive worker's decoding steps at each K so far (`dynamo_worker_spec_decode_k_steps`)."""
    _, text = http_get(metrics_url)
    return {
        sample.labels["k"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == K_STEPS
        for sample in family.samples
        if sample.name == f"{K_STEPS}_total"
    }


def k_steps_between(before: dict[str, int] | None, after: dict[str, int]) -> dict[str, int]:
    """Steps at each K during a run (the Ks it used)."""
    before = before or {}
    grown = {k: n - before.get(k, 0) for k, n in after.items()}
    return {k: n for k, n in sorted(grown.items(), key=lambda kv: int(kv[0])) if n > 0}


def report(points: list[Point]) -> str:
    base = {p.concurrency: p.output_tokens_per_s for p in points if p.setup == "none"}
    rows = []
    for p in points:
        ratio = p.output_tokens_per_s / base[p.concurrency] if base.get(p.concurrency) else 0.0
        rows.append([
            p.setup, str(p.concurrency), f"{p.output_tokens_per_s:.1f}", f"{ratio:.2f}x",
            f"{p.median_tpot_ms:.1f}",
            "-" if p.mean_acceptance_length is None else f"{p.mean_acceptance_length:.2f}",
        ])  # fmt: skip
    headers = ["setup", "c", "output tok/s", "vs none", "TPOT p50 ms", "acceptance length"]
    return format_table(headers, rows)


def concurrency_axis(
    axis: Any, levels: list[int], ylabel: str, title: str, **title_style: Any
) -> None:
    """A panel over the measured concurrency levels (log 2 scale, a tick at each), with its
    labels, title and legend."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(levels, [str(c) for c in levels])
    axis.set_xlabel("concurrency")
    axis.set_ylabel(ylabel)
    axis.set_title(title, **title_style)
    axis.legend(fontsize=8)


def save_plot(fig: Any, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(dict.fromkeys(p.setup for p in points))
    levels = sorted({p.concurrency for p in points})
    base = {p.concurrency: p.output_tokens_per_s for p in points if p.setup == "none"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setup in setups:
        mine = {p.concurrency: p for p in points if p.setup == setup}
        xs = [c for c in levels if c in mine]
        left.plot(xs, [mine[c].output_tokens_per_s / base[c] for c in xs], marker="o",
                  label=setup, linestyle="--" if setup in ("none", "ngram-k3") else "-")  # fmt: skip
    left.axhline(1.0, color="grey", linewidth=0.8)
    concurrency_axis(
        left, levels, "output tokens/s vs no speculation", "Throughput relative to no speculation"
    )
    eagle = [p for p in points if p.setup.startswith("eagle3-k")]
    for c in levels:
        mine = sorted(
            (int(p.setup.removeprefix("eagle3-k")), p) for p in eagle if p.concurrency == c
        )
        if mine:
            right.plot([k for k, _ in mine], [p.mean_acceptance_length for _, p in mine],
                       marker="o", label=f"c={c}")  # fmt: skip
    right.set_xticks(sorted({int(p.setup.removeprefix("eagle3-k")) for p in eagle}))
    right.set_xlabel("K (draft tokens per step)")
    right.set_ylabel("mean acceptance length (tokens/step)")
    right.set_title("Eagle3 head: acceptance by K")
    right.legend(fontsize=8)
    save_plot(fig, path)


# --------------------------------------------------------------------------- --dynamic


def with_max_num_seqs(flags: Sequence[str], count: int) -> list[str]:
    """`flags` with `--max-num-seqs` raised to at least `count` (added when absent)."""
    out = list(flags)
    if "--max-num-seqs" in out:
        i = out.index("--max-num-seqs")
        out[i + 1] = str(max(int(out[i + 1]), count))
    else:
        out += ["--max-num-seqs", str(count)]
    return out


def profiler_argv(model: str, path: Path, spec: dict | None = None) -> list[str]:
    """The command line that profiles `spec` (default: the Eagle3 head) on `model` and
    writes `path`."""
    return [
        sys.executable, "-m", "dynamo.vllm.profile_spec",
        "--model", model,
        "--speculative-config", json.dumps(spec or DRAFTERS["eagle3"]),
        "--batch-sizes", PROFILE_BATCH_SIZES,
        "--max-k", str(PROFILE_MAX_K),
        "--output-tokens", str(PROFILE_OUTPUT_TOKENS),
        "--max-batch-size", str(max(DYNAMIC_SIZES)),
        "--out", str(path),
    ]  # fmt: skip


def make_profile(model: str, path: Path, spec: dict | None = None) -> None:
    """Run the profiler with its output streamed to ours; raise `BenchError` if it fails."""
    argv = profiler_argv(model, path, spec)
    print(f"profiling the speculation schedule into {path}:\n  {' '.join(argv)}", flush=True)
    started = time.monotonic()
    before = path.stat().st_mtime_ns if path.exists() else None
    proc = subprocess.run(argv, env=child_env(), cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise BenchError(f"the profiler exited with {proc.returncode} (its output is above)")
    if not path.exists() or path.stat().st_mtime_ns == before:
        raise BenchError(f"the profiler exited with 0 but did not write {path}")
    print(f"profile written in {time.monotonic() - started:.0f}s", flush=True)


def read_schedule(path: Path) -> tuple[list[list[int]], list[float] | None]:
    """The profile's `schedule` ([[first batch, last batch, K], ...]) and its
    `acceptance_per_position` (None when absent)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read the speculation profile {path}: {exc}") from exc
    schedule = data.get("schedule") if isinstance(data, dict) else None
    if (
        not isinstance(schedule, list)
        or not schedule
        or not all(
            isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) for v in r)
            for r in schedule
        )
    ):
        raise BenchError(f"{path} has no schedule of [first, last, K] ranges: {schedule!r}")
    return schedule, data.get("acceptance_per_position")


@dataclass(frozen=True)
class Verdict:
    """The target at one concurrency: the profiled schedule against the better of no
    speculation and static K, and against static K where static K loses to none."""

    concurrency: int
    schedule_k: int | None  # the K the schedule runs at this batch size
    none: float  # output tokens/s
    static: float
    profiled: float
    ratio: float  # profiled / max(none, static)
    meets_floor: bool  # ratio >= FLOOR
    static_loses: bool  # static < none
    beats_static: bool | None  # profiled > static, asked only where static loses
    passed: bool


def verdicts(
    points: Sequence[Point],
    static_label: str,
    schedule: list[list[int]] | None = None,
    floor: float = FLOOR,
    profiled_label: str = PROFILED,
) -> list[Verdict]:
    """One verdict per concurrency measured for all of none, `static_label` and the
    profiled setup."""
    by = {(p.setup, p.concurrency): p.output_tokens_per_s for p in points}
    levels = sorted({p.concurrency for p in points})
    out = []
    for c in levels:
        missing = [s for s in ("none", static_label, profiled_label) if (s, c) not in by]
        if missing:
            raise BenchError(f"c={c}: no numbers for {missing}; every verdict needs all three")
        none, static, profiled = by["none", c], by[static_label, c], by[profiled_label, c]
        best = max(none, static)
        ratio = profiled / best if best > 0 else 0.0
        meets = ratio >= floor
        loses = static < none
        beats = profiled > static if loses else None
        out.append(
            Verdict(
                c, None if schedule is None else k_for_batch(schedule, c), none, static,
                profiled, round(ratio, 3), meets, loses, beats, meets and beats is not False,
            )
        )  # fmt: skip
    return out


def verdict_lines(results: Sequence[Verdict], static_label: str, floor: float = FLOOR) -> str:
    """A line per concurrency and the overall PASS/MISS line."""
    yes = {True: "yes", False: "NO"}
    lines = []
    for v in results:
        k = "" if v.schedule_k is None else f" (schedule K={v.schedule_k})"
        better = "none" if v.none >= v.static else static_label
        line = (
            f"c={v.concurrency}{k}: profiled {v.profiled:.1f} tok/s = {v.ratio:.3f}x the better "
            f"({better}) of none {v.none:.1f} and {static_label} {v.static:.1f}, "
            f">= {floor}: {yes[v.meets_floor]}; "
        )
        if v.static_loses:
            line += f"{static_label} loses to none, profiled beats it: {yes[bool(v.beats_static)]}"
        else:
            line += f"{static_label} does not lose to none"
        lines.append(f"{line} -> {'ok' if v.passed else 'MISS'}")
    missed = [str(v.concurrency) for v in results if not v.passed]
    levels = ",".join(str(v.concurrency) for v in results)
    if results and not missed:
        lines.append(
            f"overall: PASS (profiled >= {floor}x the better of none and {static_label} at "
            f"c={levels}, and beats {static_label} wherever it loses to none)"
        )
    else:
        lines.append(f"overall: MISS at c={','.join(missed) or '(nothing measured)'}")
    return "\n".join(lines)


def plot_dynamic(
    points: Sequence[Point],
    schedule: list[list[int]],
    static_label: str,
    path: Path,
    profiled_label: str = PROFILED,
) -> None:
    """Output tokens/s (left) and median TPOT (right) by concurrency, one curve per setup,
    the profiled points labelled with the K the schedule runs there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({p.concurrency for p in points})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"none": "--", static_label: "-.", profiled_label: "-"}
    for setup in ("none", static_label, profiled_label):
        mine = {p.concurrency: p for p in points if p.setup == setup}
        xs = [c for c in levels if c in mine]
        for axis, value in ((left, "output_tokens_per_s"), (right, "median_tpot_ms")):
            ys = [getattr(mine[c], value) for c in xs]
            axis.plot(xs, ys, marker="o", linestyle=styles[setup], label=setup)
            if setup == profiled_label:
                for x, y in zip(xs, ys, strict=True):
                    axis.annotate(f"K={k_for_batch(schedule, x)}", (x, y),
                                  textcoords="offset points", xytext=(0, -13), ha="center",
                                  fontsize=8)  # fmt: skip
    for axis, ylabel, title in (
        (left, "output tokens/s", "Throughput"),
        (right, "median TPOT (ms)", "Time per output token"),
    ):
        concurrency_axis(
            axis,
            levels,
            ylabel,
            f"{title}: none vs {static_label} vs profiled schedule",
            fontsize=10,
        )
    save_plot(fig, path)


def dynamic_body(args: argparse.Namespace, model_dir: Path, served: str) -> int:
    """--dynamic: profile if needed, measure the three setups, print table and verdicts."""
    drafter = DRAFTERS[args.drafter]
    profiled_label, default_profile, results_file, default_plot = dynamic_paths(args.drafter)
    profile = Path(args.profile or default_profile).resolve()
    if args.reprofile or not profile.exists():
        make_profile(args.model, profile, drafter)
    schedule, acceptance = read_schedule(profile)
    sizes = DYNAMIC_QUICK_SIZES if args.quick else DYNAMIC_SIZES
    print(f"speculation profile {profile}: schedule {schedule}, acceptance per position "
          f"{acceptance}")  # fmt: skip
    print("schedule K by concurrency: "
          + ", ".join(f"c={c}: K={k_for_batch(schedule, c)}" for c in sizes))  # fmt: skip
    static_label = f"{args.drafter}-k{args.static_k}"
    setups: list[tuple[str, dict | None, list[str]]] = [
        ("none", None, []),
        (static_label, {**drafter, "num_speculative_tokens": args.static_k}, []),
        (profiled_label, drafter, ["--speculation-profile", str(profile)]),
    ]
    flags = with_max_num_seqs(CPU_ENGINE_FLAGS, max(sizes))
    points: list[Point] = []
    with log_dir("spec-dynamic", keep=args.keep_logs) as logs:
        runs = scenarios(write_prompts(logs / "prompts.jsonl", max(64, *sizes.values())), sizes)
        print(f"model {served}; held-out prompts, {OUTPUT_LEN} tokens out; engine flags "
              f"{' '.join(flags)}; logs in {logs}")  # fmt: skip
        warn_if_busy()
        for label, spec, worker_args in setups:
            points += measure_setup(
                label, spec, runs, model_dir, served, logs, args.start_timeout,
                worker_args=worker_args, engine_flags=flags,
            )  # fmt: skip
    results = verdicts(points, static_label, schedule, profiled_label=profiled_label)
    print(f"dynamic speculation: none vs {static_label} vs the profiled schedule "
          "(output tokens/s ratios vs none, same prompts, one run)")  # fmt: skip
    print(report(points))
    print(verdict_lines(results, static_label))
    if args.quick:
        print("(quick run: too few requests per level to judge a 3% margin; run without --quick)")
    save_report(
        results_path(args, results_file),
        {
            "drafter": drafter,
            "points": [asdict(p) for p in points],
            "static_k": args.static_k,
            "profile": str(profile),
            "schedule": schedule,
            "acceptance_per_position": acceptance,
            "schedule_k": {str(c): k_for_batch(schedule, c) for c in sizes},
            "floor": FLOOR,
            "verdicts": [asdict(v) for v in results],
            "passed": all(v.passed for v in results),
            "host": host_info(),
        },
    )
    target = args.plot or (None if args.quick else default_plot)
    if target is not None:
        plot_dynamic(points, schedule, static_label, target, profiled_label)
    return 0


# --------------------------------------------------------------------------- --adaptive

ADAPTIVE_SIZES = {1: 12, 4: 32, 16: 64, 32: 96, 64: 128}
ADAPTIVE_QUICK_SIZES = {1: 3, 4: 8, 16: 16, 32: 32, 64: 64}
ADAPTIVE_FLOOR = 0.98  # adaptive >= this x no speculation, and x the best of the others
EAGLE3_C1_TARGET = 1.3  # Eagle3 adaptive vs no speculation at one request at a time
PROMPT_DIR = ROOT / "benchmarks" / "prompts"
WORKLOADS = {
    "chat": None,  # the Eagle3 tool's held-out prompts (what the profiles were measured on)
    "repeat": PROMPT_DIR / "repeat_edit.jsonl",
    "hard": PROMPT_DIR / "hard.jsonl",
}


def workload_prompts(workload: str, path: Path, count: int) -> Path:
    """`count` prompts of `workload` written to `path` (a set's prompts repeat in order
    when it has fewer)."""
    source = WORKLOADS[workload]
    if source is None:
        return write_prompts(path, count)
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    path.write_text("".join(lines[i % len(lines)] + "\n" for i in range(count)))
    return path


@dataclass(frozen=True)
class AdaptiveVerdict:
    """Adaptive against no speculation and against the best of the other three."""

    drafter: str
    concurrency: int
    tokens_per_s: dict[str, float]  # by setup
    vs_none: float
    vs_best_other: float
    target_c1: float | None  # Eagle3's own target at c=1 (None elsewhere)
    passed: bool


ADAPTIVE_KINDS = ("static", "profiled", "adaptive")
"""What --adaptive measures per drafter, beside no speculation (always measured: every ratio
is taken against it); `--setups` picks some of them."""


def setup_labels(drafter: str, static_k: int) -> tuple[str, str, str]:
    """(static, profiled, adaptive) setup names of `drafter`."""
    return f"{drafter}-k{static_k}", f"{drafter}-profiled", f"{drafter}-adaptive"


def adaptive_verdicts(
    points: Sequence[Point], drafter: str, static_k: int, floor: float = ADAPTIVE_FLOOR
) -> list[AdaptiveVerdict]:
    """One verdict per concurrency where all four setups were measured."""
    static, profiled, adaptive = setup_labels(drafter, static_k)
    by = {(p.setup, p.concurrency): p.output_tokens_per_s for p in points}
    out = []
    for c in sorted({p.concurrency for p in points}):
        rates = {s: by.get((s, c)) for s in ("none", static, profiled, adaptive)}
        if any(v is None for v in rates.values()):
            continue
        known = {s: float(v) for s, v in rates.items() if v is not None}
        vs_none = known[adaptive] / known["none"] if known["none"] else 0.0
        best = max(known["none"], known[static], known[profiled])
        vs_best = known[adaptive] / best if best else 0.0
        target = EAGLE3_C1_TARGET if drafter == "eagle3" and c == 1 else None
        passed = vs_none >= floor and vs_best >= floor and (target is None or vs_none >= target)
        out.append(
            AdaptiveVerdict(drafter, c, known, round(vs_none, 3), round(vs_best, 3), target, passed)
        )
    return out


def adaptive_lines(results: Sequence[AdaptiveVerdict], floor: float = ADAPTIVE_FLOOR) -> str:
    """A line per drafter and concurrency, then the overall PASS/MISS line."""
    lines = []
    for v in results:
        target = f", >= {v.target_c1}x none at c=1" if v.target_c1 else ""
        lines.append(
            f"{v.drafter} c={v.concurrency}: adaptive {v.vs_none:.3f}x none, {v.vs_best_other:.3f}x "
            f"the best of none/static/profiled (targets >= {floor}{target}) -> "
            f"{'ok' if v.passed else 'MISS'}"
        )
    missed = [f"{v.drafter} c={v.concurrency}" for v in results if not v.passed]
    lines.append("overall: " + ("PASS" if results and not missed else f"MISS at {missed}"))
    return "\n".join(lines)


def adaptive_vs_profiled(points: Sequence[Point], drafters: Sequence[str], static_k: int) -> str:
    """Adaptive against the profiled schedule, per drafter and concurrency (the comparison
    on a workload unlike the profile's), where both were measured."""
    by = {(p.setup, p.concurrency): p.output_tokens_per_s for p in points}
    lines = []
    for drafter in drafters:
        _, profiled, adaptive = setup_labels(drafter, static_k)
        for c in sorted({p.concurrency for p in points}):
            pair = by.get((adaptive, c)), by.get((profiled, c))
            if pair[0] is not None and pair[1]:
                lines.append(f"{drafter} c={c}: adaptive {pair[0] / pair[1]:.3f}x profiled")
    return "\n".join(lines)


def k_shares(k_steps: dict[str, int]) -> str:
    """An adaptive worker's steps at each K as shares ("0:90% 1:10%"), "-" for none."""
    total = sum(k_steps.values()) or 1
    return " ".join(f"{k}:{n / total:.0%}" for k, n in k_steps.items()) or "-"


def k_used(point: Point, schedules: dict[str, list[list[int]]], static_k: int) -> str:
    """What K a setup ran at this concurrency: adaptive, the share of steps at each K."""
    if point.setup == "none":
        return "-"
    if point.k_steps is not None:
        return k_shares(point.k_steps)
    drafter = point.setup.split("-")[0]
    if point.setup.endswith("-profiled"):
        return f"K={k_for_batch(schedules[drafter], point.concurrency)}"
    return f"K={static_k}"


def adaptive_table(
    points: Sequence[Point], schedules: dict[str, list[list[int]]], static_k: int
) -> str:
    base = {p.concurrency: p.output_tokens_per_s for p in points if p.setup == "none"}
    rows = []
    for p in sorted(points, key=lambda p: (p.concurrency, p.setup)):
        ratio = p.output_tokens_per_s / base[p.concurrency] if base.get(p.concurrency) else 0.0
        rows.append([
            p.setup, str(p.concurrency), f"{p.output_tokens_per_s:.1f}", f"{ratio:.2f}x",
            f"{p.median_tpot_ms:.1f}", f"{p.p90_tpot_ms or float('nan'):.1f}",
            "-" if p.mean_acceptance_length is None else f"{p.mean_acceptance_length:.2f}",
            k_used(p, schedules, static_k),
        ])  # fmt: skip
    headers = ["setup", "c", "output tok/s", "vs none", "TPOT p50", "TPOT p90",
               "acceptance length", "K used"]  # fmt: skip
    return format_table(headers, rows)


def plot_adaptive(groups: dict[str, list[Point]], path: Path) -> None:
    """Output tokens/s relative to no speculation by concurrency, one panel per drafter
    (each against the no-speculation engine measured beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(groups)
    fig, axes = plt.subplots(1, len(drafters), figsize=(5.5 * len(drafters), 4.2), squeeze=False)
    for axis, drafter in zip(axes[0], drafters, strict=True):
        points = groups[drafter]
        levels = sorted({p.concurrency for p in points})
        base = {p.concurrency: p.output_tokens_per_s for p in points if p.setup == "none"}
        setups = [s for s in dict.fromkeys(p.setup for p in points) if s.startswith(drafter)]
        for setup in setups:
            mine = {p.concurrency: p for p in points if p.setup == setup}
            xs = [c for c in levels if c in mine and base.get(c)]
            style = "-" if setup.endswith("adaptive") else "--"
            axis.plot(xs, [mine[c].output_tokens_per_s / base[c] for c in xs], marker="o",
                      linestyle=style, label=setup)  # fmt: skip
        axis.axhline(1.0, color="grey", linewidth=0.8, label="no speculation")
        axis.axhline(ADAPTIVE_FLOOR, color="grey", linewidth=0.6, linestyle=":")
        concurrency_axis(
            axis,
            levels,
            "output tokens/s vs no speculation",
            f"{drafter}: static, profiled and adaptive K",
            fontsize=10,
        )
    save_plot(fig, path)


ADAPTIVE_ROUNDS = 2
"""Rounds per concurrency in --adaptive: the setups in order, then in reverse (A B C D D C B
A), each round with half the requests, so that a host that slows down or speeds up during
the run weighs on every setup alike."""


def measure_interleaved(
    setups: Sequence[SetupSpec],
    runs: Sequence[Scenario],
    model_dir: Path,
    served: str,
    logs: Path,
    timeout: float,
    flags: Sequence[str],
    rounds: int = ADAPTIVE_ROUNDS,
) -> list[Point]:
    """Every setup's stack started at once and kept up; then, per concurrency, the setups
    measured one after the other in `rounds` rounds of alternating order, seconds
    apart instead of many minutes (a sequential run once saw no speculation serve 383
    tokens/s at c=32 at its start and about 320 half an hour later)."""
    served_setups: list[Served] = []
    with contextlib.ExitStack() as running:
        for setup in setups:
            own_logs = logs / setup[0]  # the stacks are up together: one log folder each
            own_logs.mkdir(exist_ok=True)
            served_setups.append(running.enter_context(
                started_setup(setup, model_dir, served, own_logs, timeout, flags)
            ))  # fmt: skip
        return measure_rounds(served_setups, runs, model_dir, served, logs, rounds)


def measure_rounds(
    served_setups: Sequence[Served],
    runs: Sequence[Scenario],
    model_dir: Path,
    served: str,
    logs: Path,
    rounds: int = ADAPTIVE_ROUNDS,
) -> list[Point]:
    """Stacks that are all up: each warmed up, then per concurrency measured one after the
    other in `rounds` rounds of alternating order; one point per setup and concurrency."""
    warm_up(served_setups, runs, model_dir, served, logs)
    points = []
    for scenario in runs:
        per_round = max(scenario.concurrency, scenario.num_prompts // rounds)
        measured: dict[str, list[Point]] = {}
        for round_index in range(rounds):
            order = served_setups if round_index % 2 == 0 else served_setups[::-1]
            part = dataclasses.replace(
                scenario, num_prompts=per_round, seed=scenario.seed * 100 + round_index
            )
            for setup in order:
                point = measure_run(setup, part, model_dir, served, logs,
                                    f"{setup.label}-r{round_index}")  # fmt: skip
                measured.setdefault(setup.label, []).append(point)
        points += [mean_point(measured[setup.label]) for setup in served_setups]
    return points


def warm_up(
    setups: Sequence[Served], runs: Sequence[Scenario], model_dir: Path, served: str, logs: Path
) -> None:
    """One unmeasured run per stack at the highest concurrency, before any measured one:
    a stack's first requests run slower (measured: 229 then 294 tokens/s at c=16 for the
    same setup), which would otherwise weigh on the first round alone."""
    top = max(runs, key=lambda scenario: scenario.concurrency)
    scenario = dataclasses.replace(
        top, name=f"warmup-{top.name}", num_prompts=top.concurrency, seed=top.seed * 100 + 99
    )
    for setup in setups:
        started = time.monotonic()
        run_bench_serve(setup.stack.base_url, model_dir, served, scenario, logs, setup.label)
        print(f"  {setup.label}: warmed up with {scenario.num_prompts} requests at "
              f"c={scenario.concurrency} ({time.monotonic() - started:.0f}s)", flush=True)  # fmt: skip


def adaptive_body(args: argparse.Namespace, model_dir: Path, served: str) -> int:
    """--adaptive: per drafter, no speculation beside static K, the profiled schedule and the
    adaptive scheduler, interleaved at every concurrency; table, verdicts, JSON and PNG."""
    drafters = sorted(DRAFTERS) if args.drafter == "both" else [args.drafter]
    kinds = set(args.setups.split(",")) if args.setups else set(ADAPTIVE_KINDS)
    sizes = ADAPTIVE_QUICK_SIZES if args.quick else ADAPTIVE_SIZES
    if args.concurrency:
        sizes = {c: sizes[c] for c in args.concurrency}
    partial = args.quick or bool(args.concurrency)
    flags = with_max_num_seqs(CPU_ENGINE_FLAGS, max(sizes))
    schedules: dict[str, list[list[int]]] = {}
    groups: dict[str, list[Point]] = {}
    with log_dir("spec-adaptive", keep=args.keep_logs) as logs:
        prompts = workload_prompts(args.workload, logs / "prompts.jsonl", max(64, *sizes.values()))
        runs = scenarios(prompts, sizes)
        print(f"model {served}; workload {args.workload}; {OUTPUT_LEN} tokens out; engine flags "
              f"{' '.join(flags)}; {args.rounds} interleaved rounds per level; "
              f"logs in {logs}")  # fmt: skip
        warn_if_busy()
        for drafter in drafters:
            profile = dynamic_paths(drafter)[1]
            if args.reprofile or not profile.exists():
                make_profile(args.model, profile, DRAFTERS[drafter])
            schedules[drafter] = read_schedule(profile)[0]
            setups = drafter_setups(drafter, profile, args.static_k, kinds)
            groups[drafter] = measure_interleaved(
                setups, runs, model_dir, served, logs, args.start_timeout, flags, args.rounds
            )
    results = [v for d in drafters for v in adaptive_verdicts(groups[d], d, args.static_k)]
    print(f"adaptive speculation, workload {args.workload} (ratios vs none measured beside "
          "each drafter's setups, same prompts, one run)")  # fmt: skip
    for drafter in drafters:
        print(adaptive_table(groups[drafter], schedules, args.static_k))
    if results:
        print(adaptive_lines(results))
    everything = [p for d in drafters for p in groups[d]]
    print(adaptive_vs_profiled(everything, drafters, args.static_k))
    if args.quick:
        print("(quick run: too few requests per level to judge a 2% margin; run without --quick)")
    suffix = "" if args.workload == "chat" else f"_{args.workload}"
    save_report(
        None
        if partial and args.json is None
        else results_path(args, f"spec_adaptive{suffix}.json"),
        {
            "workload": args.workload,
            "rounds": args.rounds,
            "points": {d: [asdict(p) for p in groups[d]] for d in drafters},
            "static_k": args.static_k,
            "schedules": schedules,
            "floor": ADAPTIVE_FLOOR,
            "verdicts": [asdict(v) for v in results],
            "passed": bool(results) and all(v.passed for v in results),
            "host": host_info(),
        },
    )
    target = args.plot or (
        None if partial else ROOT / "docs" / "images" / f"spec_adaptive{suffix}.png"
    )
    if target is not None:
        plot_adaptive(groups, target)
    return 0


def drafter_setups(drafter: str, profile: Path, static_k: int, kinds: set[str]) -> list[SetupSpec]:
    """No speculation, then the chosen kinds of `drafter`'s setups."""
    static, profiled, adaptive = setup_labels(drafter, static_k)
    with_profile = ["--speculation-profile", str(profile)]
    by_kind: dict[str, SetupSpec] = {
        "static": (static, {**DRAFTERS[drafter], "num_speculative_tokens": static_k}, [], False),
        "profiled": (profiled, DRAFTERS[drafter], with_profile, False),
        "adaptive": (adaptive, DRAFTERS[drafter],
                     [*with_profile, "--speculation-adapt", "full"], True),
    }  # fmt: skip
    return [("none", None, [], False), *(v for k, v in by_kind.items() if k in kinds)]


def main() -> int:
    parser = serving_parser(__doc__, "spec_decode.json")
    parser.add_argument(
        "--setups",
        default=None,
        help=f"comma-separated subset of {list(SETUPS)} (default: all; not with --dynamic); "
        f"with --adaptive, of {list(ADAPTIVE_KINDS)} (each for every drafter, beside no "
        "speculation; e.g. profiled,adaptive for a workload unlike the profile's)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        help=f"PNG path (full runs: {DEFAULT_PLOT}; with --dynamic {DEFAULT_DYNAMIC_PLOT})",
    )
    dynamic = parser.add_argument_group("--dynamic: none vs static K vs the profiled schedule")
    dynamic.add_argument(
        "--dynamic",
        action="store_true",
        help="measure no speculation, the drafter with --static-k and with the profile's "
        f"K schedule at concurrency {', '.join(map(str, DYNAMIC_SIZES))} (full runs write "
        "benchmarks/results/spec_dynamic.json unless --json says otherwise)",
    )
    dynamic.add_argument(
        "--adaptive",
        action="store_true",
        help="measure no speculation, then for each drafter a static K (--static-k), the "
        "profile's schedule and --speculation-adapt full (the same profile), at concurrency "
        f"{', '.join(map(str, ADAPTIVE_SIZES))}: tokens/s, TPOT p50/p90, acceptance length "
        "and the Ks used (full runs write benchmarks/results/spec_adaptive[_WORKLOAD].json "
        "and docs/images/spec_adaptive[_WORKLOAD].png)",
    )
    dynamic.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="chat",
        help="with --adaptive: the prompts served: chat (the held-out prompts the profiles "
        "were measured on), repeat (benchmarks/prompts/repeat_edit.jsonl: repeat or edit a "
        "given passage; drafts accept far more) or hard (benchmarks/prompts/hard.jsonl: "
        "random-looking answers; drafts accept little) (default chat)",
    )
    dynamic.add_argument(
        "--rounds",
        type=int,
        default=ADAPTIVE_ROUNDS,
        help="with --adaptive: interleaved rounds per concurrency, alternating the order of "
        "the setups; the requests of a level are split between them, so more rounds weigh "
        "the host's drift more evenly (default %(default)s; an even number keeps the orders "
        "balanced)",
    )
    dynamic.add_argument(
        "--concurrency",
        type=levels_type(ADAPTIVE_SIZES),
        default=None,
        help="with --adaptive: comma-separated subset of the levels "
        f"{','.join(map(str, ADAPTIVE_SIZES))} to measure (e.g. 16,32 to look at one "
        "regime); a partial run writes JSON only with --json and no plot unless --plot",
    )
    dynamic.add_argument(
        "--drafter",
        choices=[*sorted(DRAFTERS), "both"],
        default=None,
        help="what drafts in the static, profiled (and adaptive) setups: the shipped Eagle3 "
        "head, n-gram prompt lookup (with --dynamic, results and plot get a _ngram suffix), "
        "or both, one after the other (--adaptive only) (default: eagle3; both with "
        "--adaptive)",
    )
    dynamic.add_argument(
        "--static-k", type=int, default=2, help="K of the static setup (default 2)"
    )
    dynamic.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="speculation profile the profiled setup runs; made with dynamo.vllm.profile_spec "
        f"when missing (default: {DEFAULT_PROFILE.relative_to(ROOT)}, "
        "ngram.profile.json beside it with --drafter ngram)",
    )
    dynamic.add_argument(
        "--reprofile", action="store_true", help="re-run the profiler even if --profile exists"
    )
    args = parser.parse_args()
    if args.drafter is None:
        args.drafter = "both" if args.adaptive else "eagle3"
    if args.adaptive and args.dynamic:
        parser.error("--adaptive and --dynamic are two different comparisons; choose one")
    if args.drafter == "both" and not args.adaptive:
        parser.error("--drafter both only applies to --adaptive")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.concurrency and not args.adaptive:
        parser.error("--concurrency only applies to --adaptive")
    if args.workload != "chat" and not args.adaptive:
        parser.error("--workload only applies to --adaptive")
    if args.adaptive:
        unknown = set((args.setups or "adaptive").split(",")) - set(ADAPTIVE_KINDS)
        if unknown:
            parser.error(f"--setups with --adaptive: choose from {list(ADAPTIVE_KINDS)}, "
                         f"not {sorted(unknown)}")  # fmt: skip
        if args.static_k < 1:
            parser.error(f"--static-k must be at least 1, got {args.static_k}")
    elif args.dynamic:
        if args.setups is not None:
            parser.error("--setups does not apply to --dynamic (it runs none, static K, profiled)")
        if args.static_k < 1:
            parser.error(f"--static-k must be at least 1, got {args.static_k}")
    elif args.reprofile:
        parser.error("--reprofile only applies to --dynamic and --adaptive")
    chosen = [s.strip() for s in (args.setups or ",".join(SETUPS)).split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SETUPS]
    if unknown and not args.adaptive:
        parser.error(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    model_dir, served = resolve_model_arg(args.model)
    if args.adaptive:
        return guarded(lambda: adaptive_body(args, model_dir, served))
    if args.dynamic:
        return guarded(lambda: dynamic_body(args, model_dir, served))

    def body() -> int:
        points: list[Point] = []
        with log_dir("spec-bench", keep=args.keep_logs) as logs:
            sizes = QUICK_SIZES if args.quick else SIZES
            runs = scenarios(write_prompts(logs / "prompts.jsonl", 64), sizes)
            print(f"model {served}; held-out prompts, {OUTPUT_LEN} tokens out; logs in {logs}")
            warn_if_busy()
            for label in chosen:
                points += measure_setup(
                    label, SETUPS[label], runs, model_dir, served, logs, args.start_timeout
                )
        if not any(p.setup == "none" for p in points):
            raise BenchError("the 'none' setup is the baseline of every ratio; include it")
        print("speculative decoding vs none (output tokens/s ratios, same prompts, one run)")
        print(report(points))
        save_report(results_path(args, "spec_decode.json"),
                    {"points": [asdict(p) for p in points], "host": host_info()})  # fmt: skip
        target = args.plot or (None if args.quick else DEFAULT_PLOT)
        if target is not None:
            plot(points, target)
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
