"""How the planner sets replicas: `Connector` and its implementations (`local`: worker
processes on this machine; `kubernetes`: the scale subresource of Deployments)."""

from dynamo.planner.connectors.base import Connector, ConnectorError

__all__ = ["Connector", "ConnectorError"]
