"""Train an Eagle3 draft head for a target model, on CPU, from the target's own answers.

    python -m dynamo.vllm.train_eagle3 --target DIR --out DIR [--prompts FILE.jsonl]
        [--num-prompts N] [--time-budget MIN] [--draft-vocab N] [--steps K] ...

1. self-distillation: the target answers the prompt set through vLLM (chat template,
   mostly greedy, some sampled at the model's defaults);
2. the target's hidden states at vLLM's Eagle3 layers, captured with transformers;
3. a one-layer Eagle3 head trained with the training-time-test unroll over K steps, the
   draft vocabulary cut to the most frequent target tokens;
4. a speculators checkpoint in `--out` that `python -m dynamo.vllm --model OUT` serves
   (target + head), with `recipe.json` (how it was made) and the held-out acceptance.

Each stage keeps its result under `--work-dir` (default `OUT/work`), so a rerun skips
what is done and training resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("dynamo.vllm.train_eagle3")


class DefaultsShown(argparse.HelpFormatter):
    """Shows a flag's default when it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dynamo.vllm.train_eagle3",
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsShown,
    )
    p.add_argument(
        "--target",
        required=True,
        help="the target: a model directory, or an embedded model's name (e.g. "
        "smollm2-135m-instruct), which the checkpoint then names as its verifier",
    )
    p.add_argument("--out", type=Path, required=True, help="where the checkpoint is written")
    p.add_argument(
        "--prompts",
        type=Path,
        help='JSONL of {"prompt": ...} or {"messages": [...]} (default: the bundled set)',
    )
    p.add_argument("--num-prompts", type=int, default=2400, help="bundled prompts to use")
    p.add_argument(
        "--held-out", type=int, default=64, help="bundled held-out prompts for evaluation"
    )
    p.add_argument("--max-answer-tokens", type=int, default=192, help="answer length cap")
    p.add_argument("--sampled-fraction", type=float, default=0.2,
                   help="answers sampled at the model's defaults instead of greedy")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=1024, help="vLLM context for generation")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--steps", type=int, default=3, help="unrolled draft steps (K) in training")
    p.add_argument("--speculative-tokens", type=int, default=3,
                   help="K the checkpoint proposes by default when served")  # fmt: skip
    p.add_argument("--epochs", type=float, default=6.0, help="passes over the data")
    p.add_argument("--time-budget", type=float, default=45.0, help="training minutes at most")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--work-dir", type=Path, help="intermediate data (default: OUT/work)")
    p.add_argument("--seed", type=int, default=0, help="seeds generation, shuffling and init")
    return p.parse_args(argv)


def resolve_target(name: str) -> tuple[Path, str]:
    """The target's directory, and how the checkpoint names it: an embedded model by its
    name (prepared first if needed), a directory by its absolute path."""
    from dynamo.llm.models import is_known_name, resolve_model

    directory = resolve_model(name)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory}: no config.json there")
    return directory, name.strip().lower() if is_known_name(name) else str(directory)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    try:
        args.target, args.verifier = resolve_target(args.target)
    except (ValueError, RuntimeError) as exc:  # unknown name, no config, cannot prepare
        print(f"error: --target: {exc}", file=sys.stderr)
        return 2
    from dynamo.vllm.training.eagle3 import pipeline

    summary = pipeline.run(args)
    print(json.dumps(summary["held_out"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
