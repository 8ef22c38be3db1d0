"""Offline probe (not a test): greedy output and vLLM's speculative counters for a model
directory, with an optional speculative config, e.g.

    python tests/e2e/probe_mtp_offline.py DIR '{"method": "mtp", "num_speculative_tokens": 1}'
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    spec = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    llm = LLM(
        sys.argv[1],
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        speculative_config=spec,
        dtype="float32",
        disable_log_stats=False,
    )
    outs = llm.generate(["Hello there, how are you"], SamplingParams(temperature=0, max_tokens=24))
    print("OUT", outs[0].outputs[0].token_ids)
    for metric in llm.get_metrics():
        if "spec_decode" in metric.name:
            print(
                "MET",
                metric.name,
                getattr(metric, "value", None) or getattr(metric, "values", None),
            )
