"""OpenAI-compatible HTTP frontend: `python -m dynamo.frontend`."""
