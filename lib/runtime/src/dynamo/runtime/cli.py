"""Argument types shared by every command line of the project (frontend, vLLM worker,
mocker), so a number flag is checked, and its error worded, the same everywhere.

Each is an `argparse` `type=` callable: it returns the parsed value or raises
`argparse.ArgumentTypeError`, which argparse turns into
`argument --flag: must be > 0, got -1` (and exit code 2, or `ConfigError` in a parser
whose `error` raises).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Any, Protocol, TypeVar

MAX_PORT = 65535

T = TypeVar("T", int, float)


class ConfigError(ValueError):
    """A configuration a process refuses to start with (bad flag values, flags that
    contradict each other, a model the engine cannot load): exit code 2 and one line on
    stderr, never a traceback."""


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _at_least(value: T, low: T, text: str, *, strict: bool = False) -> T:
    if value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (durations that must pass, rates)."""
    return _at_least(_number(text), 0.0, text, strict=True)


def non_negative_float(text: str) -> float:
    """A number >= 0 (timeouts where 0 means "at once")."""
    return _at_least(_number(text), 0.0, text)


def positive_int(text: str) -> int:
    """An integer >= 1 (counts of things that must exist)."""
    return _at_least(_integer(text), 1, text)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (limits where 0 turns a feature off)."""
    return _at_least(_integer(text), 0, text)


def fraction(text: str) -> float:
    """A number in (0, 1] (shares of a capacity, e.g. a KV-cache usage threshold)."""
    value = _number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number in [0, 1] (weights where 0 means "worth nothing")."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    value = _integer(text)
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port between 0 and {MAX_PORT}, got {text}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"


class TakesArguments(Protocol):
    """An argparse parser or argument group."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def add_log_level_argument(parser: TakesArguments) -> None:
    """`--log-level`, defaulting to $DYN_LOG (else INFO), as every Dynamo process takes it."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get("DYN_LOG", "INFO").upper(),
        choices=LOG_LEVELS,
        help="Log verbosity; $DYN_LOG overrides the default.",
    )


def configure_logging(level: str | int, *, prefix: str = "") -> None:
    """Log lines to stderr with time, level, `prefix` (e.g. the HTTP worker's index) and
    the logger's name, the one format of every Dynamo process."""
    logging.basicConfig(level=level, format=LOG_FORMAT.format(prefix=prefix), stream=sys.stderr)
