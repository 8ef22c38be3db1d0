"""Settings defined once: a dataclass field carries its own command-line flag.

A process's settings are a frozen dataclass, and each field that a user sets from the
command line says so where it is declared (`setting(default, Flag(...))`): its flag, its
help, the `argparse` type that checks it and the environment variable that overrides its
default. `add_setting_arguments` derives the parser from the fields and
`settings_from_args` reads the parsed values back into the dataclass, so adding a
setting is one field, not five copies (parser, namespace mapping, config, call site,
constructor) that drift apart.

A field whose flag needs more than a type (a file read at start-up, a value assembled
from several flags) has no `Flag` and is filled by the caller; a field holding a nested
settings dataclass (`nested(Cls)`) contributes that dataclass's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from dynamo.runtime.cli import TakesArguments

FLAG = "dynamo.flag"
NESTED = "dynamo.nested"
GROUP = "dynamo.group"
TRUE_WORDS = ("1", "true", "yes")
FALSE_WORDS = ("0", "false", "no")

S = TypeVar("S")


@dataclass(frozen=True)
class Flag:
    """How one setting appears on the command line."""

    name: str  # "--http-port"
    help: str
    type: Callable[[str], Any] | None = None  # argparse's `type=`: parses and checks
    env: str | None = None  # a variable whose value replaces the default
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negatable: bool = False  # a bool with --flag / --no-flag
    group: str | None = None  # the --help section; None: the parser's own

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


def setting(default: Any, flag: Flag) -> Any:
    """A dataclass field with `default` that the command line sets through `flag`."""
    return dataclasses.field(default=default, metadata={FLAG: flag})


def nested(cls: type[Any], *, group: str | None = None) -> Any:
    """A dataclass field holding another settings dataclass, whose flags join the parent's
    (in `group`, for those of its flags that name none)."""
    return dataclasses.field(default_factory=cls, metadata={NESTED: cls, GROUP: group})


def add_setting_arguments(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    *,
    groups: Mapping[str, TakesArguments] | None = None,
) -> dict[str, TakesArguments]:
    """One argument per flagged field of `cls` (nested dataclasses included), in field
    order, each in its `Flag.group` (created on first use). Returns the groups, so a
    caller can add hand-made arguments to them."""
    made: dict[str, TakesArguments] = dict(groups or {})
    for field, flag in _flagged_fields(cls):
        target: TakesArguments = parser
        if flag.group is not None:
            if flag.group not in made:
                made[flag.group] = parser.add_argument_group(flag.group)
            target = made[flag.group]
        target.add_argument(flag.name, **_argument_options(field, flag))
    return made


def settings_from_args(cls: type[S], args: argparse.Namespace, **given: Any) -> S:
    """`cls` filled from the parsed `args` (its flagged fields, nested ones included);
    `given` sets the fields without a flag, and replaces any it names (a nested settings
    object the caller built itself is then not built here as well)."""
    values: dict[str, Any] = dict(given)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in given:
            continue
        if NESTED in field.metadata:
            values[field.name] = settings_from_args(field.metadata[NESTED], args)
        elif FLAG in field.metadata:
            values[field.name] = getattr(args, field.metadata[FLAG].dest)
    return cls(**values)


def _flagged_fields(
    cls: type[Any], group: str | None = None
) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """Every flagged field of `cls`, nested ones included, each flag in its group (its
    own, else the nearest enclosing `nested(..., group=)`)."""
    found: list[tuple[dataclasses.Field[Any], Flag]] = []
    for field in dataclasses.fields(cls):
        if NESTED in field.metadata:
            inner = field.metadata[GROUP] or group
            found.extend(_flagged_fields(field.metadata[NESTED], inner))
        elif FLAG in field.metadata:
            flag: Flag = field.metadata[FLAG]
            if flag.group is None and group is not None:
                flag = dataclasses.replace(flag, group=group)
            found.append((field, flag))
    return found


def _argument_options(field: dataclasses.Field[Any], flag: Flag) -> dict[str, Any]:
    options: dict[str, Any] = {"help": flag.help, "default": _default(field, flag)}
    if flag.negatable:
        options["action"] = argparse.BooleanOptionalAction
    elif flag.type is not None:
        options["type"] = flag.type
    if flag.choices is not None:
        options["choices"] = flag.choices
    if flag.metavar is not None:
        options["metavar"] = flag.metavar
    return options


def _default(field: dataclasses.Field[Any], flag: Flag) -> Any:
    """The field's default, replaced by `$env` when that is set and not empty (a string
    the flag's type parses, as if given on the command line; a yes/no word for a bool)."""
    default = field.default
    text = os.environ.get(flag.env) if flag.env else None
    if not text:
        # An enum as its value: argparse shows it in --help and parses it with `type`.
        return default.value if isinstance(default, enum.Enum) else default
    if isinstance(default, bool):
        return env_flag(text, default)
    return text


def env_flag(text: str, default: bool) -> bool:
    """A yes/no variable: `1/true/yes` on, `0/false/no` off, anything else the default."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return default
