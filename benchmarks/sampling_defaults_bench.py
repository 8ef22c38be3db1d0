"""How often the embedded model answers simple factual questions correctly, per sampling
setting: the measurement behind the sampling defaults its recipe ships.

SmolLM2-135M-Instruct's authors recommend temperature 0.2 / top_p 0.9. The copy embedded
here is dequantized from a Q4_1 GGUF, and its first-token distribution is flatter than
the authors' bf16 weights: for "What is the capital of France?" the top two first tokens
("The" and "L", which leads to "L'Étoile, la Marseillaise, ...") are 0.125 nats apart.
This script samples every question `--samples` times per setting (seeds 0..N-1, the chat
template applied, 32 tokens), counts answers that contain the expected word, and prints
one row per setting, so the choice of defaults is a measurement, not a guess.

    .venv/bin/python benchmarks/sampling_defaults_bench.py [--samples 40]

Runs vLLM offline (no server), without speculation, on the prepared embedded model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", r"Paris"),
    ("What is the capital of Japan?", r"Tokyo"),
    ("What is the capital of Italy?", r"Rome"),
    ("What is the largest planet in the solar system?", r"Jupiter"),
    ("How many days are in a week?", r"seven|7"),
    ("What color is the sky on a clear day?", r"blue"),
    ("Who wrote Romeo and Juliet?", r"Shakespeare"),
    ("What is the chemical symbol for water?", r"H2O|H₂O"),
)
SETTINGS: tuple[tuple[float, float], ...] = (
    (1.0, 1.0),  # vLLM's fallback when a model has no generation_config defaults
    (0.2, 0.9),  # the authors' recommendation
    (0.2, 0.7),
    (0.2, 0.5),  # what the recipe ships
    (0.1, 0.9),
    (0.0, 1.0),  # greedy
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=40, help="Samples per question.")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Model directory (default: the prepared embedded model).",
    )
    parser.add_argument("--out", type=Path, default=None, help="Also write the rows as JSON.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from dynamo.llm.models import DEFAULT_MODEL, cache

    model = args.model or cache.model_cache_dir() / DEFAULT_MODEL
    # generation_config="vllm": ignore the model's own defaults; every row sets its own.
    llm = LLM(
        str(model),
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        generation_config="vllm",
    )
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q, _ in QUESTIONS
    ]
    rows = []
    n = args.samples
    print(f"{'temperature':>11} {'top_p':>5}  correct per question (of {n})  total")
    for temperature, top_p in SETTINGS:
        start = time.monotonic()
        correct = []
        for prompt, (_, expected) in zip(prompts, QUESTIONS, strict=True):
            params = [
                SamplingParams(temperature=temperature, top_p=top_p, max_tokens=32, seed=i)
                for i in range(n)
            ]
            outs = llm.generate([prompt] * n, params, use_tqdm=False)
            correct.append(sum(bool(re.search(expected, o.outputs[0].text, re.I)) for o in outs))
        total = sum(correct)
        print(
            f"{temperature:>11} {top_p:>5}  {correct}  {total}/{n * len(QUESTIONS)}"
            f"  ({time.monotonic() - start:.0f}s)",
            flush=True,
        )
        rows.append({"temperature": temperature, "top_p": top_p, "correct": correct})
    if args.out:
        args.out.write_text(json.dumps({"samples": n, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
