"""The configurations of the session's shared vLLM workers (tests/e2e/conftest.py), for the
modules that rely on what those workers run."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NGRAM_K = 3
NGRAM_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": NGRAM_K,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
"""The shared n-gram worker's speculative config: the n-gram preset of `make run`."""


def make_run_ngram_preset() -> dict:
    """The n-gram preset `make run` starts its worker with (launch/agg_spec_decoding.sh), read
    from the script so that the shared worker and `make run` cannot drift apart unseen."""
    script = (REPO / "launch" / "agg_spec_decoding.sh").read_text()
    preset = re.search(r"ngram\) preset='(\{.*?\})'", script)
    assert preset is not None, "no n-gram preset in launch/agg_spec_decoding.sh"
    return json.loads(preset.group(1))
