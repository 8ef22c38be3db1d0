"""Rules of the code base that a reviewer would otherwise check by hand.

Claims: no module imports another module's underscore (private) names, nor reaches them
through an imported project module (`module._name`); and every Markdown document a file
names (`architecture.md`, `docs/worker.md`, ...) is in the repository, so a maintainer who
clones it can follow every reference; and no two test modules share a file name (pytest
imports them by basename, so `make test`, which collects every folder at once, would
refuse the second while a run of one folder passes).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("lib", "components", "tests", "benchmarks")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml"}
DOCUMENT_REFERENCE = re.compile(r"[\w./-]*\w\.md\b")


def _python_files() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in (ROOT / root).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    project_modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dynamo"):
            found += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            project_modules |= {
                a.asname or a.name for a in node.names if a.name.startswith("dynamo")
            }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in project_modules
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return [f"{path.relative_to(ROOT)}:{use}" for use in found]


def test_no_module_uses_another_modules_private_names() -> None:
    uses = [use for path in _python_files() for use in _private_uses(path)]
    assert uses == []


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    paths = [ROOT / name for name in names]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "Makefile")]


def _exists(reference: str, referrer: Path) -> bool:
    """A document inside the repository, named relative to the referring file, the
    repository root or docs/ (a path leading out of the checkout does not count, even
    where it happens to exist on this machine)."""
    for base in (referrer.parent, ROOT, ROOT / "docs"):
        target = (base / reference).resolve()
        if target.is_file() and target.is_relative_to(ROOT):
            return True
    return False


def test_every_document_a_file_names_is_in_the_repository() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {reference}"
        for path in _tracked_text_files()
        for reference in DOCUMENT_REFERENCE.findall(path.read_text(errors="ignore"))
        if not _exists(reference, path)
    ]
    assert missing == []


def test_test_modules_have_unique_file_names() -> None:
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
