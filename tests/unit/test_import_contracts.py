"""The import rules of pyproject.toml's `[tool.importlinter]` (docs/architecture.md,
"Import rules"): they hold on the code, and each one breaks when a violation is planted
in a copy of the sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("lib/runtime/src", "lib/llm/src", "components/src")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(pythonpath: list[Path] | None = None) -> subprocess.CompletedProcess[str]:
    """`lint-imports` with the repository's contracts; `pythonpath` first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath or [])}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_code_keeps_every_contract() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def planted_copy(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A copy of the Python sources (no model files), first on the path."""
    copy = tmp_path_factory.mktemp("sources")
    roots = []
    for relative in SOURCE_ROOTS:
        target = copy / relative
        shutil.copytree(
            ROOT / relative,
            target,
            ignore=shutil.ignore_patterns("*.json", "*.safetensors", "*.txt"),
        )
        roots.append(target)
    return roots


# (module file under a source root, import planted at its end, contract that must break)
VIOLATIONS = [
    ("dynamo/runtime/cli.py", "import dynamo.llm.protocols", "layers"),
    ("dynamo/llm/acceptance.py", "import dynamo.vllm.main", "layers"),
    ("dynamo/mocker/metrics.py", "import dynamo.frontend.openai.errors", "layers"),
    ("dynamo/frontend/openai/errors.py", "import vllm", "frontend-vllm"),
    ("dynamo/llm/acceptance.py", "import vllm", "core-vllm"),
    ("dynamo/planner/policy.py", "import vllm", "core-vllm"),
    ("dynamo/planner/policy.py", "import dynamo.mocker.engine", "layers"),
    ("dynamo/runtime/runtime.py", "import dynamo.nats_server", "nats-server-tool"),
    ("dynamo/frontend/openai/errors.py", "import dynamo.frontend.http.server", "frontend-stages"),
    (
        "dynamo/frontend/parsing/chat_output.py",
        "import dynamo.frontend.engine.client",
        "frontend-stages",
    ),
    (
        "dynamo/frontend/engine/client.py",
        "import dynamo.frontend.models.manager",
        "frontend-stages",
    ),
    ("dynamo/vllm/kv_transfer/layout.py", "import dynamo.vllm.serving.engine", "vllm-stages"),
    (
        "dynamo/vllm/speculative/monitor.py",
        "import dynamo.vllm.training.eagle3.head",
        "vllm-stages",
    ),
]


@pytest.mark.parametrize(("module", "planted", "contract"), VIOLATIONS)
def test_each_contract_breaks_on_a_planted_violation(
    planted_copy: list[Path], module: str, planted: str, contract: str
) -> None:
    path = next(root / module for root in planted_copy if (root / module).exists())
    original = path.read_text()
    path.write_text(f"{original}\n{planted}  # planted\n")
    try:
        result = lint_imports(planted_copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if " BROKEN" in line]
    names = {
        "layers": "no component imports another",
        "frontend-vllm": "only the frontend's parsers import vLLM",
        "core-vllm": "the runtime and llm layers never import vLLM",
        "nats-server-tool": "nothing served imports it",
        "frontend-stages": "frontend stages",
        "vllm-stages": "vLLM worker stages",
    }
    assert any(names[contract] in line for line in broken), result.stdout
