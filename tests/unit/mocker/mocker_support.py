"""Helpers for the mocker engine's unit tests: small configs and request builders."""

from __future__ import annotations

from typing import Any

from dynamo.llm.protocols import (
    KvEventData,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.mocker import MockEngine, MockEngineConfig, TimingModel

# Steps take ~microseconds: the tests exercise scheduling, not wall-clock time. Lockstep
# (quantum 0): the engine yields after every step, so a test reading the stream sees the
# engine's state between steps (test_step_pacer.py covers the default pacing).
FAST = TimingModel(speed_up=1e6, quantum_ms=0)
VOCAB = 1000
EOS = 2


def config(**overrides: Any) -> MockEngineConfig:
    values: dict[str, Any] = dict(
        block_size=4,
        num_gpu_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=128,
        timing=FAST,
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
        special_token_ids=frozenset({0, 1, 2}),
    )
    values.update(overrides)
    return MockEngineConfig(**values)


def request(
    request_id: str,
    tokens: list[int],
    max_tokens: int | None = 8,
    *,
    seed: int | None = None,
    logprobs: int | None = None,
    **stop: Any,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id,
        model="mock",
        token_ids=list(tokens),
        sampling_options=SamplingOptions(seed=seed),
        stop_conditions=StopConditions(max_tokens=max_tokens, **stop),
        output_options=OutputOptions(logprobs=logprobs),
        eos_token_ids=[EOS],
    )


def prompt(n: int, offset: int = 100) -> list[int]:
    """`n` distinct non-special tokens; different offsets give disjoint prompts."""
    return list(range(offset, offset + n))


async def collect(engine: MockEngine, req: PreprocessedRequest) -> list[LLMEngineOutput]:
    return [output async for output in engine.generate(req)]


def tokens_of(outputs: list[LLMEngineOutput]) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


class EventLog:
    """Collects the engine's cache events (its `on_kv_events` sink)."""

    def __init__(self) -> None:
        self.events: list[KvEventData] = []

    def __call__(self, events: list[KvEventData]) -> None:
        self.events.extend(events)
