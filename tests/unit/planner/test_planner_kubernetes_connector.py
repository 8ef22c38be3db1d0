"""The planner's Kubernetes connector against recorded Kubernetes API interactions.

No API server can run on the machines that test this project, so the answers it gives
are recordings: tests/unit/planner/recordings/*.json, written by hand to the documented
shape of the API's objects (an autoscaling/v1 `Scale`: apiVersion, kind, metadata,
`spec.replicas` (left out at 0), `status.replicas`, `status.selector`; a v1 `Status` with
`reason` NotFound / Forbidden for errors), not captured from a cluster. A small HTTP
server in a thread (not on the event loop under test) answers each request with the
recorded response for its method and path, and keeps every request it got (method, path,
body, content type); the official client is pointed at it through its `ApiClient`.

Claims: `replicas` is the Deployment's `status.replicas` (what runs), not `spec`; `scale`
sends exactly one PATCH of `{"spec": {"replicas": n}}`, as a JSON merge or strategic
merge patch (the client picks the latter for an object body), to the
Deployment's scale subresource, and logs the change; no PATCH when `spec.replicas`
already is n; a count the API leaves out reads as 0; a 404 and a 403 become
`KubernetesConnectorError` naming the Deployment, the namespace and what to fix; the
event loop keeps running while a call waits for the API server; without a client the
connector loads the kubeconfig; the planner's Role grants what the connector calls, and its
pod reads the shipped profile where `--profile` points.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from dynamo.planner.connectors.kubernetes import (
    DEFAULT_DEPLOYMENTS,
    KubernetesConnector,
    KubernetesConnectorError,
)
from dynamo.planner.pools import PoolRole

pytestmark = pytest.mark.unit

RECORDINGS = Path(__file__).parent / "recordings"
ROOT = Path(__file__).resolve().parents[3]
NAMESPACE = "dynamo"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
MERGE_PATCH_TYPES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}
HANG_GUARD_S = 30.0


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    body: Any
    content_type: str | None


@dataclass
class RecordedApiServer:
    """Answers from one recording; `seen` lists the requests in arrival order. With `hold`
    set, every answer waits for that event first (at most HANG_GUARD_S)."""

    interactions: list[dict[str, Any]]
    seen: list[SeenRequest] = field(default_factory=list)
    hold: threading.Event | None = None
    held_until_released: list[bool] = field(default_factory=list)
    httpd: ThreadingHTTPServer | None = None

    def start(self) -> str:
        """Serve on a free port of 127.0.0.1 from a thread; the base URL."""
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        """Stop serving and close the port (connections to it are refused from now on)."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def answer(
        self, method: str, path: str, body: Any, content_type: str | None
    ) -> tuple[int, Any]:
        """Record the request; the recorded status and body for its method and path (501,
        which no test expects, for a request the recording does not hold)."""
        self.seen.append(SeenRequest(method, path, body, content_type))
        if self.hold is not None:
            self.held_until_released.append(self.hold.wait(HANG_GUARD_S))
        for interaction in self.interactions:
            request = interaction["request"]
            if request["method"] == method and request["path"] == path:
                return interaction["response"]["status"], interaction["response"]["body"]
        return 501, {"kind": "Status", "message": f"not in the recording: {method} {path}"}


def _handler(api: RecordedApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, body = api.answer(
                self.command,
                self.path.split("?", 1)[0],
                json.loads(raw) if raw else None,
                self.headers.get("Content-Type"),
            )
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the test reads `seen`, not the access log."""

    return Handler


@pytest.fixture
def serve() -> Iterator[Any]:
    """`serve(name)`: a server answering from recordings/<name>.json, and an ApiClient
    pointed at it."""
    started: list[tuple[RecordedApiServer, client.ApiClient]] = []

    def start(name: str) -> tuple[RecordedApiServer, client.ApiClient]:
        recording = json.loads((RECORDINGS / f"{name}.json").read_text())
        api = RecordedApiServer(recording["interactions"])
        api_client = client.ApiClient(client.Configuration(host=api.start()))
        started.append((api, api_client))
        return api, api_client

    yield start
    for api, api_client in started:
        api_client.close()
        api.stop()


async def _connector(api_client: client.ApiClient, **options: Any) -> KubernetesConnector:
    connector = KubernetesConnector(NAMESPACE, api_client=api_client, **options)
    await connector.start()
    return connector


def _path(name: str) -> str:
    return SCALE_PATH.format(ns=NAMESPACE, name=name)


async def test_replicas_is_what_runs_not_what_is_asked(serve) -> None:
    api, api_client = serve("prefill_scaling_up")
    connector = await _connector(api_client)
    assert await connector.replicas(PoolRole.PREFILL) == 2  # spec asks 3, 2 run
    assert api.seen == [SeenRequest("GET", _path("prefill-worker"), None, None)]


async def test_scale_sends_one_merge_patch_of_spec_replicas_and_logs_it(serve, caplog) -> None:
    api, api_client = serve("prefill_scaling_up")
    connector = await _connector(api_client)
    with caplog.at_level(logging.INFO, logger="dynamo.planner.connectors.kubernetes"):
        await connector.scale(PoolRole.PREFILL, 4)
    patches = [r for r in api.seen if r.method == "PATCH"]
    assert len(patches) == 1
    (patch,) = patches
    assert patch.path == _path("prefill-worker")
    assert patch.body == {"spec": {"replicas": 4}}
    assert patch.content_type in MERGE_PATCH_TYPES
    assert "prefill: 3 -> 4 replicas (Deployment dynamo/prefill-worker)" in caplog.messages


async def test_no_patch_when_the_deployment_already_asks_for_that_many(serve) -> None:
    api, api_client = serve("prefill_scaling_up")
    connector = await _connector(api_client)
    await connector.scale(PoolRole.PREFILL, 3)  # spec.replicas is 3 (2 of them run yet)
    assert [r.method for r in api.seen] == ["GET"]


async def test_a_count_the_api_leaves_out_is_zero(serve) -> None:
    api, api_client = serve("worker_at_zero")
    connector = await _connector(api_client)
    assert await connector.replicas(PoolRole.AGGREGATED) == 0
    await connector.scale(PoolRole.AGGREGATED, 1)
    assert [(r.method, r.path) for r in api.seen] == [
        ("GET", _path("worker")),
        ("GET", _path("worker")),
        ("PATCH", _path("worker")),
    ]
    assert api.seen[-1].body == {"spec": {"replicas": 1}}


async def test_a_missing_deployment_is_a_clear_error(serve) -> None:
    _, api_client = serve("prefill_not_found")
    connector = await _connector(api_client)
    with pytest.raises(KubernetesConnectorError) as caught:
        await connector.replicas(PoolRole.PREFILL)
    message = str(caught.value)
    assert caught.value.status == 404
    assert "prefill-worker" in message and f"namespace {NAMESPACE!r}" in message
    assert "disaggregated-planner" in message  # what to apply
    assert caught.value.__cause__ is None  # no ApiException chained into the traceback


async def test_missing_rbac_is_a_clear_error_naming_the_verb(serve) -> None:
    api, api_client = serve("worker_patch_forbidden")
    connector = await _connector(api_client)
    with pytest.raises(KubernetesConnectorError) as caught:
        await connector.scale(PoolRole.DECODE, 2)
    message = str(caught.value)
    assert caught.value.status == 403
    assert f"Deployment {NAMESPACE}/worker" in message
    assert "may not patch deployments/scale" in message
    assert "rbac.yaml" in message and "serviceAccountName: planner" in message
    assert "system:serviceaccount:dynamo:planner" in message  # the API server's own words
    assert [r.method for r in api.seen] == ["GET", "PATCH"]


async def test_an_api_server_that_does_not_answer_is_a_connector_error(serve) -> None:
    api, api_client = serve("prefill_scaling_up")
    api.stop()
    connector = await _connector(api_client)
    with pytest.raises(KubernetesConnectorError, match="cannot reach the Kubernetes API") as caught:
        await connector.replicas(PoolRole.PREFILL)
    assert caught.value.status is None
    assert "dynamo/prefill-worker" in str(caught.value)


async def test_the_event_loop_runs_while_a_call_waits_for_the_api_server(serve) -> None:
    """The server holds its answer until a task on the event loop has ticked three times:
    with the call in a thread the ticks happen and release it; a call blocking the loop
    would starve the ticker, and the server would answer only at the hang guard."""
    api, api_client = serve("prefill_scaling_up")
    release = api.hold = threading.Event()
    # The client waits longer than the server's hang guard: a blocked loop shows as no
    # ticks (an assertion), not as a client timeout.
    connector = await _connector(api_client, request_timeout_s=4 * HANG_GUARD_S)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
            if ticks >= 3:
                release.set()

    task = asyncio.create_task(ticker())
    try:
        replicas = await connector.replicas(PoolRole.PREFILL)
        ticks_during_call = ticks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert replicas == 2
    assert api.held_until_released == [True]
    assert ticks_during_call >= 3


async def test_without_a_client_start_loads_the_kubeconfig(serve, tmp_path, monkeypatch) -> None:
    _, api_client = serve("prefill_scaling_up")
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": api_client.configuration.host}}],
        "users": [{"name": "planner", "user": {"token": "recorded"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "planner"}}],
        "current-context": "test",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(path))
    connector = KubernetesConnector(NAMESPACE)
    await connector.start()
    try:
        assert await connector.replicas(PoolRole.PREFILL) == 2
    finally:
        await connector.close()


def test_the_planner_role_grants_what_the_connector_calls() -> None:
    """deploy/k8s/planner/rbac.yaml: get and patch of the pools' scale subresources (the
    calls above), bound to the ServiceAccount the planner's pod runs as."""
    planner_dir = ROOT / "deploy" / "k8s" / "planner"
    docs = {d["kind"]: d for d in yaml.safe_load_all((planner_dir / "rbac.yaml").read_text())}
    scale_rules = [r for r in docs["Role"]["rules"] if "deployments/scale" in r["resources"]]
    (rule,) = scale_rules
    assert rule["apiGroups"] == ["apps"]
    assert {"get", "patch"} <= set(rule["verbs"])
    assert set(DEFAULT_DEPLOYMENTS.values()) <= set(rule["resourceNames"])
    binding = docs["RoleBinding"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]
    (deployment,) = yaml.safe_load_all((planner_dir / "planner.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]


def test_the_planner_pod_reads_the_shipped_profile_where_its_flag_says() -> None:
    """deploy/k8s/planner/profile.yaml holds the embedded model's profile as shipped in
    engine_configs (no copy drifting from it), mounted where `--profile` points."""
    planner_dir = ROOT / "deploy" / "k8s" / "planner"
    (config_map,) = yaml.safe_load_all((planner_dir / "profile.yaml").read_text())
    shipped = ROOT / "engine_configs/profiles/smollm2-135m-instruct/eagle3.profile.json"
    ((key, text),) = config_map["data"].items()
    assert json.loads(text) == json.loads(shipped.read_text())
    (deployment,) = yaml.safe_load_all((planner_dir / "planner.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert f"--profile={mount['mountPath']}/{key}" in container["args"]
