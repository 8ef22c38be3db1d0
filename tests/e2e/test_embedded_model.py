"""The prepared embedded model runs in real vLLM on the CPU and answers coherently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dynamo.llm.models import DEFAULT_MODEL, get_recipe, verify_model

SCRIPT = Path(__file__).with_name("generate_offline.py")


def test_prepared_model_is_intact(embedded_model: Path) -> None:
    assert verify_model(DEFAULT_MODEL, full=True) == []
    assert (embedded_model / "model.safetensors").stat().st_size > 200_000_000


def test_greedy_answer_through_vllm_is_coherent(embedded_model: Path) -> None:
    recipe = get_recipe(DEFAULT_MODEL)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(embedded_model), recipe.smoke_prompt],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    assert recipe.smoke_expect in lines[0]["text"], lines[0]["text"]
