"""Command line of `python -m dynamo.mocker`: flags → `MockerArgs` (no I/O, no NATS).

Engine flags keep vLLM's names where vLLM has the same knob (`--block-size`,
`--num-gpu-blocks`, `--max-num-seqs`, ...), so a mocker can stand in for a worker in a
launch script by swapping the module name and adding timing flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dynamo.llm.worker import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MIGRATION_LIMIT
from dynamo.llm.worker.flags import add_worker_runtime_arguments
from dynamo.llm.worker.inflight import max_inflight_or_env
from dynamo.llm.worker.roles import (
    DEFAULT_COMPONENT,
    PREFILL_COMPONENT,
    DisaggregationMode,
    component_for,
    disaggregation_mode_of,
    migration_limit_for,
)
from dynamo.mocker.acceptance import AcceptanceChange, AcceptanceModel
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.model_info import ModelInfo
from dynamo.mocker.roles import add_disaggregation_arguments
from dynamo.mocker.timing import TimingModel
from dynamo.runtime.cli import (
    ConfigError,
    add_log_level_argument,
    non_negative_int,
    port,
    positive_int,
)
from dynamo.runtime.nats_address import nats_url_from_env
from dynamo.runtime.nats_options import (
    NatsConnectOptions,
    add_nats_arguments,
    nats_options_from_args,
)
from dynamo.runtime.settings import Flag, add_setting_arguments, nested, setting, settings_from_args

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_SPECULATIVE_METHOD = "mocker"

T = TypeVar("T")


def fields_from(cls: type[T], source: object, **given: Any) -> T:
    """The dataclass `cls` filled from the same-named attributes of `source` (the parsed
    command line, or the settings it became), `given` naming the fields that are computed
    or named otherwise there; a field `source` lacks keeps its default. The flags, the
    settings, the engine config and the registration share their names, so each hand-over
    states only what differs instead of copying every field by name."""
    values = {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and f.name not in given and hasattr(source, f.name)
    }
    return cls(**values, **given)


@dataclass(frozen=True)
class WorkerSettings:
    """Where and as what each simulated worker registers."""

    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    served_model_name: str | None = None  # None: derived from the model
    nats_server: str | None = None  # None: $NATS_SERVER or nats://127.0.0.1:4222
    nats_options: NatsConnectOptions | None = None  # None: the NATS_* variables
    lease_ttl: float | None = None  # None: $DYN_LEASE_TTL or the runtime default
    speculative_method: str = DEFAULT_SPECULATIVE_METHOD
    publish_kv_events: bool = True
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    max_inflight_requests: int | None = None  # None: 4 x max_num_seqs; 0: no bound
    # The role in disaggregated serving (`roles`); set `component` and `migration_limit`
    # to match (the command line does: `prefill` and 0 for a prefill worker).
    disaggregation_mode: DisaggregationMode = "agg"


CACHE_GROUP = "engine capacity and scheduling"
TIMING_GROUP = "timing model"
SPECULATIVE_GROUP = "speculative decoding"
GENERATED_GROUP = "generated tokens"


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags as given; combined with the model's facts by `engine_config`.

    A field with a `Flag` is its own command-line flag (`dynamo.runtime.settings`), so the
    flag, its default and the field are written once. The acceptance flags are a mutually
    exclusive pair, which a `Flag` cannot say, so `build_parser` adds them by hand.
    """

    block_size: int = setting(
        16, Flag("--block-size", "Tokens per KV block.", type=int, group=CACHE_GROUP)
    )
    num_gpu_blocks: int = setting(
        16384,
        Flag(
            "--num-gpu-blocks",
            "KV blocks per worker; cached blocks are evicted least recently used first.",
            type=int,
            group=CACHE_GROUP,
        ),
    )
    max_num_seqs: int = setting(
        256,
        Flag(
            "--max-num-seqs",
            "Most requests running at once per worker.",
            type=int,
            group=CACHE_GROUP,
        ),
    )
    max_num_batched_tokens: int = setting(
        8192,
        Flag(
            "--max-num-batched-tokens",
            "Token budget of one step: decodes take 1+K each, prefill chunks the rest.",
            type=int,
            group=CACHE_GROUP,
        ),
    )
    max_model_len: int | None = setting(
        None,
        Flag(
            "--max-model-len",
            "Context length (default: the model's max_position_embeddings, else 8192).",
            type=int,
            group=CACHE_GROUP,
        ),
    )
    enable_prefix_caching: bool = setting(
        True,
        Flag(
            "--enable-prefix-caching",
            "Reuse cached prompt blocks across requests (off: no hits and no KV events).",
            negatable=True,
            group=CACHE_GROUP,
        ),
    )
    kv_host_blocks: int = setting(
        0,
        Flag(
            "--kv-host-blocks",
            "Blocks of a second KV tier in host memory (as vLLM's CPU offloading): a block "
            "evicted from the device moves there (KV events: removed on GPU, stored on "
            "CPU), the least recently used is dropped when it is full (removed on CPU), "
            "and a prefix hit there is loaded back to the device for "
            "--kv-onboard-ms-per-token and counted as cached. 0: no second tier.",
            type=non_negative_int,
            group=CACHE_GROUP,
        ),
    )
    max_logprobs: int = setting(
        20,
        Flag(
            "--max-logprobs",
            "Most log probabilities a request may ask for per token, as vLLM's flag: a "
            "request asking for more is refused as the client's error (HTTP 400).",
            type=non_negative_int,
            group=CACHE_GROUP,
        ),
    )
    num_speculative_tokens: int = setting(
        0,
        Flag(
            "--num-speculative-tokens",
            "Draft tokens K per step; each step yields 1..K+1 tokens. Advertised in the model "
            "card so the KV router counts the K speculative slots per request.",
            type=int,
            group=SPECULATIVE_GROUP,
        ),
    )
    acceptance_rates: tuple[float, ...] = (0.7,)
    acceptance_distribution: tuple[float, ...] | None = None
    # (seconds after the start, rates) of --acceptance-rate-after, in time order.
    acceptance_after: tuple[tuple[float, tuple[float, ...]], ...] = ()
    acceptance_epoch: float | None = None  # --acceptance-clock-start
    timing: TimingModel = nested(TimingModel, group=TIMING_GROUP)
    eos_probability: float = setting(
        0.0,
        Flag(
            "--eos-probability",
            "Chance that a generated token is EOS (0: requests run to max_tokens unless a stop "
            "token is drawn).",
            type=float,
            group=GENERATED_GROUP,
        ),
    )
    seed: int = setting(
        0,
        Flag(
            "--seed",
            "Seed of the generated tokens and acceptance draws (a request's own seed is mixed in).",
            type=int,
            group=GENERATED_GROUP,
        ),
    )

    def engine_config(self, model: ModelInfo) -> MockEngineConfig:
        """The engine configuration for `model`; raises ConfigError on bad combinations."""
        k = self.num_speculative_tokens
        try:
            if self.acceptance_distribution is not None:
                acceptance = AcceptanceModel.from_distribution(self.acceptance_distribution, k)
            else:
                acceptance = AcceptanceModel.from_rates(self.acceptance_rates, k)
            changes = tuple(
                AcceptanceChange(after_s, AcceptanceModel.from_rates(rates, k))
                for after_s, rates in sorted(self.acceptance_after)
            )
            return fields_from(
                MockEngineConfig,
                self,
                max_model_len=self.max_model_len or model.max_position_embeddings or 8192,
                acceptance=acceptance,
                acceptance_changes=changes,
                acceptance_epoch=self.acceptance_epoch,
                vocab_size=model.vocab_size,
                eos_token_ids=model.eos_token_ids,
                special_token_ids=model.special_token_ids,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


@dataclass(frozen=True)
class MockerArgs:
    model: str
    engine: EngineFlags
    worker: WorkerSettings
    num_workers: int = 1
    system_port: int | None = None
    log_level: str = "INFO"


def timed_rates(text: str) -> tuple[float, tuple[float, ...]]:
    """`SECONDS:RATES` of --acceptance-rate-after."""
    when, sep, rates = text.partition(":")
    try:
        after_s = float(when)
    except ValueError:
        after_s = -1.0
    if not sep or after_s < 0:
        raise argparse.ArgumentTypeError(f"expected SECONDS:RATES (e.g. 300:0.3), got {text!r}")
    return after_s, float_list(rates)


def float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except `None` (those flags say in words what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.mocker",
        description=(
            "Simulated LLM workers with the wire behaviour of `python -m dynamo.vllm`: they "
            "register a model card, serve `generate` and `clear_kv_blocks` over NATS, "
            "publish KV-cache events and load, and stream token ids, but only simulate the "
            "engine (KV blocks with prefix caching, continuous batching, step times, "
            "speculative decoding). For router and scale tests; see docs/mocker.md."
        ),
        formatter_class=_HelpFormatter,
    )
    where = parser.add_argument_group("registration")
    where.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=DEFAULT_MODEL,
        help=(
            "Embedded model name or Hugging Face model directory. Only its tokenizer files "
            "(published with the model card so frontends tokenize as for a real worker) and "
            "config.json (vocabulary, EOS, context length) are read; no weights."
        ),
    )
    where.add_argument(
        "--served-model-name",
        default=None,
        help="Model name clients use (default: the embedded model's name or the directory name).",
    )
    add_worker_runtime_arguments(where)
    where.add_argument(
        "--component",
        default=None,
        help=f"Component name of the workers (default: {DEFAULT_COMPONENT!r}, or "
        f"{PREFILL_COMPONENT!r} for prefill workers, as for vLLM workers).",
    )
    add_nats_arguments(parser.add_argument_group("NATS authentication and TLS"))
    where.add_argument(
        "--num-workers",
        type=positive_int,
        default=1,
        help=(
            "Simulated workers in this process, each with its own NATS connection, instance "
            "id, engine, model card and KV events (scale tests: many workers, one process)."
        ),
    )
    where.add_argument(
        "--speculative-method",
        default=DEFAULT_SPECULATIVE_METHOD,
        help="Method name advertised in the model card when --num-speculative-tokens > 0.",
    )
    where.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Publish KV-cache events (stored / removed / cleared) for the KV router.",
    )
    where.add_argument(
        "--system-port",
        type=port,
        default=None,
        help="Serve /metrics, /health and /live on this port (0: any free port; default: off).",
    )
    where.add_argument(
        "--migration-limit",
        type=non_negative_int,
        default=None,
        help="Advertised on the model card, as by a vLLM worker: how often a frontend may "
        "move a request to another worker when this one dies mid-stream (the prompt plus "
        "the tokens generated so far are resent); 0 fails the request instead (default: "
        f"{DEFAULT_MIGRATION_LIMIT}, or 0 for prefill workers).",
    )
    add_log_level_argument(where)
    add_disaggregation_arguments(parser.add_argument_group("disaggregated serving"))

    # The groups in --help order; the flags declared on `EngineFlags` fill them.
    groups = {
        CACHE_GROUP: parser.add_argument_group(CACHE_GROUP),
        TIMING_GROUP: parser.add_argument_group(
            TIMING_GROUP,
            "step_ms = decode-ms-per-step + decode-ms-per-token x decode requests x (1+K) "
            "+ prefill-ms-per-token x prefill tokens + draft-ms-per-token x K; "
            "the simulation waits step_ms / speed-up. A decode worker's KV transfer from a "
            "prefill worker takes kv-transfer-overhead-ms + kv-transfer-ms-per-token x "
            "uncached prompt tokens, beside the steps.",
        ),
        SPECULATIVE_GROUP: parser.add_argument_group(SPECULATIVE_GROUP),
        GENERATED_GROUP: parser.add_argument_group(GENERATED_GROUP),
    }
    add_setting_arguments(parser, EngineFlags, groups=groups)
    spec = groups[SPECULATIVE_GROUP]
    accept = spec.add_mutually_exclusive_group()
    accept.add_argument(
        "--acceptance-rate",
        type=float_list,
        default="0.7",
        help="Probability that a draft is accepted given the drafts before it were: one value "
        "for every position, or K comma-separated values (position 0 first).",
    )
    accept.add_argument(
        "--acceptance-distribution",
        type=float_list,
        default=None,
        help="Instead of rates: K+1 comma-separated weights of accepting exactly 0..K drafts "
        "(e.g. a measured acceptance histogram).",
    )
    spec.add_argument(
        "--acceptance-rate-after",
        type=timed_rates,
        action="append",
        default=[],
        metavar="SECONDS:RATES",
        help="From SECONDS after the start, accept with these rates instead (one value, or K "
        "comma-separated); repeat for several changes. A workload whose acceptance drifts, "
        "e.g. 300:0.3 after five minutes.",
    )
    spec.add_argument(
        "--acceptance-clock-start",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="Count --acceptance-rate-after from this UNIX time instead of the worker's start, "
        "so workers started at different times change together.",
    )

    return parser


def parse_args(argv: Sequence[str] | None = None) -> MockerArgs:
    """Parse the command line; argparse exits with code 2 on malformed flags, ConfigError
    is raised for values that are well-formed but unusable."""
    ns = build_parser().parse_args(argv)
    try:
        engine = settings_from_args(
            EngineFlags,
            ns,
            acceptance_rates=ns.acceptance_rate,
            acceptance_distribution=ns.acceptance_distribution,
            acceptance_after=tuple(ns.acceptance_rate_after),
            acceptance_epoch=ns.acceptance_clock_start,
        )
    except ValueError as exc:  # the timing model refuses negative times
        raise ConfigError(str(exc)) from exc
    mode = disaggregation_mode_of(ns)
    worker = fields_from(
        WorkerSettings,
        ns,
        nats_options=nats_options_from_args(ns, url=ns.nats_server or nats_url_from_env()),
        publish_kv_events=ns.kv_events,
        max_inflight_requests=max_inflight_or_env(ns.max_inflight_requests),
        disaggregation_mode=mode,
        component=component_for(mode, ns.component),
        migration_limit=migration_limit_for(mode, ns.migration_limit),
    )
    return fields_from(MockerArgs, ns, engine=engine, worker=worker)


def resolve_model_dir(model: str) -> Path:
    """The model directory for `--model` (an embedded model is prepared when missing)."""
    from dynamo.llm.models import resolve_model

    return Path(resolve_model(model))


def served_model_name(args: MockerArgs) -> str:
    if args.worker.served_model_name:
        return args.worker.served_model_name
    from dynamo.llm.models.prepare import served_name_for

    return served_name_for(args.model)
