"""Measure speculative decoding on this machine and choose the batch-size -> K schedule.

    python -m dynamo.vllm.profile_spec --model smollm2-135m-instruct \\
        --speculative-config '{"method": "ngram", "prompt_lookup_max": 3}' \\
        --batch-sizes 1,2,4,8,16,32 --max-k 5 --out spec.profile.json

It starts the real vLLM engine once per K from 0 to `--max-k`, each in a child process of
its own (a clean Prometheus registry and memory each time). K = 0 is the speculating
engine with a schedule of K = 0, which is what a worker runs in a K = 0 range, and a plain
engine (no speculation) is measured as well, since K = 0 is not free everywhere: the
`dynamo_free_k0` plugin spares n-gram's, Eagle's and Eagle3's drafter at K = 0, but MTP
and draft models still run their forward pass (and the measurement shows what is left
for the others). At every batch size each engine
runs that many prompts twice: once for the prefill alone (one output token) and once for
`--output-tokens` tokens, greedy, end-of-sequence ignored, prefix caching
off. The decode step time is the difference of the two wall times divided by the
difference of the engine steps (vLLM's `vllm:iteration_tokens_total` count), so prefill
and start-up costs drop out. The K = max run also yields the acceptance per draft position
over all its prompts. The schedule that maximises goodput (`dynamo.llm.speculation_profile`) is
written into the profile, and a plot next to it (`.png`). docs/speculative_decoding.md
explains the formula and its assumptions.

Start a worker with the result: `python -m dynamo.vllm ... --speculative-config
'<the same config>' --speculation-profile spec.profile.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dynamo.llm.speculation_profile import (
    SpeculationProfile,
    StepTimes,
    best_k,
    choose_schedule,
    goodput,
    goodput_without_speculation,
    never_speculates,
    save_profile,
)
from dynamo.runtime.cli import ConfigError
from dynamo.vllm.training.eagle3.prompts import Messages, as_messages, held_out, read_jsonl

log = logging.getLogger("dynamo.vllm.profile_spec")

MEASURED = "MEASURED"  # a child's stdout line per measured point: MEASURED <json>
BUNDLED_PROMPTS = 64
KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE for the children unless the user set one


@dataclass(frozen=True)
class ProfileRequest:
    """What one child measures: one engine (one K) over every batch size."""

    model: str
    speculative_config: dict[str, Any] | None  # None: K = 0
    batch_sizes: list[int]
    output_tokens: int
    max_model_len: int
    prompts: list[Messages]


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def parse_spec_config(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
        raise argparse.ArgumentTypeError('expected a JSON object with a "method"')
    return spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.vllm.profile_spec",
        description="Measure decode step time for each (batch size, K) and the acceptance "
        "per draft position on the real engine, and write the batch-size -> K schedule "
        "that maximises goodput (expected accepted tokens per step / step time).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="embedded model name or a model dir")
    parser.add_argument(
        "--speculative-config",
        required=True,
        type=parse_spec_config,
        help="the worker's speculative config as JSON, without num_speculative_tokens "
        '(e.g. \'{"method": "ngram", "prompt_lookup_max": 3}\' or \'{"method": '
        '"eagle3", "model": "smollm2-135m-instruct-eagle3"}\'); K is what is swept',
    )
    parser.add_argument(
        "--batch-sizes",
        type=parse_batch_sizes,
        default="1,2,4,8,16,32",
        help="batch sizes to measure (running sequences)",
    )
    parser.add_argument("--max-k", type=int, default=5, help="largest K to measure")
    parser.add_argument(
        "--prompts",
        type=Path,
        help='JSON Lines of {"prompt": ...} or {"messages": [...]}, representative of the '
        "traffic (default: the bundled held-out prompt set)",
    )
    parser.add_argument(
        "--output-tokens", type=int, default=64, help="tokens generated per request"
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        help="the schedule's last range ends here (default: the largest batch size; "
        "use the worker's --max-num-seqs)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048, help="engine context")
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG next to --out")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Errors argparse cannot express, as ConfigErrors with the fix."""
    if "num_speculative_tokens" in args.speculative_config:
        raise ConfigError(
            "--speculative-config: leave num_speculative_tokens out, the profiler sweeps "
            "K = 0..--max-k"
        )
    if args.max_k < 1:
        raise ConfigError(f"--max-k must be at least 1, got {args.max_k}")
    if args.output_tokens < 2:
        raise ConfigError(f"--output-tokens must be at least 2, got {args.output_tokens}")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    if args.prompts is not None and not args.prompts.is_file():
        raise ConfigError(f"--prompts: {args.prompts} is not a file")


def load_prompts(path: Path | None, needed: int) -> tuple[list[Messages], str]:
    """The prompt set, cycled to `needed` conversations, and a description of it."""
    if path is None:
        prompts = [as_messages(p) for p in held_out(BUNDLED_PROMPTS)]
        source = f"bundled held-out set ({BUNDLED_PROMPTS} prompts)"
    else:
        try:
            prompts = list(read_jsonl(path))
        except ValueError as exc:
            raise ConfigError(f"--prompts: {exc}") from exc
        if not prompts:
            raise ConfigError(f"--prompts: {path} holds no prompts")
        source = str(path)
    return [prompts[i % len(prompts)] for i in range(needed)], source


def spec_for_k(spec: dict[str, Any], k: int, max_batch: int) -> dict[str, Any]:
    """The speculating engine at K. K = 0 is that same engine with a schedule of K = 0 at
    every batch size, which is what a worker runs in a K = 0 range: MTP and draft models
    still run their drafter's forward pass over the new tokens to keep its KV cache in
    step (n-gram, Eagle and Eagle3 do not: `dynamo_free_k0`)."""
    if k > 0:
        return {**spec, "num_speculative_tokens": k}
    return {**spec, "num_speculative_tokens": 1,
            "num_speculative_tokens_per_batch_size": [[1, max_batch, 0]]}  # fmt: skip


def planned_runs(max_k: int) -> list[int | None]:
    """The engines to start, in order: None is a plain engine (no speculation), then the
    speculating engine at K = 0..max. The plain engine is measured for every method: a
    K = 0 step is free of drafting only where `dynamo_free_k0` skips the drafter, and
    what it costs beyond that is what the profile is for."""
    return [None, *range(max_k + 1)]


def resolve_paths(spec: dict[str, Any]) -> dict[str, Any]:
    """An embedded draft-model name becomes its directory, as the worker resolves it."""
    from dynamo.llm.models import is_known_name
    from dynamo.vllm.config.model_resolution import resolve_model_dir

    draft = spec.get("model")
    if isinstance(draft, str) and is_known_name(draft):
        return {**spec, "model": str(resolve_model_dir(draft, dry_run=False, what="draft"))}
    return spec


# --- the child: one engine, every batch size ------------------------------------------


def _metric_value(metrics: Sequence[Any], name: str) -> Any:
    for metric in metrics:
        if metric.name == name:
            return metric
    return None


def _counters(llm: Any) -> tuple[int, int, list[int]]:
    """(engine steps, drafts, accepted per position) so far."""
    metrics = llm.get_metrics()
    steps = _metric_value(metrics, "vllm:iteration_tokens_total")
    drafts = _metric_value(metrics, "vllm:spec_decode_num_drafts")
    per_pos = _metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    return (
        int(steps.count) if steps else 0,
        int(drafts.value) if drafts else 0,
        list(per_pos.values) if per_pos else [],
    )


def measure(request: ProfileRequest) -> Iterator[dict[str, Any]]:
    """Start the engine and yield one record per batch size, then the acceptance."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    # The worker's CPU rules (eager mode, 32-token blocks); elsewhere vLLM's defaults, so
    # a GPU profile measures CUDA-graph steps as a GPU worker runs them.
    cpu = {"enforce_eager": True, "block_size": 32} if current_platform.is_cpu() else {}
    llm = LLM(
        model=request.model,
        speculative_config=request.speculative_config,
        **cpu,
        max_model_len=request.max_model_len,
        max_num_seqs=max(request.batch_sizes),
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    prompt_ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for m in request.prompts
    ]
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=request.output_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt_ids[0]}], full, use_tqdm=False)  # warm up
    _, drafts0, accepted0 = _counters(llm)
    offset = 0
    for batch in request.batch_sizes:
        batch_prompts = [{"prompt_token_ids": ids} for ids in prompt_ids[offset : offset + batch]]
        offset += batch
        walls, steps = [], []
        for params in (prefill, full):
            before = _counters(llm)[0]
            started = time.perf_counter()
            llm.generate(batch_prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - started)
            steps.append(_counters(llm)[0] - before)
        decode_steps = max(steps[1] - steps[0], 1)
        step_ms = (walls[1] - walls[0]) * 1000.0 / decode_steps
        yield {"batch": batch, "step_ms": step_ms, "decode_steps": decode_steps}
    _, drafts, accepted = _counters(llm)
    done = drafts - drafts0
    per_pos = [a - (accepted0[i] if i < len(accepted0) else 0) for i, a in enumerate(accepted)]
    rates = [a / done if done else 0.0 for a in per_pos]
    # Every sequence-step yields one token plus its accepted drafts; the prefill yields
    # each request's first token.
    decode_tokens = sum(b * (request.output_tokens - 1) for b in request.batch_sizes)
    sequence_steps = max(decode_tokens - sum(per_pos), 1)
    yield {
        "drafts": done,
        "acceptance_per_position": rates,
        "drafted_fraction": min(done / sequence_steps, 1.0),
    }


def child_main(request_path: Path) -> int:
    """`--child REQUEST.json`: measure and print MEASURED lines for the parent."""
    raw = json.loads(request_path.read_text())
    request = ProfileRequest(**raw)
    for record in measure(request):
        print(f"{MEASURED} {json.dumps(record)}", flush=True)
    return 0


# --- the parent: one child per K, a progress bar, the profile -------------------------


def run_child(request: ProfileRequest, on_record: Any, log_path: Path) -> list[dict[str, Any]]:
    """Run one K in a fresh interpreter; its engine logs go to `log_path`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(request.__dict__, handle)
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    records: list[dict[str, Any]] = []
    with log_path.open("a") as engine_log:
        child = subprocess.Popen(
            [sys.executable, "-m", "dynamo.vllm.profile_spec", "--child", handle.name],
            stdout=subprocess.PIPE,
            stderr=engine_log,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(MEASURED):
                record = json.loads(line.removeprefix(MEASURED))
                records.append(record)
                on_record(record)
            else:
                engine_log.write(line)
        code = child.wait()
    Path(handle.name).unlink(missing_ok=True)
    if code != 0:
        raise ConfigError(f"the engine failed (exit {code}); its log: {log_path}")
    return records


def profile(args: argparse.Namespace) -> SpeculationProfile:
    from tqdm import tqdm

    from dynamo.vllm.config.model_resolution import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model, dry_run=False))
    spec = resolve_paths(args.speculative_config)
    prompts, source = load_prompts(args.prompts, sum(args.batch_sizes) + 1)
    log_path = args.out.with_suffix(".log")
    log_path.unlink(missing_ok=True)
    times: list[StepTimes] = []
    plain_ms: list[float] = []
    acceptance: list[float] = []
    drafted = 1.0
    runs = planned_runs(args.max_k)
    print(f"profiling no speculation and K=0..{args.max_k} at batch sizes "
          f"{args.batch_sizes}; engine logs in {log_path}", flush=True)  # fmt: skip
    total = len(runs) * len(args.batch_sizes)
    with tqdm(total=total, desc="profile", unit="point", dynamic_ncols=True) as bar:
        for k in runs:
            label = "no speculation" if k is None else f"K={k}"
            bar.set_postfix_str(f"{label} starting engine")

            def advance(record: dict[str, Any], label: str = label) -> None:
                if "batch" in record:
                    bar.set_postfix_str(f"{label} b={record['batch']} {record['step_ms']:.1f} ms")
                    bar.update(1)

            engine_spec = None if k is None else spec_for_k(spec, k, max(args.batch_sizes))
            request = ProfileRequest(
                model_dir, engine_spec, args.batch_sizes, args.output_tokens,
                args.max_model_len, prompts,
            )  # fmt: skip
            records = run_child(request, advance, log_path)
            step_ms = [round(r["step_ms"], 3) for r in records if "batch" in r]
            if len(step_ms) != len(args.batch_sizes):
                raise ConfigError(f"{label}: the engine measured {len(step_ms)} batch sizes")
            if k is None:
                plain_ms = step_ms
                continue
            times.append(StepTimes(k=k, step_ms=step_ms))
            if k == args.max_k:
                final = next(r for r in records if "drafts" in r)
                acceptance, drafted = final["acceptance_per_position"], final["drafted_fraction"]
    return finish_profile(args, spec, times, plain_ms, (acceptance, drafted), source)


def finish_profile(
    args: argparse.Namespace,
    spec: dict[str, Any],
    times: list[StepTimes],
    plain_ms: list[float],
    measured: tuple[list[float], float],
    source: str,
) -> SpeculationProfile:
    """The profile of these measurements (`measured`: acceptance per position and the
    fraction of sequence-steps that carried a draft) with its schedule chosen."""
    from vllm import __version__ as vllm_version

    acceptance = [round(a, 4) for a in measured[0][: args.max_k]]
    acceptance += [0.0] * (args.max_k - len(acceptance))
    draft: SpeculationProfile = SpeculationProfile(
        model=args.model,
        method=str(spec["method"]),
        speculative_config=dict(args.speculative_config),
        batch_sizes=list(args.batch_sizes),
        acceptance_per_position=acceptance,
        drafted_fraction=round(max(measured[1], 1e-4), 4),
        step_times=times,
        no_speculation_step_ms=plain_ms,
        schedule=[[1, 1, 0]],
        max_batch_size=args.max_batch_size or max(args.batch_sizes),
        prompts=source,
        output_tokens=args.output_tokens,
        num_prompts=sum(args.batch_sizes),
        vllm_version=vllm_version,
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    return msgspec.structs.replace(draft, schedule=choose_schedule(draft))


def summary(profile: SpeculationProfile) -> str:
    """Goodput per (batch size, K) with the winner marked, the plain engine's, and the
    schedule; a note where even K = 0 of the speculating engine trails a plain one."""
    ks = [t.k for t in profile.step_times]
    lines = [
        "acceptance per position (per draft): "
        + ", ".join(f"{a:.3f}" for a in profile.acceptance_per_position)
        + f"; steps with a draft: {profile.drafted_fraction:.3f}",
        "goodput (tokens/s; * = chosen; none = an engine without speculation)",
        "batch  " + "".join(f"{'K=' + str(k):>11}" for k in ks) + f"{'none':>11}",
    ]
    for batch in profile.batch_sizes:
        best = best_k(profile, batch)
        cells = [f"{goodput(profile, k, batch):10.1f}{'*' if k == best else ' '}" for k in ks]
        plain = goodput_without_speculation(profile, batch)
        lines.append(f"{batch:>5}  " + "".join(cells) + f"{plain:10.1f}")
    lines.append(f"schedule (num_speculative_tokens_per_batch_size): {profile.schedule}")
    reached = {
        b: goodput(profile, best_k(profile, b), b) / goodput_without_speculation(profile, b)
        for b in profile.batch_sizes
    }
    worst = min(reached, key=reached.__getitem__)
    ratio = reached[worst]
    if ratio < 0.97:
        lines.append(
            f"note: at batch {worst} the schedule reaches {ratio:.2f}x an engine without "
            "speculation: this drafter costs even at K=0; if most traffic runs there, serve "
            "without speculation"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child_main(Path(argv[1]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
        started = time.monotonic()
        result = profile(args)
    except ConfigError as exc:
        print(f"profile_spec: error: {exc}", file=sys.stderr)
        return 2
    save_profile(result, args.out)
    print(summary(result))
    print(f"profile written to {args.out} in {time.monotonic() - started:.0f}s")
    if never_speculates(result.schedule):
        print("speculation never paid at these batch sizes: serve without it")
    if not args.no_plot:
        from dynamo.vllm.speculative.profile_plot import plot_profile

        if plot_profile(result, args.out.with_suffix(".png")):
            print(f"plot written to {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
