"""The argument parser of `python -m dynamo.vllm`, whose help page shows the worker's runtime
flags in full beside vLLM's engine flags by group.

Every AsyncEngineArgs flag comes from vLLM's parser (`AsyncEngineArgs.add_cli_args`), so the
worker accepts exactly what `vllm serve` accepts for the engine, typed and validated the same
way. The worker's own number flags use the project's shared argument types
(`dynamo.runtime.cli`), so their errors read like the frontend's and the mocker's.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.llm.worker import DEFAULT_MIGRATION_LIMIT
from dynamo.llm.worker.addresses import ADVERTISE_HOST_HELP
from dynamo.llm.worker.flags import add_worker_runtime_arguments
from dynamo.llm.worker.roles import DEFAULT_COMPONENT, PREFILL_COMPONENT
from dynamo.runtime.cli import (
    ConfigError,
    non_negative_int,
    port,
    positive_int,
)
from dynamo.runtime.nats_options import add_nats_arguments
from dynamo.vllm.speculative.adaptive_k import (
    ADAPT_MODES,
    DEFAULT_WARMUP_DRAFTS,
    DEFAULT_WINDOW_STEPS,
)

WORKER_GROUP = "DynamoWorker"
SYSTEM_PORT_ENV = "DYN_SYSTEM_PORT"
SYSTEM_HOST_ENV = "DYN_SYSTEM_HOST"
DEFAULT_SYSTEM_HOST = "0.0.0.0"

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
  4. --spec-method / --spec-model / --spec-tokens;
  5. --speculation-profile PROFILE.json: only the batch-size -> K schedule.
  Keys merge one by one; a higher source naming a different `method` replaces the lower ones.
Engine-level flags (--max-model-len, --tensor-parallel-size, --seed, --enforce-eager, ...)
apply to target and draft alike. Contradicting keys inside one file are an error; a file
value the command line overrides is replaced (logged at INFO).

Defaults the worker adds where you are silent: --model is the embedded model
`smollm2-135m-instruct`; KV-cache events are published over ZMQ on a private Unix socket (unless
prefix caching is off or --kv-events-config is given); prefill/decode workers without
--kv-transfer-config use NixlConnector on a GPU and, on CPU, DiskKvConnector (vLLM's
ExampleConnector, whose failed loads are recomputed instead of killing the engine) with
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

_OWN_DEFAULT = "%(default).0s"
"""Ends help texts that state their default in words: an empty format field, which stops
argparse appending a misleading "(default: None)"."""


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


def _explain_json_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
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


def _add_worker_flags(parser: FlexibleArgumentParser) -> None:
    group = parser.add_argument_group(WORKER_GROUP, "Dynamo runtime settings of this worker.")
    add_worker_runtime_arguments(group, default_in_words=_OWN_DEFAULT)
    group.add_argument(
        "--component",
        default=None,
        help=f"Component name (default: {DEFAULT_COMPONENT!r}, or {PREFILL_COMPONENT!r} for prefill workers).{_OWN_DEFAULT}",
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
        "--speculation-profile",
        metavar="PROFILE.json",
        default=None,
        help="Speculation profile measured by `python -m dynamo.vllm.profile_spec`: sets "
        "the batch-size -> K schedule (vLLM's num_speculative_tokens_per_batch_size) chosen "
        "from it, over every other source. Needs speculation configured with the profiled "
        "method (--spec-method/--spec-model, --speculative-config or --extra-engine-args) and "
        "no schedule of its own; an explicit num_speculative_tokens must be at least the "
        "schedule's largest K (unset, it becomes that K)." + _OWN_DEFAULT,
    )
    group.add_argument(
        "--speculation-adapt",
        choices=ADAPT_MODES,
        default="off",
        help="Choose K each step from what this worker measures (needs --speculation-profile, "
        "whose numbers it starts from): `acceptance` follows the per-position acceptance of "
        "the drafts verified lately; `full` also corrects the profile's step times by this "
        "worker's own; `off` (default) runs the profile's schedule as it is. K > 0 is chosen "
        "only where it beats K=0 by 3%%; after 50 steps at K=0 one step drafts a token to "
        "see whether acceptance came back (docs/speculative_decoding.md).",
    )
    group.add_argument(
        "--speculation-window",
        type=positive_int,
        default=DEFAULT_WINDOW_STEPS,
        metavar="STEPS",
        help="With --speculation-adapt: decoding steps (those at K=0 included) over which "
        "old acceptance and step times fade to a third (default: %(default)s).",
    )
    group.add_argument(
        "--speculation-warmup",
        type=non_negative_int,
        default=DEFAULT_WARMUP_DRAFTS,
        metavar="DRAFTS",
        help="With --speculation-adapt: how many drafts at each position the profile's "
        "acceptance counts as at start; live drafts outweigh it after about that many "
        "(default: %(default)s).",
    )
    group.add_argument(
        "--migration-limit",
        type=non_negative_int,
        default=None,
        help="How often a request may move to another worker when this one dies mid-stream: "
        "the frontend resends the prompt plus the tokens generated so far to another "
        "instance, and the client sees one uninterrupted stream; 0 fails the request "
        f"instead (default: {DEFAULT_MIGRATION_LIMIT} for aggregated and decode workers, 0 "
        "for prefill workers, whose single output is never migrated)." + _OWN_DEFAULT,
    )
    group.add_argument(
        "--system-port",
        type=port,
        default=None,
        help="Port of the metrics/health HTTP server; 0 picks a free port "
        f"(default: ${SYSTEM_PORT_ENV}, else disabled)." + _OWN_DEFAULT,
    )
    group.add_argument(
        "--system-host",
        default=None,
        help="Address the metrics/health HTTP server binds to "
        f"(default: ${SYSTEM_HOST_ENV}, else {DEFAULT_SYSTEM_HOST}: every interface, so "
        "probes and scrapers on other hosts reach it)." + _OWN_DEFAULT,
    )
    group.add_argument(
        "--advertise-host",
        metavar="HOST",
        default=None,
        help=ADVERTISE_HOST_HELP + _OWN_DEFAULT,
    )
    group.add_argument(
        "--kv-events-port",
        type=port,
        default=None,
        help="TCP port vLLM publishes KV-cache events on, bound on every interface for "
        "consumers on other hosts (they dial --advertise-host:PORT; the replay socket gets a "
        "free port, advertised in the instance record). Default: a private Unix socket, "
        "ipc://$TMPDIR/dynamo-kv-*-events.sock." + _OWN_DEFAULT,
    )
    add_nats_arguments(group)
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Print the resolved configuration as YAML and exit 0 without loading weights.",
    )


def worker_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The `dest` names of the worker's runtime flags (everything else is an engine key)."""
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


def system_port_or_env(given: int | None) -> int | None:
    """--system-port, else `$DYN_SYSTEM_PORT` checked by the same `port` type; None (no
    system server) when neither is set. The variable is read here, not as the flag's
    default, so that an error names the variable the bad value came from."""
    if given is not None:
        return given
    text = os.environ.get(SYSTEM_PORT_ENV, "").strip()
    if not text:
        return None
    try:
        return port(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"${SYSTEM_PORT_ENV} (the default of --system-port): {exc}") from None


def system_host_or_env(given: str | None) -> str:
    """--system-host, else `$DYN_SYSTEM_HOST`, else every interface."""
    for value in (given, os.environ.get(SYSTEM_HOST_ENV)):
        if value is not None and value.strip():
            return value.strip()
    return DEFAULT_SYSTEM_HOST
