"""The launch presets as a user runs them: `make run`'s n-gram and `SPEC=eagle3` against
`launch/agg.sh` (no speculation).

Each setup is the launch script itself (`launch/agg.sh`, `launch/agg_spec_decoding.sh` with
SPEC=ngram, the default of `make run`, and with SPEC=eagle3), with its own nats-server, on
a free port, with the flags and environment it gives the worker (adaptive speculation from
the shipped profile, `VLLM_CPU_KVCACHE_SPACE=2`, vLLM's default batch limits): nothing of
the benchmark's own engine flags. All three are up at once and measured interleaved (the
setups one after the other, the order reversed every round) on the held-out chat prompts
of the Eagle3 tool, greedy, 128 tokens out, at one request at a time and at 32 concurrent
requests. Per setup and level: output tokens/s and its ratio to no speculation, TPOT, the
acceptance length and the Ks the adaptive worker used.

Targets (issue 30): n-gram >= 1.1x no speculation at c=1, Eagle3 >= 1.2x; both >= 0.98x
at c=32.

Usage:

    .venv/bin/python benchmarks/presets_bench.py             # about 12 minutes
    .venv/bin/python benchmarks/presets_bench.py --quick     # smoke run
    .venv/bin/python benchmarks/presets_bench.py --presets ngram --rounds 6

Full runs write benchmarks/results/spec_presets.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dynamo.runtime.ports import free_port
from harness import (
    format_table,
    guarded,
    host_info,
    launch_stack,
    levels_type,
    log_dir,
    resolve_model_arg,
    results_path,
    save_report,
    serving_parser,
    warn_if_busy,
)
from spec_decode_bench import (
    OUTPUT_LEN,
    Point,
    Served,
    k_shares,
    measure_rounds,
    scenarios,
    write_prompts,
)

PRESETS = ("ngram", "eagle3")
SIZES = {1: 16, 32: 128}
QUICK_SIZES = {1: 2, 32: 32}
DEFAULT_ROUNDS = 4
TARGETS: dict[tuple[str, int], float] = {
    ("ngram", 1): 1.1,
    ("ngram", 32): 0.98,
    ("eagle3", 1): 1.2,
    ("eagle3", 32): 0.98,
}
"""(preset, concurrency) -> the least output tokens/s it must serve, as a multiple of
launch/agg.sh's at the same concurrency."""


@dataclass(frozen=True)
class PresetVerdict:
    preset: str
    concurrency: int
    vs_none: float
    target: float

    @property
    def passed(self) -> bool:
        return self.vs_none >= self.target


@contextlib.contextmanager
def preset_stack(
    preset: str | None, model: str, served: str, logs: Path, timeout: float
) -> Iterator[Served]:
    """`launch/agg.sh` (preset None) or `launch/agg_spec_decoding.sh` with SPEC=`preset`,
    serving `model`, its worker with a `--system-port` (the Ks it runs) when it speculates."""
    label = preset or "none"
    own_logs = logs / label
    own_logs.mkdir(exist_ok=True)
    if preset is None:
        env = {"MODEL": model}
        with launch_stack("agg.sh", served, env=env, log_dir=own_logs, timeout=timeout) as stack:
            yield Served(label, False, stack, None)
        return
    port = free_port()
    env = {"MODEL": model, "SPEC": preset, "WORKER_ARGS": f"--system-port {port}"}
    with launch_stack(
        "agg_spec_decoding.sh", served, env=env, log_dir=own_logs, timeout=timeout
    ) as stack:
        yield Served(label, True, stack, f"http://127.0.0.1:{port}/metrics")


def verdicts(points: Sequence[Point]) -> list[PresetVerdict]:
    base = {p.concurrency: p.output_tokens_per_s for p in points if p.setup == "none"}
    return [
        PresetVerdict(
            p.setup,
            p.concurrency,
            round(p.output_tokens_per_s / base[p.concurrency], 3),
            TARGETS[(p.setup, p.concurrency)],
        )
        for p in points
        if (p.setup, p.concurrency) in TARGETS and base.get(p.concurrency)
    ]


def table(points: Sequence[Point]) -> str:
    base = {p.concurrency: p.output_tokens_per_s for p in points if p.setup == "none"}
    rows = []
    for p in sorted(points, key=lambda p: (p.concurrency, p.setup != "none", p.setup)):
        rows.append([
            p.setup, str(p.concurrency), f"{p.output_tokens_per_s:.1f}",
            f"{p.output_tokens_per_s / base[p.concurrency]:.2f}x",
            f"{p.median_tpot_ms:.1f}", f"{p.p90_tpot_ms or 0:.1f}", f"{p.median_ttft_ms:.0f}",
            "-" if p.mean_acceptance_length is None else f"{p.mean_acceptance_length:.2f}",
            k_shares(p.k_steps or {}),
        ])  # fmt: skip
    headers = ["preset", "c", "output tok/s", "vs agg.sh", "TPOT p50 ms", "TPOT p90 ms",
               "TTFT p50 ms", "acceptance length", "Ks used"]  # fmt: skip
    return format_table(headers, rows)


def verdict_lines(results: Sequence[PresetVerdict]) -> str:
    lines = [
        f"  {'PASS' if v.passed else 'MISS'} {v.preset} c={v.concurrency}: {v.vs_none:.3f}x "
        f"launch/agg.sh (target >= {v.target}x)"
        for v in results
    ]
    overall = "PASS" if results and all(v.passed for v in results) else "MISS"
    return "\n".join([*lines, f"overall: {overall}"])


def body(args: argparse.Namespace) -> int:
    model_dir, served = resolve_model_arg(args.model)
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.concurrency:
        sizes = {c: sizes[c] for c in args.concurrency}
    with log_dir("spec-presets", keep=args.keep_logs) as logs:
        runs = scenarios(write_prompts(logs / "prompts.jsonl", max(64, *sizes.values())), sizes)
        print(f"model {served}; presets none (launch/agg.sh), {', '.join(args.presets)}; "
              f"{OUTPUT_LEN} tokens out; {args.rounds} interleaved rounds per level; "
              f"logs in {logs}")  # fmt: skip
        warn_if_busy()
        with contextlib.ExitStack() as up:
            stacks = [
                up.enter_context(preset_stack(preset, args.model, served, logs, args.start_timeout))
                for preset in (None, *args.presets)
            ]
            points = measure_rounds(stacks, runs, model_dir, served, logs, args.rounds)
    results = verdicts(points)
    print("launch presets vs launch/agg.sh (same prompts, interleaved, one run)")
    print(table(points))
    print(verdict_lines(results))
    if args.quick:
        print("(quick run: too few requests to judge the targets; run without --quick)")
    partial = bool(args.concurrency) and args.json is None  # a subset: only where asked
    save_report(None if partial else results_path(args, "spec_presets.json"), {
        "rounds": args.rounds,
        "points": [asdict(p) for p in points],
        "verdicts": [{**asdict(v), "passed": v.passed} for v in results],
        "passed": bool(results) and all(v.passed for v in results),
        "host": host_info(),
    })  # fmt: skip
    return 0


def preset_list(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in chosen if p not in PRESETS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"choose among {list(PRESETS)}, not {unknown or text!r}")
    return chosen


def main() -> int:
    parser = serving_parser(__doc__, "spec_presets.json")
    parser.add_argument(
        "--presets",
        type=preset_list,
        default=list(PRESETS),
        help="comma-separated SPEC presets of launch/agg_spec_decoding.sh to measure beside "
        f"launch/agg.sh (default: {','.join(PRESETS)})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="interleaved rounds per concurrency, the order reversed every round; the "
        f"requests of a level ({SIZES} in full runs) are split between them "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=levels_type(SIZES),
        default=None,
        help=f"comma-separated subset of the levels {','.join(map(str, SIZES))} "
        "(e.g. 32 with more --rounds, to tell a 2%% gap from the host's drift); a partial "
        "run writes JSON only with --json",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return guarded(lambda: body(args))


if __name__ == "__main__":
    sys.exit(main())
