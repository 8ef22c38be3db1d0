"""Render a kustomization in Python, for the subset of kustomize that deploy/k8s uses.

Why it exists: the manifests are tested on every `make test`, and CI machines do not all
have `kubectl`. Where `kubectl` is installed, tests/unit/deploy compares this renderer's
output with `kubectl kustomize`, so the two cannot drift apart silently.

Supported, and nothing else (an unknown kustomization field is an error, never ignored):

* `resources`: YAML files (several documents each) and directories holding a
  `kustomization.yaml`, built recursively;
* `patches` with `path`: strategic-merge patches, each applied to the resource of the same
  kind and name. Maps merge key by key; lists whose items carry a merge key (containers,
  env, volumes, ... by `name`; volume mounts by `mountPath`; ports by `containerPort` or
  `port`) merge item by item; every other list (`args`, `command`) is replaced whole;
* `namespace`: set on every namespaced resource;
* `labels` with `pairs` only (no selectors, no templates): added to `metadata.labels`;
* `images`: `name` -> `newName` / `newTag` in every container and init container.

Usage: `python deploy/render.py deploy/k8s/overlays/aggregated > rendered.yaml`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Document = dict[str, Any]

_KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "namespace",
    "labels",
    "images",
}

# Lists merged item by item in a strategic-merge patch, by the key that names an item
# (the first of the keys that the items carry). Kubernetes declares these merge keys in
# its OpenAPI; this is the part of that table our manifests touch.
_MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),
    "imagePullSecrets": ("name",),
}

# Kinds without a namespace: the namespace transformer leaves them alone.
_CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not implement, or is wrong."""


def render(directory: Path | str) -> list[Document]:
    """The resources `kustomize build directory` would produce (in declaration order)."""
    root = Path(directory)
    path = root / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - _KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unknown)}")

    documents: list[Document] = []
    for entry in spec.get("resources", []):
        target = root / entry
        if target.is_dir():
            documents.extend(render(target))
        else:
            documents.extend(_load(target))
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise KustomizeError(f"{path}: only `patches: - path: FILE` is supported")
        for doc in _load(root / patch["path"]):
            _apply_patch(documents, doc, root / patch["path"])
    if "namespace" in spec:
        for doc in documents:
            if doc["kind"] not in _CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = spec["namespace"]
    for group in spec.get("labels", []):
        if set(group) - {"pairs"}:
            raise KustomizeError(f"{path}: labels support `pairs` only")
        for doc in documents:
            doc["metadata"].setdefault("labels", {}).update(group["pairs"])
    for image in spec.get("images", []):
        for doc in documents:
            _set_image(doc, image)
    return documents


def _load(path: Path) -> list[Document]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _apply_patch(documents: list[Document], patch: Document, source: Path) -> None:
    kind, name = patch["kind"], patch["metadata"]["name"]
    for i, doc in enumerate(documents):
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            documents[i] = merge(doc, patch)
            return
    raise KustomizeError(f"{source}: no {kind} named {name} to patch")


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into `base` (neither is modified). `field` is the name
    under which the values sit, which decides how a list merges."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in _MERGE_KEYS:
        key = _merge_key(field, base + patch)
        if key is not None:
            merged_list = copy.deepcopy(base)
            for item in patch:
                for j, existing in enumerate(merged_list):
                    if existing.get(key) == item.get(key):
                        merged_list[j] = merge(existing, item)
                        break
                else:
                    merged_list.append(copy.deepcopy(item))
            return merged_list
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list[Any]) -> str | None:
    """The merge key every item of the list carries, or None (then the list is replaced)."""
    for key in _MERGE_KEYS[field]:
        if items and all(isinstance(item, dict) and key in item for item in items):
            return key
    return None


def _pod_specs(doc: Document) -> list[dict[str, Any]]:
    """The pod specs inside a workload (Deployment, StatefulSet, DaemonSet, Job, CronJob)."""
    spec = doc.get("spec", {})
    if doc["kind"] == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    template = spec.get("template", {})
    return [template["spec"]] if "spec" in template else []


def _set_image(doc: Document, image: dict[str, str]) -> None:
    for pod in _pod_specs(doc):
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            current = container.get("image", "")
            bare = current.split("@")[0].rsplit(":", 1)[0] if ":" in current else current
            if bare != image["name"]:
                continue
            tag = current[len(bare) :]
            new = image.get("newName", bare)
            container["image"] = f"{new}:{image['newTag']}" if "newTag" in image else new + tag


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/render.py KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    yaml.safe_dump_all(render(argv[0]), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
