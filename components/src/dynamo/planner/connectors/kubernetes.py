"""`KubernetesConnector`: each pool is a Deployment, sized through its scale subresource.

Why the scale subresource and not the Deployment: it holds the one field the planner owns
(`spec.replicas`), so a PATCH of it touches nothing else of the Deployment (image, args,
a rollout in progress), and RBAC can grant exactly it (`deployments/scale`).
deploy/k8s/planner/rbac.yaml is that grant.

Scaling down needs nothing more here: Kubernetes sends SIGTERM to the pods it removes, a
worker deregisters and drains on SIGTERM (`--drain-timeout`), and the kubelet waits
`terminationGracePeriodSeconds` (longer than the drain) before it kills the pod; what is
still running at the drain deadline migrates to another worker through the frontend.

The official client is synchronous (urllib3): every call runs in a thread, so a slow API
server delays the planner's decision, never its event loop (metrics, NATS, scrapes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

import urllib3.exceptions
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from dynamo.planner.connectors.base import ConnectorError
from dynamo.planner.pools import PoolRole

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_DEPLOYMENTS: Mapping[PoolRole, str] = MappingProxyType(
    {
        # deploy/k8s: the base `worker` is the aggregated worker, and the decode half in the
        # disaggregated overlay, whose prefill workers are `prefill-worker`.
        PoolRole.AGGREGATED: "worker",
        PoolRole.DECODE: "worker",
        PoolRole.PREFILL: "prefill-worker",
    }
)

DEFAULT_REQUEST_TIMEOUT_S = 10.0
"""Per API call: a call that hangs must not hold the planner's decision (nor a thread) for
ever; the next interval tries again."""

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by the kubelet in every container: the planner runs in a pod, use its ServiceAccount."""

RBAC_HINT = (
    "apply the planner's RBAC (deploy/k8s/planner/rbac.yaml, part of the overlays "
    "aggregated-planner and disaggregated-planner) in that namespace and run the planner "
    "with `serviceAccountName: planner`: its Role grants get/patch/update on "
    "deployments/scale"
)


class KubernetesConnectorError(ConnectorError):
    """A call to the Kubernetes API failed; the message says which Deployment and what to
    fix. `status` is the API's HTTP status (None: the API server was not reached)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        """Not reached, throttled, a conflict or a server error: worth another try."""
        return self.status is None or self.status in (409, 429) or self.status >= 500


@dataclass(frozen=True)
class _Scale:
    """A Deployment's scale subresource: what is asked (`spec`) and what runs (`status`)."""

    spec_replicas: int
    status_replicas: int


class KubernetesConnector:
    """Sets the replicas of each pool's Deployment in one namespace (`Connector`)."""

    def __init__(
        self,
        namespace: str,
        deployments: Mapping[PoolRole, str] = DEFAULT_DEPLOYMENTS,
        *,
        api_client: client.ApiClient | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        """`namespace`: the Kubernetes namespace of the Deployments (not the dynamo
        namespace). `api_client`: a ready client (tests, or a caller with its own
        configuration); without it `start` loads the in-cluster config or the kubeconfig."""
        self.namespace = namespace
        self.deployments = dict(deployments)
        self._request_timeout_s = request_timeout_s
        self._api_client = api_client
        self._owns_client = api_client is None
        self._apps: client.AppsV1Api | None = (
            client.AppsV1Api(api_client) if api_client is not None else None
        )

    async def start(self) -> None:
        if self._apps is not None:
            return
        # Loading a kubeconfig may run an exec credential plugin: off the event loop too.
        configuration = await asyncio.to_thread(load_configuration)
        self._api_client = client.ApiClient(configuration)
        self._apps = client.AppsV1Api(self._api_client)

    async def replicas(self, role: PoolRole) -> int:
        """The pods the Deployment runs now (`status.replicas`), ready or not."""
        return (await self._read_scale(role)).status_replicas

    async def scale(self, role: PoolRole, replicas: int) -> None:
        """Ask for `replicas` pods; no PATCH when the Deployment already asks for that many
        (so a steady planner writes nothing, and leaves no audit noise)."""
        if replicas < 0:
            raise ValueError(f"{role}: replicas must be >= 0, got {replicas}")
        current = (await self._read_scale(role)).spec_replicas
        if current == replicas:
            return
        name = self._deployment(role)
        body = {"spec": {"replicas": replicas}}
        await self._call(
            role,
            "patch",
            lambda apps: apps.patch_namespaced_deployment_scale(
                name, self.namespace, body, _request_timeout=self._request_timeout_s
            ),
        )
        log.info(
            "%s: %d -> %d replicas (Deployment %s/%s)",
            role,
            current,
            replicas,
            self.namespace,
            name,
        )

    async def close(self) -> None:
        """Release the client's connections; the Deployments keep their replicas."""
        if self._owns_client and self._api_client is not None:
            await asyncio.to_thread(self._api_client.close)
        self._api_client = None
        self._apps = None

    async def _read_scale(self, role: PoolRole) -> _Scale:
        name = self._deployment(role)
        scale = await self._call(
            role,
            "get",
            lambda apps: apps.read_namespaced_deployment_scale(
                name, self.namespace, _request_timeout=self._request_timeout_s
            ),
        )
        # The API omits a zero count (`omitempty`): absent means 0.
        return _Scale(
            spec_replicas=(scale.spec.replicas if scale.spec else None) or 0,
            status_replicas=(scale.status.replicas if scale.status else None) or 0,
        )

    async def _call(self, role: PoolRole, verb: str, request: Callable[[client.AppsV1Api], T]) -> T:
        """Run one API request in a thread; its failures become `KubernetesConnectorError`."""
        if self._apps is None:
            raise RuntimeError("KubernetesConnector: start() first")
        apps = self._apps
        try:
            return await asyncio.to_thread(request, apps)
        except ApiException as exc:
            raise self._api_error(role, verb, exc) from None
        except urllib3.exceptions.HTTPError as exc:
            host = apps.api_client.configuration.host
            raise KubernetesConnectorError(
                f"cannot reach the Kubernetes API server at {host} to {verb} the scale of "
                f"Deployment {self.namespace}/{self._deployment(role)} ({role} pool): {exc}"
            ) from None

    def _api_error(self, role: PoolRole, verb: str, exc: ApiException) -> KubernetesConnectorError:
        what = f"Deployment {self.namespace}/{self._deployment(role)} ({role} pool)"
        if exc.status == 404:
            advice = (
                f"no such Deployment in namespace {self.namespace!r}: apply the overlay that "
                "creates it (deploy/k8s/overlays/aggregated-planner or disaggregated-planner), "
                "or point --kubernetes-namespace at the namespace the workers run in"
            )
        elif exc.status == 403:
            advice = f"the planner's ServiceAccount may not {verb} deployments/scale: {RBAC_HINT}"
        elif exc.status == 401:
            advice = (
                "the API server refused the planner's credentials (an expired kubeconfig "
                "token, or a pod without its ServiceAccount token)"
            )
        else:
            advice = f"could not {verb} its scale"
        return KubernetesConnectorError(
            f"{what}: HTTP {exc.status} {exc.reason}: {advice}. API server: {_status_message(exc)}",
            status=exc.status,
        )

    def _deployment(self, role: PoolRole) -> str:
        try:
            return self.deployments[role]
        except KeyError:
            raise KubernetesConnectorError(
                f"no Deployment configured for the {role} pool (have: "
                f"{', '.join(f'{r}={d}' for r, d in self.deployments.items()) or 'none'})"
            ) from None


def load_configuration() -> client.Configuration:
    """The in-cluster configuration in a pod (its ServiceAccount token), else the
    kubeconfig (`$KUBECONFIG`, `~/.kube/config`, current context)."""
    configuration = client.Configuration()
    if os.environ.get(IN_CLUSTER_ENV):
        config.load_incluster_config(client_configuration=configuration)
    else:
        # Read $KUBECONFIG now: the client's own default is taken when it is imported.
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return configuration


def _status_message(exc: ApiException) -> str:
    """The `message` of the API's Status body (it names the user and the verb refused),
    else the raw body."""
    try:
        body = json.loads(exc.body or "")
    except ValueError:
        return exc.body or "(no body)"
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(body)
