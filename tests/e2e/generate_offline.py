"""Greedy generation with vLLM's offline `LLM` on a model directory; prints JSON lines.

Run as a script (vLLM spawns engine processes, so this needs its own `__main__`):
    python generate_offline.py MODEL_DIR PROMPT [PROMPT ...]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model, prompts = sys.argv[1], sys.argv[2:]
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, enforce_eager=True, block_size=32, max_model_len=1024, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    for prompt, output in zip(prompts, llm.generate(chats, params), strict=True):
        print(json.dumps({"prompt": prompt, "text": output.outputs[0].text}), flush=True)


if __name__ == "__main__":
    main()
