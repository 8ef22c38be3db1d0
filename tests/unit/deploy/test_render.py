"""deploy/render.py, the Python renderer of our kustomize subset: strategic merge as
kustomize does it for our manifests (containers merged by name, args replaced whole),
and a refusal of anything it does not implement (never a silent half-render)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_support import renderer


def test_containers_merge_by_name_and_args_are_replaced_whole() -> None:
    base = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "a", "image": "x", "args": ["--one", "--two"]},
                        {"name": "b", "image": "y"},
                    ]
                }
            }
        }
    }
    patch = {
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "a", "args": ["--three"], "env": [{"name": "E"}]}]}
            }
        }
    }
    merged = renderer().merge(base, patch)
    a, b = merged["spec"]["template"]["spec"]["containers"]
    assert a == {"name": "a", "image": "x", "args": ["--three"], "env": [{"name": "E"}]}
    assert b == {"name": "b", "image": "y"}
    assert base["spec"]["template"]["spec"]["containers"][0]["args"] == ["--one", "--two"]


def test_a_null_in_a_patch_deletes_the_key() -> None:
    assert renderer().merge({"a": 1, "b": 2}, {"b": None}) == {"a": 1}


def test_unsupported_kustomization_fields_are_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(renderer().KustomizeError, match="commonLabels"):
        renderer().render(tmp_path)


def test_a_patch_without_a_target_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "patch.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\npatches:\n  - path: patch.yaml\n"
    )
    with pytest.raises(renderer().KustomizeError, match="no ConfigMap named b"):
        renderer().render(tmp_path)


def test_images_keep_or_replace_the_tag(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\nspec:\n  template:\n"
        "    spec:\n      containers:\n        - {name: a, image: 'img:1'}\n"
        "        - {name: b, image: other}\n      initContainers:\n"
        "        - {name: c, image: img}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [job.yaml]\nimages:\n  - {name: img, newName: reg/img}\n"
    )
    (job,) = renderer().render(tmp_path)
    pod = job["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == ["reg/img:1", "other"]
    assert pod["initContainers"][0]["image"] == "reg/img"
