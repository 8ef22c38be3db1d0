"""`dynamo.nats_server`: the development `nats-server` manager, a tool of its own beside the
runtime (which only connects to NATS and never imports this package).

* `NatsServer` (`server.py`): one managed `nats-server` with JetStream on a given or
  ephemeral port and a private store, tied to the process that starts it;
  `ensure_nats_server` reuses a reachable `$NATS_SERVER` instead;
* `NatsCluster` (`cluster.py`): a local JetStream cluster of them;
* `ServerSecurity` (`security.py`): authentication and TLS for either;
* `python -m dynamo.nats_server` (`cli.py`): either in the foreground, for the launch
  scripts and development.
"""

from dynamo.nats_server.cluster import NatsCluster
from dynamo.nats_server.security import ServerSecurity
from dynamo.nats_server.server import (
    ClusterMembership,
    NatsServer,
    NatsServerError,
    ensure_nats_server,
    find_nats_server_binary,
)

__all__ = [
    "ClusterMembership",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "ServerSecurity",
    "ensure_nats_server",
    "find_nats_server_binary",
]
