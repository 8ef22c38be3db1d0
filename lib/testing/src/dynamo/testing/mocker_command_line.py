"""The command line of the simulated worker (`python -m dynamo.mocker`), as an argv list,
beside `dynamo.testing.command_lines`' builders for the vLLM worker and the frontend."""

from __future__ import annotations

from pathlib import Path

from dynamo.testing.command_lines import dynamo_worker_argv


def mocker_argv(
    model: str | Path,
    nats_url: str,
    namespace: str,
    *extra: str,
    served_model_name: str | None = None,
) -> list[str]:
    """`python -m dynamo.mocker` with `model`'s tokenizer and vocabulary in `namespace`
    (serving it as `served_model_name` when given), then `extra`."""
    served = ["--served-model-name", served_model_name] if served_model_name else []
    return dynamo_worker_argv("dynamo.mocker", model, nats_url, namespace, *served, *extra)
