"""`python -m dynamo.nats_server` (see `dynamo.nats_server.cli`)."""

from dynamo.nats_server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
