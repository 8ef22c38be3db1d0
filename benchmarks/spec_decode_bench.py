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

Full runs write benchmarks/results/spec_decode.json and docs/images/spec_decode.png
(`--json` / `--plot` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from dynamo.testing.http import metric_total
from dynamo.vllm.eagle3_training.prompts import held_out
from harness import (
    CPU_ENGINE_FLAGS,
    ROOT,
    BenchError,
    RunResult,
    Scenario,
    Stack,
    add_serving_args,
    cpu_delta,
    dynamo_stack,
    format_table,
    guarded,
    host_info,
    log_dir,
    resolve_model_arg,
    results_path,
    run_bench_serve,
    save_report,
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
ACCEPTED = "dynamo_frontend_spec_decode_accepted_tokens_total"
DEFAULT_PLOT = ROOT / "docs" / "images" / "spec_decode.png"


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


def scenarios(prompts: Path, quick: bool) -> list[Scenario]:
    sizes = {1: 3, 4: 8, 16: 16} if quick else {1: 8, 4: 24, 16: 48}
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
) -> list[Point]:
    extra = [] if spec is None else ["--speculative-config", json.dumps(spec)]
    print(f"{label}: {json.dumps(spec) if spec else 'no speculation'}", flush=True)
    points = []
    with dynamo_stack(
        model_dir, served, {"worker": extra},
        engine_flags=CPU_ENGINE_FLAGS, namespace="specbench" + uuid.uuid4().hex[:6],
        log_dir=logs, timeout=timeout,
    ) as stack:  # fmt: skip
        for scenario in runs:
            started = time.monotonic()
            drafts, accepted = acceptance(stack)
            cpu_before = stack.cpu_seconds()
            r: RunResult = run_bench_serve(stack.base_url, model_dir, served, scenario, logs, label)
            r.server_cpu_s = cpu_delta(cpu_before, stack.cpu_seconds())
            drafts_after, accepted_after = acceptance(stack)
            steps = drafts_after - drafts
            length = 1 + (accepted_after - accepted) / steps if steps else None
            point = Point(
                label, scenario.concurrency, r.completed, round(r.output_throughput, 2),
                round(r.median_tpot_ms, 2), round(r.median_ttft_ms, 1),
                None if spec is None else round(length or 1.0, 3),
                round(r.cpu_ms_per_token, 2),
            )  # fmt: skip
            points.append(point)
            shown = "-" if point.mean_acceptance_length is None else point.mean_acceptance_length
            print(
                f"  c={scenario.concurrency}: {point.output_tokens_per_s:.1f} tok/s, TPOT p50 "
                f"{point.median_tpot_ms:.1f} ms, acceptance length {shown} "
                f"({time.monotonic() - started:.0f}s)",
                flush=True,
            )
    return points


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
    left.set_xscale("log", base=2)
    left.set_xticks(levels, [str(c) for c in levels])
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s vs no speculation")
    left.set_title("Throughput relative to no speculation")
    left.legend(fontsize=8)
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_serving_args(parser, "spec_decode.json")
    parser.add_argument(
        "--setups", default=",".join(SETUPS), help=f"comma-separated subset of {list(SETUPS)}"
    )
    parser.add_argument("--plot", type=Path, help=f"PNG path (full runs: {DEFAULT_PLOT})")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SETUPS]
    if unknown:
        parser.error(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    model_dir, served = resolve_model_arg(args.model)

    def body() -> int:
        points: list[Point] = []
        with log_dir("spec-bench", keep=args.keep_logs) as logs:
            runs = scenarios(write_prompts(logs / "prompts.jsonl", 64), args.quick)
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
