"""Command line of `python -m dynamo.vllm`: vLLM's own engine flags plus the worker's.

Every AsyncEngineArgs flag comes from vLLM's parser (`AsyncEngineArgs.add_cli_args`), so the
worker accepts exactly what `vllm serve` accepts for the engine, typed and validated the
same way. On top sit the runtime flags (NATS, endpoint names, disaggregation) and the
merging of configuration sources (see `--help` and docs/speculative_decoding.md):

* engine keys: vLLM defaults < `--extra-engine-args` file < explicit command-line flags;
* speculative config: speculators checkpoint (`--model`) < `--extra-engine-args` <
  `--speculative-config` < `--spec-method/--spec-model/--spec-tokens`;
* engine-level flags (`--max-model-len`, `--tensor-parallel-size`, `--seed`, ...) apply to
  target and draft: vLLM derives the draft's from the target's, and an explicit flag
  removes a draft-level copy of itself from the speculative config.

The file layer is typed by feeding its keys through the same parser, so `max_model_len:
4k` in YAML means what `--max-model-len 4k` means.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import logging
import os
import secrets
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from dynamo.llm.models import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ModelNotPreparedError,
    PrepareError,
    UnknownModelError,
    resolve_model,
)
from dynamo.llm.models import model_dir as cached_model_dir
from dynamo.llm.models.prepare import served_name_for
from dynamo.vllm import spec_config as sc
from dynamo.vllm.spec_config import ConfigError

__all__ = [
    "ConfigError",
    "WorkerConfig",
    "build_parser",
    "parse_worker_args",
    "resolved_config_lines",
    "resolved_config_yaml",
]

log = logging.getLogger("dynamo.vllm")

DisaggregationMode = Literal["agg", "prefill", "decode"]
WORKER_GROUP = "DynamoWorker"
DEFAULT_NAMESPACE = "dynamo"
DEFAULT_COMPONENT = "backend"
PREFILL_COMPONENT = "prefill"
DEFAULT_ENDPOINT = "generate"
DEFAULT_NATS = "nats://127.0.0.1:4222"
DEFAULT_LEASE_TTL = 5.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
CPU_BLOCK_MULTIPLE = 32
KV_SHARED_STORAGE_ENV = "DYN_KV_SHARED_STORAGE_PATH"

# Sources, as they appear in logs and in the dry-run's `sources:` section.
SRC_VLLM = "vllm default"
SRC_WORKER = "worker default"
SRC_CLI = "cli"
SRC_FILE = "extra-engine-args"
SRC_JSON = "--speculative-config"
SRC_SPEC_FLAGS = "--spec-method/--spec-model/--spec-tokens"
SRC_SPECULATORS = "speculators checkpoint"

_SPEC_FLAGS = {
    "spec_method": "method",
    "spec_model": "model",
    "spec_tokens": "num_speculative_tokens",
}
"""vLLM's shorthand flags for the speculative config; folded into it here so the
precedence above holds (vLLM itself would refuse them next to `--speculative-config`)."""

_DRAFT_TWINS = {
    "max_model_len": "max_model_len",
    "enforce_eager": "enforce_eager",
    "tensor_parallel_size": "draft_tensor_parallel_size",
}
"""Engine flag -> the speculative-config key that would set it for the draft only."""

_INTERNAL_SPEC_FIELDS = frozenset(
    {"target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
)
_NO_DRAFT_MODEL_METHODS = frozenset({"ngram", "ngram_gpu", "suffix", "extract_hidden_states"})
_K_REQUIRED_METHODS = frozenset({"ngram", "draft_model", "eagle", "eagle3"})

_DESCRIPTION = """\
A vLLM engine with speculative decoding, served over NATS (Dynamo-style worker).

Engine settings, lowest precedence first:
  vLLM defaults < --extra-engine-args FILE.yaml < explicit command-line flags.
Speculative decoding settings, lowest precedence first:
  1. the speculators config embedded in --model (config.json with `speculators_config`:
     its verifier becomes the target model, its proposal the speculative config);
  2. `speculative_config` in --extra-engine-args (native vLLM keys, or TensorRT-LLM form
     with `decoding_type`, translated: see docs/speculative_decoding.md);
  3. --speculative-config JSON;
  4. --spec-method / --spec-model / --spec-tokens.
  Keys merge one by one; a higher source naming a different `method` replaces the lower ones.
Engine-level flags (--max-model-len, --tensor-parallel-size, --seed, --enforce-eager, ...)
apply to target and draft alike. Contradicting keys inside one file are an error; a file
value the command line overrides is replaced (logged at INFO).

Defaults the worker adds where you are silent: --model is the embedded model
`smollm2-135m-instruct`; KV-cache events are published over ZMQ on a private Unix socket (unless
prefix caching is off or --kv-events-config is given); prefill/decode workers without
--kv-transfer-config use NixlConnector on a GPU and, on CPU, vLLM's ExampleConnector with
shared_storage_path $DYN_KV_SHARED_STORAGE_PATH (default /tmp/dynamo-kv-<namespace>), a
directory prefill and decode must share (one host or a shared filesystem). On CPU a block
size you give must be a multiple of 32.
"""

_EPILOG = """\
The vLLM engine flags are summarised above by group. See them in full with --help=all, one
group with --help=<group> (e.g. --help=ModelConfig, --help=DynamoWorker), or those whose
name contains a word with --help=<word> (e.g. --help=max-model-len).
--dry-run prints the resolved configuration as YAML and exits without loading weights.
"""


# --------------------------------------------------------------------------- config object


@dataclasses.dataclass
class WorkerConfig:
    """Everything `main` needs to start one worker; built only by `parse_worker_args`."""

    engine_args: AsyncEngineArgs
    disaggregation_mode: DisaggregationMode
    namespace: str
    component: str
    endpoint: str
    served_model_name: str
    model_path: Path
    """Local directory of the target model (tokenizer files for the model card)."""
    nats_server: str
    lease_ttl: float
    system_port: int | None
    """Metrics/health HTTP port; None disables the server, 0 picks a free port."""
    kv_events_port: int | None
    """Port vLLM's KV-event publisher binds (`tcp://*:<port>`; subscribers connect to
    127.0.0.1); None when KV events are off."""
    migration_limit: int
    dry_run: bool
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    extra_engine_args: Path | None = None
    speculators_checkpoint: Path | None = None
    """The speculators checkpoint given as --model, now the draft `model`."""
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    """Engine key (and `speculative_config.<key>`) -> where its value came from."""
    ignored_keys: list[str] = dataclasses.field(default_factory=list)
    """--extra-engine-args keys vLLM has no meaning for."""

    @property
    def speculative_config(self) -> dict[str, Any] | None:
        return self.engine_args.speculative_config

    @property
    def kv_events_endpoint(self) -> str | None:
        """vLLM's publisher endpoint (bind form); None when events are off."""
        cfg = self.engine_args.kv_events_config
        return cfg.endpoint if cfg is not None and cfg.enable_kv_cache_events else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        cfg = self.engine_args.kv_events_config
        return cfg.replay_endpoint if cfg is not None and cfg.enable_kv_cache_events else None


# --------------------------------------------------------------------------- parser


class WorkerArgumentParser(FlexibleArgumentParser):
    """vLLM's parser, raising ConfigError instead of exiting, with a help page that shows
    the worker's flags in full and vLLM's ~250 engine flags by group."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)

    def format_help(self) -> str:
        if self._search_keyword is not None:
            return super().format_help()
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        engine_groups = []
        for group in self._action_groups:
            if group.title == WORKER_GROUP:
                formatter.start_section(f"{group.title} (runtime flags)")
                formatter.add_text(group.description)
                formatter.add_arguments(group._group_actions)
                formatter.end_section()
            elif group._group_actions and group.title not in ("positional arguments", "options"):
                engine_groups.append(f"{group.title}: {_first_sentence(group.description)}")
        formatter.start_section("vLLM engine flag groups")
        formatter.add_text("\n".join(engine_groups))
        formatter.end_section()
        formatter.add_text(self.epilog)
        return formatter.format_help()


def _first_sentence(text: str | None) -> str:
    first = " ".join((text or "").split("\n\n", 1)[0].split())
    return first.split(". ", 1)[0].rstrip(".")


def build_parser() -> WorkerArgumentParser:
    """The full parser: the worker's runtime flags, then every vLLM AsyncEngineArgs flag."""
    parser = WorkerArgumentParser(
        prog="python -m dynamo.vllm",
        usage="python -m dynamo.vllm [--model MODEL] [worker flags] [vLLM engine flags]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
    )
    _add_worker_flags(parser)
    AsyncEngineArgs.add_cli_args(parser)
    parser.set_defaults(model=DEFAULT_MODEL)
    for action in parser._actions:
        if action.dest == "speculative_config":
            action.type = _explain_json_errors(action.type)
        if action.dest == "model":
            action.help = (
                "Target model: an embedded model name (see `python -m dynamo.llm.models list`) "
                "or a local model directory, including a speculators checkpoint."
            )
    return parser


def _explain_json_errors(parse: Any) -> Any:
    """Wrap vLLM's JSON flag parser so that malformed JSON is reported with what is wrong
    and where, instead of "Value ... cannot be converted to <function loads at 0x...>"."""

    def parse_json(text: str) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            try:
                json.loads(text)
            except json.JSONDecodeError as exc:
                raise argparse.ArgumentTypeError(
                    f"not valid JSON ({exc.msg} at column {exc.colno}): {text!r}"
                ) from None
            raise

    return parse_json


_OWN_DEFAULT = "%(default).0s"
"""Ends help texts that state their default in words: an empty format field, which stops
argparse appending a misleading "(default: None)"."""


def _add_worker_flags(parser: FlexibleArgumentParser) -> None:
    group = parser.add_argument_group(WORKER_GROUP, "Dynamo runtime settings of this worker.")
    group.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="Dynamo namespace to serve in."
    )
    group.add_argument(
        "--component",
        default=None,
        help=f"Component name (default: {DEFAULT_COMPONENT!r}, or {PREFILL_COMPONENT!r} for prefill workers).{_OWN_DEFAULT}",
    )
    group.add_argument(
        "--endpoint", default=DEFAULT_ENDPOINT, help="Name of the generate endpoint."
    )
    group.add_argument(
        "--disaggregation-mode",
        choices=("agg", "prefill", "decode"),
        default=None,
        help="Aggregated worker, or one half of disaggregated serving (default: agg)."
        + _OWN_DEFAULT,
    )
    group.add_argument(
        "--is-prefill-worker", action="store_true", help="Same as --disaggregation-mode prefill."
    )
    group.add_argument(
        "--is-decode-worker", action="store_true", help="Same as --disaggregation-mode decode."
    )
    group.add_argument(
        "--extra-engine-args",
        metavar="FILE.yaml",
        default=None,
        help="Engine config file: native vLLM keys (AsyncEngineArgs field names, "
        "`speculative_config` a mapping) or TensorRT-LLM form (`speculative_config.decoding_type`, "
        "`max_batch_size`, `kv_cache_config`, ...). Command-line flags override it.",
    )
    group.add_argument(
        "--migration-limit",
        type=int,
        default=0,
        help="How often a request may move to another worker when this one dies mid-stream: "
        "the frontend resends the prompt plus the tokens generated so far to another "
        "instance, and the client sees one uninterrupted stream (default 0: fail the request).",
    )
    group.add_argument(
        "--system-port",
        type=int,
        default=None,
        help="Port of the metrics/health HTTP server; 0 picks a free port "
        "(default: $DYN_SYSTEM_PORT, else disabled)." + _OWN_DEFAULT,
    )
    group.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="TCP port vLLM publishes KV-cache events on, for consumers on other hosts "
        "(default: a private Unix socket, ipc://$TMPDIR/dynamo-kv-*-events.sock)." + _OWN_DEFAULT,
    )
    group.add_argument(
        "--nats-server",
        default=None,
        help=f"NATS URL (default: $NATS_SERVER, else {DEFAULT_NATS}).{_OWN_DEFAULT}",
    )
    group.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_LEASE_TTL,
        help="Seconds a registration outlives a silent worker.",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="On SIGTERM/SIGINT: seconds in-flight requests get to finish after the worker "
        "deregisters; what is still running then is aborted.",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Print the resolved configuration as YAML and exit 0 without loading weights.",
    )


def _worker_dests(parser: argparse.ArgumentParser) -> set[str]:
    for group in parser._action_groups:
        if group.title == WORKER_GROUP:
            return {action.dest for action in group._group_actions}
    raise AssertionError("worker flag group missing")


@contextmanager
def _defaults_hidden(parser: argparse.ArgumentParser) -> Iterator[None]:
    """While active, parsing yields only the options actually given (argparse knows no
    other way to tell `--seed 0` from the default 0, and precedence needs exactly that)."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        yield
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(saved_defaults)


def explicit_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """dest -> typed value for every option present in `argv`, and nothing else."""
    with _defaults_hidden(parser):
        return vars(parser.parse_args(list(argv)))


# --------------------------------------------------------------------------- entry point


@dataclasses.dataclass
class _Layers:
    """What each source contributes, before merging."""

    defaults: dict[str, Any]
    file: sc.EngineFileConfig | None
    file_values: dict[str, Any]
    file_spec: dict[str, Any] | None
    cli_values: dict[str, Any]
    cli_spec_json: dict[str, Any] | None
    cli_spec_flags: dict[str, Any] | None


def parse_worker_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Parse the command line (and the files it names) into a WorkerConfig.

    Raises ConfigError for anything the worker must not start with.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    full = vars(parser.parse_args(argv))
    mode = _disaggregation_mode(full)
    dry_run = bool(full["dry_run"])
    layers = _collect_layers(parser, full, explicit_values(parser, argv))

    values, sources = _layer_engine_values(
        layers.defaults, layers.file_values, layers.cli_values, layers.file
    )
    target_dir, checkpoint = _resolve_target(values, sources, dry_run=dry_run)
    served = _served_name(values, sources)
    _resolve_speculative(values, sources, layers, checkpoint, dry_run=dry_run)
    _check_block_size(values, sources)
    kv_events_port = _configure_kv_events(values, sources, full["kv_events_port"])
    _configure_kv_transfer(values, sources, mode, full["namespace"])
    if layers.file is not None and layers.file.ignored:
        log.warning(
            "--extra-engine-args %s: ignoring keys with no vLLM meaning: %s",
            full["extra_engine_args"],
            ", ".join(layers.file.ignored),
        )
    return WorkerConfig(
        engine_args=AsyncEngineArgs.from_cli_args(argparse.Namespace(**values)),
        disaggregation_mode=mode,
        namespace=full["namespace"],
        component=full["component"]
        or (PREFILL_COMPONENT if mode == "prefill" else DEFAULT_COMPONENT),
        endpoint=full["endpoint"],
        served_model_name=served,
        model_path=target_dir,
        nats_server=full["nats_server"] or os.environ.get("NATS_SERVER") or DEFAULT_NATS,
        lease_ttl=_positive(full["lease_ttl"], "--lease-ttl"),
        system_port=_system_port(full["system_port"]),
        kv_events_port=kv_events_port,
        migration_limit=_non_negative(full["migration_limit"], "--migration-limit"),
        dry_run=dry_run,
        drain_timeout_s=_non_negative(full["drain_timeout"], "--drain-timeout"),
        extra_engine_args=Path(full["extra_engine_args"]) if full["extra_engine_args"] else None,
        speculators_checkpoint=checkpoint.path if checkpoint else None,
        sources=sources,
        ignored_keys=list(layers.file.ignored) if layers.file else [],
    )


def _collect_layers(
    parser: argparse.ArgumentParser, full: Mapping[str, Any], given: Mapping[str, Any]
) -> _Layers:
    """Split the sources: vLLM defaults, the engine file, and what the command line gave."""
    engine_fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    path = full["extra_engine_args"]
    file_cfg = _read_file_layer(path, engine_fields, _speculative_fields())
    file_values, file_spec = _typed_file_values(parser, file_cfg, path)
    worker_dests = _worker_dests(parser)
    cli_values = {k: v for k, v in given.items() if k not in worker_dests}
    cli_spec_json = _cli_speculative_json(cli_values.pop("speculative_config", None))
    return _Layers(
        defaults={k: v for k, v in vars(parser.parse_args([])).items() if k in engine_fields},
        file=file_cfg,
        file_values=file_values,
        file_spec=file_spec,
        cli_values=cli_values,
        cli_spec_json=cli_spec_json,
        cli_spec_flags=_pop_spec_flags(cli_values),
    )


# --------------------------------------------------------------------------- runtime flags


def _disaggregation_mode(full: Mapping[str, Any]) -> DisaggregationMode:
    """`--disaggregation-mode`, with `--is-prefill-worker`/`--is-decode-worker` as aliases."""
    prefill, decode, mode = (
        full["is_prefill_worker"],
        full["is_decode_worker"],
        full["disaggregation_mode"],
    )
    if prefill and decode:
        raise ConfigError("--is-prefill-worker and --is-decode-worker are mutually exclusive")
    alias = "prefill" if prefill else "decode" if decode else None
    if alias and mode and mode != alias:
        raise ConfigError(f"--is-{alias}-worker contradicts --disaggregation-mode {mode}")
    return alias or mode or "agg"


def _system_port(value: int | None) -> int | None:
    if value is None:
        env = os.environ.get("DYN_SYSTEM_PORT", "").strip()
        if not env:
            return None
        try:
            value = int(env)
        except ValueError as exc:
            raise ConfigError(f"$DYN_SYSTEM_PORT must be a port number, got {env!r}") from exc
    return _port(value, "--system-port")


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{flag} must be between 0 and 65535, got {value}")
    return value


def _positive(value: float, flag: str) -> float:
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, got {value}")
    return value


def _non_negative(value: float, flag: str) -> float:
    if value < 0:
        raise ConfigError(f"{flag} must not be negative, got {value}")
    return value


# --------------------------------------------------------------------------- engine layers


@functools.cache
def _speculative_fields() -> frozenset[str]:
    from vllm.config.speculative import SpeculativeConfig

    return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)) - _INTERNAL_SPEC_FIELDS


@functools.cache
def _speculative_methods() -> frozenset[str]:
    from vllm.config.speculative import SpeculativeMethod

    return frozenset(get_args(SpeculativeMethod))


def _read_file_layer(
    path: str | None, engine_fields: set[str], spec_fields: frozenset[str]
) -> sc.EngineFileConfig | None:
    if not path:
        return None
    translated = sc.translate_engine_config(
        sc.load_engine_file(path),
        engine_fields,
        speculative_fields=spec_fields,
        where=f"--extra-engine-args {path}",
    )
    log.info("--extra-engine-args %s: %s form", path, translated.form)
    for note in translated.notes:
        log.info("--extra-engine-args %s: %s", path, note)
    return translated


def _typed_file_values(
    parser: argparse.ArgumentParser, file_cfg: sc.EngineFileConfig | None, path: str | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The file's engine keys typed by vLLM's own parser, and its speculative layer (with
    any `spec_method`/`spec_model`/`spec_tokens` keys folded into it)."""
    if file_cfg is None:
        return {}, None
    by_dest = {action.dest: action for action in parser._actions}
    raw = dict(file_cfg.engine)
    untyped = {k: raw.pop(k) for k in list(raw) if k not in by_dest}
    try:
        typed = explicit_values(parser, _as_cli_tokens(by_dest, raw))
    except ConfigError as exc:
        raise ConfigError(f"--extra-engine-args {path}: {exc}") from exc
    typed.update(untyped)
    spec = dict(file_cfg.speculative) if file_cfg.speculative else None
    for flag_key, spec_key in _SPEC_FLAGS.items():
        value = typed.pop(flag_key, None)
        if value is None:
            continue
        if spec_key == "num_speculative_tokens":
            sc.check_draft_length(value, f"--extra-engine-args {path}: {flag_key}")
        spec = spec or {}
        if spec.get(spec_key, value) != value:
            raise ConfigError(
                f"--extra-engine-args {path}: {flag_key}={value!r} contradicts speculative_config.{spec_key}"
            )
        spec[spec_key] = value
    return typed, spec


def _as_cli_tokens(by_dest: Mapping[str, argparse.Action], values: Mapping[str, Any]) -> list[str]:
    """File values as the command-line tokens that would set them (`None` = not set)."""
    tokens: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        action = by_dest[key]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            tokens.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            if value:
                tokens.append(flag)
        elif action.nargs in ("+", "*") and isinstance(value, list):
            tokens += [flag, *(_token(item) for item in value)]
        else:
            tokens.append(f"{flag}={_token(value)}")
    return tokens


def _token(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value)
    return str(value)


def _cli_speculative_json(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {value!r}")
    value = sc.normalize_keys(value)
    if "num_speculative_tokens" in value:
        sc.check_draft_length(
            value["num_speculative_tokens"], "--speculative-config: num_speculative_tokens"
        )
    return value


def _pop_spec_flags(cli_values: dict[str, Any]) -> dict[str, Any] | None:
    layer = {
        spec_key: cli_values.pop(flag)
        for flag, spec_key in _SPEC_FLAGS.items()
        if flag in cli_values
    }
    layer = {k: v for k, v in layer.items() if v is not None}
    if "num_speculative_tokens" in layer:
        sc.check_draft_length(layer["num_speculative_tokens"], "--spec-tokens")
    return layer or None


def _layer_engine_values(
    defaults: Mapping[str, Any],
    file_values: Mapping[str, Any],
    cli_values: Mapping[str, Any],
    file_cfg: sc.EngineFileConfig | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM defaults < file < command line, with the source of every key."""
    values = dict(defaults)
    sources = dict.fromkeys(values, SRC_VLLM)
    for key, value in file_values.items():
        values[key] = value
        written = file_cfg.origin.get(key, key) if file_cfg else key
        sources[key] = SRC_FILE if written == key else f"{SRC_FILE} ({written})"
    overridden = []
    for key, value in cli_values.items():
        if key in file_values and file_values[key] != value:
            overridden.append(f"{key} ({file_values[key]!r} -> {value!r})")
        values[key] = value
        sources[key] = SRC_CLI
    if overridden:
        log.info("command line overrides --extra-engine-args: %s", ", ".join(overridden))
    for key in _SPEC_FLAGS:
        values[key] = None  # folded into speculative_config
    return values, sources


# --------------------------------------------------------------------------- models


def _resolve_model_dir(name: str, *, dry_run: bool, what: str = "--model") -> Path:
    """A recipe name or a local directory as a path; a dry run never prepares a model."""
    try:
        return resolve_model(name, prepare=not dry_run)
    except ModelNotPreparedError:
        log.warning("%s %s is not prepared yet; a real start prepares it", what, name)
        return cached_model_dir(name.strip().lower())
    except UnknownModelError as exc:
        raise ConfigError(f"{what}: {exc}") from exc
    except PrepareError as exc:
        raise ConfigError(f"{what}: cannot prepare {name}: {exc}") from exc


def _resolve_target(
    values: dict[str, Any], sources: dict[str, str], *, dry_run: bool
) -> tuple[Path, sc.SpeculatorsCheckpoint | None]:
    """The target model directory. A speculators checkpoint given as the model stays the
    draft; its verifier becomes the target (so every engine flag applies to the verifier)."""
    model_dir = _resolve_model_dir(str(values["model"]), dry_run=dry_run)
    checkpoint = sc.read_speculators_checkpoint(model_dir)
    target = model_dir
    if sources.get("model") == SRC_VLLM:
        sources["model"] = SRC_WORKER  # the embedded model, not vLLM's own default
    if checkpoint is not None:
        target = _resolve_verifier(checkpoint, dry_run=dry_run)
        sources["model"] = f"{SRC_SPECULATORS} verifier"
        log.info(
            "--model %s is a speculators checkpoint: target %s, draft %s",
            model_dir,
            target,
            model_dir,
        )
    values["model"] = str(target)
    return target, checkpoint


def _resolve_verifier(checkpoint: sc.SpeculatorsCheckpoint, *, dry_run: bool) -> Path:
    """The verifier as a local directory: an embedded model name, a path, or a path
    relative to the checkpoint. Hub ids cannot be fetched here, so they are an error."""
    name = checkpoint.verifier
    if name.strip().lower() in KNOWN_MODELS or Path(name).expanduser().is_absolute():
        return _resolve_model_dir(name, dry_run=dry_run, what="speculators verifier")
    for candidate in (checkpoint.path / name, Path(name)):  # relative: to the checkpoint first
        if candidate.is_dir():
            return candidate.resolve()
    raise ConfigError(
        f"speculators checkpoint {checkpoint.path}: verifier {name!r} is neither an embedded model "
        "nor a local directory; edit speculators_config.verifier.name_or_path to point at the "
        "target, or pass the target as --model and the draft with --speculative-config"
    )


def _served_name(values: dict[str, Any], sources: dict[str, str]) -> str:
    """The name clients use: the first --served-model-name, else the recipe or directory name
    of the target (the verifier for a speculators checkpoint)."""
    names = values.get("served_model_name")
    if names:
        return str(names[0] if isinstance(names, list) else names)
    name = served_name_for(values["model"])  # already the resolved target directory
    values["served_model_name"] = [name]
    sources["served_model_name"] = SRC_WORKER
    return name


# --------------------------------------------------------------------------- speculative


def _resolve_speculative(
    values: dict[str, Any],
    sources: dict[str, str],
    layers: _Layers,
    checkpoint: sc.SpeculatorsCheckpoint | None,
    *,
    dry_run: bool,
) -> None:
    """Merge the speculative layers (lowest first) into `values["speculative_config"]` and
    record a source per key."""
    merged = sc.merge_speculative_layers(
        [
            (SRC_SPECULATORS, checkpoint.speculative if checkpoint else None),
            (SRC_FILE, layers.file_spec),
            (SRC_JSON, layers.cli_spec_json),
            (SRC_SPEC_FLAGS, layers.cli_spec_flags),
        ]
    )
    spec = _finish_speculative(merged, layers.cli_values, _speculative_fields(), dry_run=dry_run)
    values["speculative_config"] = spec
    sources.pop("speculative_config", None)  # reported per key instead
    for key, source in merged.sources.items():
        if spec is not None and key in spec:
            sources[f"speculative_config.{key}"] = source


def _finish_speculative(
    merged: sc.MergedSpeculative,
    cli_values: Mapping[str, Any],
    spec_fields: frozenset[str],
    *,
    dry_run: bool,
) -> dict[str, Any] | None:
    """Apply engine flags to the draft, resolve the draft path, and check what a dry run
    can check without vLLM loading anything."""
    for note in merged.notes:
        log.info("speculative config: %s", note)
    spec = merged.values
    if spec is None:
        return None
    for engine_key, draft_key in _DRAFT_TWINS.items():
        if engine_key in cli_values and draft_key in spec:
            log.info(
                "speculative config: dropping %s=%r, the explicit --%s applies to the draft",
                draft_key,
                spec.pop(draft_key),
                engine_key.replace("_", "-"),
            )
    _resolve_draft_model(spec, merged.sources.get("model", "?"), dry_run=dry_run)
    note = sc.fill_k_from_schedule(spec)
    if note:
        log.info("speculative config: %s", note)
    if spec.get("num_speculative_tokens") is not None:
        source = merged.sources.get("num_speculative_tokens", "dynamic schedule")
        sc.check_draft_length(
            spec["num_speculative_tokens"],
            f"speculative_config.num_speculative_tokens (from {source})",
        )
    sc.check_speculative(spec, allowed_keys=spec_fields, allowed_methods=_speculative_methods())
    if spec.get("method") in _K_REQUIRED_METHODS and spec.get("num_speculative_tokens") is None:
        raise ConfigError(
            f"speculative_config: method {spec['method']} needs num_speculative_tokens"
        )
    _check_schedule(spec)
    leading = [k for k in ("method", "model", "num_speculative_tokens") if k in spec]
    return {key: spec[key] for key in [*leading, *(k for k in spec if k not in leading)]}


def _resolve_draft_model(spec: dict[str, Any], source: str, *, dry_run: bool) -> None:
    """Embedded model names and local directories become absolute paths. A filesystem path
    that is no directory is an error on a real start (vLLM would fail only while building
    the engine, after trying the Hugging Face hub) and a warning in a dry run. Anything else
    (a hub id) is left for vLLM, which looks in the Hugging Face cache, with a warning, as
    nothing can be downloaded on these machines."""
    model = spec.get("model")
    if model is None or spec.get("method") in _NO_DRAFT_MODEL_METHODS:
        return
    name = str(model)
    path = Path(name).expanduser()
    if name.strip().lower() in KNOWN_MODELS or path.is_dir():
        spec["model"] = str(_resolve_model_dir(name, dry_run=dry_run, what="draft model"))
    elif _looks_like_path(name):
        problem = "is not a directory" if path.exists() else "does not exist"
        message = f"speculative_config.model (from {source}): {name} {problem}"
        if not dry_run:
            raise ConfigError(message)
        # A dry run shows what an example file resolves to before the draft is in place.
        log.warning("%s; a real start refuses it", message)
    else:
        log.warning("speculative config: draft model %s is not a local directory", name)


def _looks_like_path(name: str) -> bool:
    """A filesystem path rather than a Hugging Face id (`org/name`, or a bare `name`)."""
    return (
        name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()
    )


def _check_schedule(spec: dict[str, Any]) -> None:
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if schedule is None:
        return
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        normalized = validate_and_normalize_dynamic_sd_schedule([list(e) for e in schedule])
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"speculative_config.num_speculative_tokens_per_batch_size: {exc}"
        ) from exc
    spec["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in normalized]


# --------------------------------------------------------------------------- platform / KV


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _check_block_size(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """CPU attention needs blocks of a multiple of 32 tokens; vLLM only warns, then fails
    or runs slowly later, so a user-given size that is not is refused up front."""
    block = values.get("block_size")
    if block is None or sources.get("block_size") == SRC_VLLM or not _on_cpu():
        return
    if block % CPU_BLOCK_MULTIPLE:
        raise ConfigError(
            f"--block-size {block} ({sources.get('block_size')}): on CPU the block size must be a "
            f"multiple of {CPU_BLOCK_MULTIPLE}"
        )


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the usual small race is accepted)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _configure_kv_events(
    values: dict[str, Any], sources: dict[str, str], port: int | None
) -> int | None:
    """Turn on vLLM's ZMQ KV-event publisher for the KV router, unless the user configured
    events themselves or switched prefix caching (and so events) off."""
    if (
        sources.get("kv_events_config", SRC_VLLM) != SRC_VLLM
        and values.get("kv_events_config") is not None
    ):
        if port is not None:
            raise ConfigError("give either --kv-events-port or --kv-events-config, not both")
        return _port_of(values["kv_events_config"])
    if values.get("enable_prefix_caching") is False:
        if port is not None:
            log.warning(
                "--kv-events-port ignored: prefix caching is off, so there are no KV events"
            )
        return None
    from vllm.config import KVEventsConfig

    if port is not None:
        # TCP on request (another host consumes the events); vLLM binds only `tcp://*`.
        endpoint = f"tcp://*:{_port(port, '--kv-events-port')}"
        replay = f"tcp://127.0.0.1:{free_port()}"
    else:
        # Default: Unix sockets private to this host. Nothing to race for (a TCP port picked
        # now would only be bound ~30 s later, when the engine starts) and nothing exposed
        # on the network.
        base = Path(tempfile.gettempdir()) / f"dynamo-kv-{os.getpid()}-{secrets.token_hex(4)}"
        endpoint, replay = f"ipc://{base}-events.sock", f"ipc://{base}-replay.sock"
    values["kv_events_config"] = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        replay_endpoint=replay,
    )
    sources["kv_events_config"] = SRC_WORKER
    return port


def _port_of(cfg: Any) -> int | None:
    if not getattr(cfg, "enable_kv_cache_events", False):
        return None
    endpoint = str(getattr(cfg, "endpoint", ""))
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if endpoint.startswith("tcp://") and tail.isdigit() else None


def _configure_kv_transfer(
    values: dict[str, Any], sources: dict[str, str], mode: str, namespace: str
) -> None:
    """Disaggregated workers need a KV connector. Where none is given: NIXL where a GPU is
    present; on CPU vLLM's ExampleConnector over a directory that prefill and decode share
    (one host, or a shared filesystem) — the connector verified on these machines.

    An explicit config without a connector (e.g. `--kv-transfer-config '{}'`) on a
    prefill/decode worker is refused: such a worker could never hand its KV over."""
    if mode == "agg":
        return
    given = values.get("kv_transfer_config")
    if given is not None:
        if not getattr(given, "kv_connector", None):
            raise ConfigError(
                f"--kv-transfer-config: a {mode} worker needs a KV connector "
                "(`kv_connector`), e.g. ExampleConnector on CPU or NixlConnector on GPU; "
                "leave the flag out to get the default"
            )
        return
    from vllm.config import KVTransferConfig

    if _gpu_present():
        values["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        )
    else:
        path = os.environ.get(KV_SHARED_STORAGE_ENV) or f"/tmp/dynamo-kv-{namespace}"
        values["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": path},
        )
    sources["kv_transfer_config"] = SRC_WORKER


def _gpu_present() -> bool:
    """True when vLLM runs on a CUDA device in this installation."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:
        return False


# --------------------------------------------------------------------------- reporting


def _worker_summary(cfg: WorkerConfig) -> dict[str, Any]:
    return {
        "disaggregation_mode": cfg.disaggregation_mode,
        "namespace": cfg.namespace,
        "component": cfg.component,
        "endpoint": cfg.endpoint,
        "served_model_name": cfg.served_model_name,
        "model_path": str(cfg.model_path),
        "speculators_checkpoint": str(cfg.speculators_checkpoint)
        if cfg.speculators_checkpoint
        else None,
        "nats_server": cfg.nats_server,
        "lease_ttl": cfg.lease_ttl,
        "system_port": cfg.system_port,
        "kv_events_port": cfg.kv_events_port,
        "migration_limit": cfg.migration_limit,
        "extra_engine_args": str(cfg.extra_engine_args) if cfg.extra_engine_args else None,
    }


def non_default_engine_values(cfg: WorkerConfig) -> dict[str, Any]:
    """AsyncEngineArgs fields not left at vLLM's default (per the recorded sources), as plain
    data in vLLM's field order. Tracking sources beats comparing values: a flag given
    explicitly shows even when it equals the default, and nothing depends on `__eq__`."""
    changed = {}
    for f in dataclasses.fields(AsyncEngineArgs):
        if f.name == "speculative_config":
            if cfg.engine_args.speculative_config is not None:
                changed[f.name] = plain(cfg.engine_args.speculative_config)
        elif cfg.sources.get(f.name, SRC_VLLM) != SRC_VLLM:
            changed[f.name] = plain(getattr(cfg.engine_args, f.name))
    return changed


def plain(value: Any) -> Any:
    """`value` as YAML/JSON-safe data (vLLM config objects become mappings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def resolved_config_lines(cfg: WorkerConfig) -> list[str]:
    """One line per worker setting and per engine key that differs from vLLM's default,
    each with its source; `speculative_config` gets a line per key."""
    lines = [
        f"worker.{key} = {value}"
        for key, value in _worker_summary(cfg).items()
        if value is not None
    ]
    for key, value in non_default_engine_values(cfg).items():
        if key == "speculative_config" and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                source = cfg.sources.get(f"speculative_config.{sub_key}", "?")
                lines.append(
                    f"engine.speculative_config.{sub_key} = {json.dumps(sub_value)}  [{source}]"
                )
            continue
        lines.append(f"engine.{key} = {json.dumps(value)}  [{cfg.sources.get(key, SRC_WORKER)}]")
    if cfg.ignored_keys:
        lines.append(f"ignored --extra-engine-args keys = {', '.join(cfg.ignored_keys)}")
    return lines


def resolved_config_yaml(cfg: WorkerConfig) -> str:
    """The resolved configuration as YAML: `worker`, `engine` (non-default AsyncEngineArgs
    fields), `sources` (where each engine key came from) and `ignored_keys`."""
    engine = non_default_engine_values(cfg)
    sources = {
        key: source
        for key, source in cfg.sources.items()
        if key in engine
        or (key.startswith("speculative_config.") and "speculative_config" in engine)
    }
    document: dict[str, Any] = {
        "worker": _worker_summary(cfg),
        "engine": engine,
        "sources": sources,
    }
    if cfg.ignored_keys:
        document["ignored_keys"] = list(cfg.ignored_keys)
    header = "# python -m dynamo.vllm --dry-run: resolved configuration (nothing was loaded)\n"
    return header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
