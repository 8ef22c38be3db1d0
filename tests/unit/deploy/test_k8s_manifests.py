"""The Kubernetes manifests of deploy/k8s, rendered per overlay.

Claims: every overlay renders, with the Python renderer and (where installed) with
`kubectl kustomize`, to the same documents; every document passes strict schema
validation for recent Kubernetes versions; every component's arguments parse with the
component's own command-line parser (so no flag is misspelt or gone); a worker's
termination grace period outlasts its `--drain-timeout`; probes and scrape annotations
name ports and paths the processes really serve; every component lists all NATS nodes
and replicates over all of them; the NATS config is one nats-server accepts."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_support import OVERLAY_NAMES, OVERLAYS, by_kind, containers, module_args, rendered

from dynamo.nats_server import find_nats_server_binary

# Kubernetes versions the manifests must be valid for: the kubectl of this repository's
# machines, and the newest kubernetes-validate bundles.
K8S_VERSIONS = ["1.32.0", "1.37.0"]

# What the worker needs after its drain to stop the engine and exit; the manifests give
# 15 s. The kubelet SIGKILLs at terminationGracePeriodSeconds, so a shorter grace cuts
# requests the worker was still allowed to finish.
MIN_STOP_MARGIN_S = 10

# Paths each server answers (components/src/dynamo/frontend/http/server.py,
# lib/runtime/src/dynamo/runtime/system_server.py).
FRONTEND_PATHS = {"/health", "/live", "/metrics"}
SYSTEM_SERVER_PATHS = {"/health", "/live", "/metrics"}


def test_there_are_the_five_overlays() -> None:
    assert OVERLAY_NAMES == [
        "aggregated",
        "aggregated-planner",
        "aggregated-spec",
        "disaggregated",
        "disaggregated-planner",
    ]


def _disaggregated(overlay: str) -> bool:
    """`disaggregated` and `disaggregated-planner`: prefill and decode Deployments."""
    return overlay.startswith("disaggregated")


def _with_planner(overlay: str) -> bool:
    """The `*-planner` overlays add the planner (deploy/k8s/planner) to a topology."""
    return overlay.endswith("-planner")


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_every_overlay_renders_the_whole_stack_into_one_namespace(overlay: str) -> None:
    docs = rendered(overlay)
    assert set(by_kind(docs, "StatefulSet")) == {"nats"}
    planner_services = {"frontend-pods"} if _with_planner(overlay) else set()
    assert set(by_kind(docs, "Service")) == {"nats", "nats-headless", "frontend"} | planner_services
    deployments = by_kind(docs, "Deployment")
    expected = (
        {"frontend", "worker"}
        | ({"prefill-worker"} if _disaggregated(overlay) else set())
        | ({"planner"} if _with_planner(overlay) else set())
    )
    assert set(deployments) == expected
    # One PodDisruptionBudget per serving workload, selecting exactly that workload's pods
    # (the planner, one pod that serves no request, has none).
    budgets = by_kind(docs, "PodDisruptionBudget")
    serving = {n: d for n, d in deployments.items() if n != "planner"}
    assert set(budgets) == set(serving) | set(by_kind(docs, "StatefulSet"))
    for name, workload in {**serving, **by_kind(docs, "StatefulSet")}.items():
        selector = budgets[name]["spec"]["selector"]["matchLabels"]
        assert selector == workload["spec"]["selector"]["matchLabels"]
        assert budgets[name]["spec"]["maxUnavailable"] == 1
    for doc in docs:
        assert doc["metadata"]["namespace"] == "dynamo", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dynamo"
    # Every image placeholder was replaced by the overlay's `images`.
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            pod = doc["spec"]["template"]["spec"]
            for c in pod["containers"] + pod.get("initContainers", []):
                assert c["image"] not in ("dynamo-cpu", "dynamo-gpu"), c["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_the_python_renderer_equals_kubectl_kustomize(overlay: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAYS / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    theirs = sorted(json.dumps(d, sort_keys=True) for d in yaml.safe_load_all(out) if d)
    ours = sorted(json.dumps(d, sort_keys=True) for d in rendered(overlay))
    assert ours == theirs


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_every_document_validates_strictly(overlay: str, version: str) -> None:
    for doc in rendered(overlay):
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_refuses_an_unknown_field() -> None:
    """The check above has teeth: a misspelt field is an error, not ignored."""
    worker = by_kind(rendered("aggregated"), "Deployment")["worker"]
    containers(worker)[0]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSIONS[-1], strict=True)


# --------------------------------------------------------------------------- arguments


def _worker_parser() -> argparse.ArgumentParser:
    from dynamo.vllm.config.parser import build_parser

    return build_parser()


def _frontend_parser() -> argparse.ArgumentParser:
    from dynamo.frontend.__main__ import build_parser

    return build_parser()


def _planner_parser() -> argparse.ArgumentParser:
    from dynamo.planner.args import build_parser

    return build_parser()


def _workers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], argparse.Namespace]]:
    """Each Deployment running `python -m dynamo.vllm`, with its parsed arguments."""
    parser = _worker_parser()
    found = []
    for deployment in by_kind(docs, "Deployment").values():
        for container in containers(deployment):
            args = module_args(container, "dynamo.vllm")
            if args is not None:
                found.append((deployment, parser.parse_args(args)))
    return found


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_termination_grace_outlasts_the_drain_timeout(overlay: str) -> None:
    workers = _workers(rendered(overlay))
    assert len(workers) == (2 if _disaggregated(overlay) else 1)
    for deployment, args in workers:
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= args.drain_timeout + MIN_STOP_MARGIN_S, deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_worker_arguments_parse_and_match_the_topology(overlay: str) -> None:
    workers = {d["metadata"]["name"]: a for d, a in _workers(rendered(overlay))}
    for args in workers.values():
        assert args.model.startswith("/models/"), "a model directory on the volume"
    worker = workers["worker"]
    if _disaggregated(overlay):
        assert worker.is_decode_worker and workers["prefill-worker"].is_prefill_worker
        for args in workers.values():
            assert args.kv_transfer_config.kv_connector == "NixlConnector"  # vLLM's config
    else:
        assert not worker.is_decode_worker and not worker.is_prefill_worker
    spec = worker.speculative_config
    if overlay == "aggregated-spec":
        assert _mapping(spec)["method"] == "eagle3"
    else:
        assert spec is None


def _mapping(value: Any) -> dict[str, Any]:
    """A JSON flag's value: vLLM's parser decodes some (`--speculative-config`) into a
    dict, argparse would leave the text."""
    return value if isinstance(value, dict) else json.loads(value)


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_probes_and_scrape_annotations_name_what_the_processes_serve(overlay: str) -> None:
    docs = rendered(overlay)
    frontend = by_kind(docs, "Deployment")["frontend"]
    (container,) = containers(frontend)
    args = _frontend_parser().parse_args(module_args(container, "dynamo.frontend"))
    assert args.router_mode == "kv"
    _check_pod(frontend, container, args.http_port, FRONTEND_PATHS)
    service = by_kind(docs, "Service")["frontend"]
    assert service["spec"]["ports"][0]["port"] == args.http_port
    for deployment, worker_args in _workers(docs):
        (worker,) = containers(deployment)
        _check_pod(deployment, worker, worker_args.system_port, SYSTEM_SERVER_PATHS)
        gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == worker["resources"]["requests"]["nvidia.com/gpu"] == 1


def _check_pod(deployment: dict[str, Any], container: dict[str, Any], port: int, paths: set[str]):
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] in paths
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in paths, (probe, get["path"])
        assert named[get["port"]] == port
    # Readiness follows the engine (/health: 503 while loading), liveness the process.
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"


@pytest.mark.parametrize("overlay", [o for o in OVERLAY_NAMES if _with_planner(o)])
def test_the_planner_sizes_this_topology_in_its_own_namespace(overlay: str) -> None:
    """One planner on the kubernetes connector, for the overlay's topology, in the pod's
    namespace (downward API), reading the frontend Service, its /metrics on a named port,
    and allowed to scale exactly the Deployments its pools are."""
    docs = rendered(overlay)
    planner = by_kind(docs, "Deployment")["planner"]
    assert planner["spec"]["replicas"] == 1
    assert planner["spec"]["strategy"]["type"] == "Recreate"  # never two at once
    (container,) = containers(planner)
    args = _planner_parser().parse_args(module_args(container, "dynamo.planner"))
    assert args.connector == "kubernetes"
    assert args.topology == ("disaggregated" if _disaggregated(overlay) else "aggregated")
    assert args.kubernetes_namespace == "$(POD_NAMESPACE)"
    assert {
        "name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    } in container["env"]
    # Every frontend pod: a headless Service with the frontend's selector and port.
    service, frontend = (
        by_kind(docs, "Service")["frontend-pods"],
        by_kind(docs, "Service")["frontend"],
    )
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == frontend["spec"]["selector"]
    assert args.frontend_url == [
        f"http://{service['metadata']['name']}:{frontend['spec']['ports'][0]['port']}"
    ]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named["metrics"] == args.metrics_port
    annotations = planner["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    # The Role lets the planner's ServiceAccount scale the worker Deployments, no other.
    pod = planner["spec"]["template"]["spec"]
    binding = by_kind(docs, "RoleBinding")["planner"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "dynamo"}
    ]
    rules = by_kind(docs, "Role")[binding["roleRef"]["name"]]["rules"]
    (scale,) = [r for r in rules if r["resources"] == ["deployments/scale"]]
    workers = {d["metadata"]["name"] for d, _ in _workers(docs)}
    assert workers <= set(scale["resourceNames"]) <= workers | {"prefill-worker"}
    assert sorted(scale["verbs"]) == ["get", "patch", "update"]


# --------------------------------------------------------------------------- NATS


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_every_component_lists_every_nats_node_and_replicates_on_all(overlay: str) -> None:
    docs = rendered(overlay)
    nats = by_kind(docs, "StatefulSet")["nats"]
    replicas = nats["spec"]["replicas"]
    headless = nats["spec"]["serviceName"]
    nodes = [f"nats://nats-{i}.{headless}:4222" for i in range(replicas)]
    parsers = {
        "dynamo.vllm": _worker_parser(),
        "dynamo.frontend": _frontend_parser(),
        "dynamo.planner": _planner_parser(),
    }
    seen = 0
    for deployment in by_kind(docs, "Deployment").values():
        for container in containers(deployment):
            for module, parser in parsers.items():
                args = module_args(container, module)
                if args is None:
                    continue
                parsed = parser.parse_args(args)
                assert parsed.nats_server.split(",") == nodes
                assert int(parsed.nats_replicas) == replicas  # validated later, as text here
                seen += 1
    assert seen == len(by_kind(docs, "Deployment"))
    assert by_kind(docs, "Service")[headless]["spec"]["publishNotReadyAddresses"] is True


def test_nats_routes_name_the_statefulset_pods_and_nats_server_accepts_the_config(
    tmp_path,
) -> None:
    docs = rendered("aggregated")
    conf = by_kind(docs, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    nats = by_kind(docs, "StatefulSet")["nats"]
    for i in range(nats["spec"]["replicas"]):
        assert f"nats://nats-{i}.{nats['spec']['serviceName']}:6222" in conf
    (container,) = containers(nats)
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in (
        container["env"]
    )
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz?js-enabled-only=true"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]] == 8222
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    binary = str(find_nats_server_binary())
    ok = subprocess.run(
        [binary, "-c", str(path), "-t"],
        env={"POD_NAME": "nats-0"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stderr
    # server_name really comes from the pod's environment.
    unset = subprocess.run(
        [binary, "-c", str(path), "-t"], env={}, capture_output=True, text=True, timeout=30
    )
    assert unset.returncode != 0 and "POD_NAME" in unset.stderr
