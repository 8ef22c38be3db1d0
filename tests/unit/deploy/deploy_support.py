"""Shared by the deploy tests: where deploy/ is, its renderer, the overlays rendered."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
OVERLAYS = DEPLOY / "k8s" / "overlays"
OVERLAY_NAMES = sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


@cache
def renderer() -> ModuleType:
    """deploy/render.py, a script rather than a package module, loaded by path."""
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's documents, rendered afresh (callers may modify them)."""
    return renderer().render(OVERLAYS / overlay)


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


def module_args(container: dict[str, Any], module: str) -> list[str] | None:
    """The command-line flags of `python -m module` in `container` (None: another
    program). The images' entrypoint is `python`, so args start with `-m module`."""
    args = container.get("args", [])
    if args[:2] != ["-m", module]:
        return None
    return args[2:]
