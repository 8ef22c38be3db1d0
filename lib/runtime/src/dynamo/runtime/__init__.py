"""`dynamo.runtime`: discovery, endpoints, streaming and events over NATS.

runtime = await DistributedRuntime.connect("nats://127.0.0.1:4222")
endpoint = runtime.namespace("dynamo").component("backend").endpoint("generate")
await endpoint.serve(handler)                    # handler(request, ctx) -> async gen
client = await endpoint.client()
async for item in client.round_robin(request):   # or .random(), .direct(req, id)
    ...
"""

from dynamo.runtime.client import Client
from dynamo.runtime.errors import (
    ClientClosedError,
    ConnectionLostError,
    DynamoRuntimeError,
    FramesLostError,
    InstanceGoneError,
    InstanceOverloadedError,
    InvalidRequestError,
    NoInstancesError,
    NoResponderError,
    RemoteError,
    RequestNotAcceptedError,
    RequestRefusedError,
    RequestTooLargeError,
    RuntimeClosedError,
    StreamProtocolError,
    StreamTimeoutError,
    WorkerOverloadedError,
)
from dynamo.runtime.response_stream import ResponseStream
from dynamo.runtime.runtime import Component, DistributedRuntime, Endpoint, Namespace
from dynamo.runtime.served_endpoint import ServedEndpoint
from dynamo.runtime.server import Context
from dynamo.runtime.wire import ErrorKind, InstanceInfo, InstanceStatus

__all__ = [
    "Client",
    "ClientClosedError",
    "Component",
    "ConnectionLostError",
    "Context",
    "DistributedRuntime",
    "DynamoRuntimeError",
    "Endpoint",
    "ErrorKind",
    "FramesLostError",
    "InstanceGoneError",
    "InstanceInfo",
    "InstanceOverloadedError",
    "InstanceStatus",
    "InvalidRequestError",
    "Namespace",
    "NoInstancesError",
    "NoResponderError",
    "RemoteError",
    "RequestNotAcceptedError",
    "RequestRefusedError",
    "RequestTooLargeError",
    "ResponseStream",
    "RuntimeClosedError",
    "ServedEndpoint",
    "StreamProtocolError",
    "StreamTimeoutError",
    "WorkerOverloadedError",
]
