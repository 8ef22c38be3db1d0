"""Settings whose fields carry their flags (`dynamo.runtime.settings`): the parser derived
from the fields, variables over defaults, flags over variables, nested settings and their
groups, and the values read back into the dataclass."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass

import pytest

from dynamo.runtime.cli import positive_int
from dynamo.runtime.settings import (
    Flag,
    add_setting_arguments,
    env_flag,
    nested,
    setting,
    settings_from_args,
)


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    count: int = setting(3, Flag("--count", "How many.", type=positive_int, env="TEST_COUNT"))
    loud: bool = setting(False, Flag("--loud", "Shout.", env="TEST_LOUD", negatable=True))


@dataclass(frozen=True)
class Outer:
    inner: Inner = nested(Inner, group="Inner things")
    colour: Colour = setting(
        Colour.RED,
        Flag("--colour", "Which.", type=Colour, choices=tuple(c.value for c in Colour)),
    )
    name: str = setting("x", Flag("--name", "Called.", group="Naming"))
    secret: str | None = None  # no flag: given by the caller


def parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_setting_arguments(parser, Outer)
    return parser, parser.parse_args(argv)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_COUNT", raising=False)
    monkeypatch.delenv("TEST_LOUD", raising=False)


def test_defaults_come_from_the_fields() -> None:
    _, args = parse([])
    assert settings_from_args(Outer, args) == Outer()


def test_flags_set_nested_and_top_level_fields_and_the_caller_the_rest() -> None:
    _, args = parse(["--count", "7", "--loud", "--colour", "blue", "--name", "y"])
    settings = settings_from_args(Outer, args, secret="s")
    assert settings == Outer(Inner(count=7, loud=True), Colour.BLUE, "y", "s")
    assert settings.colour is Colour.BLUE


def test_a_variable_replaces_the_default_and_a_flag_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_COUNT", "5")
    monkeypatch.setenv("TEST_LOUD", "yes")
    _, args = parse([])
    assert settings_from_args(Outer, args).inner == Inner(count=5, loud=True)
    _, args = parse(["--count", "9", "--no-loud"])
    assert settings_from_args(Outer, args).inner == Inner(count=9, loud=False)


def test_a_bad_value_from_a_variable_is_refused_like_a_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TEST_COUNT", "0")
    with pytest.raises(SystemExit):
        parse([])
    assert "--count: must be >= 1, got 0" in capsys.readouterr().err


def test_help_shows_groups_choices_and_an_enum_default_by_its_value() -> None:
    parser, _ = parse([])
    text = parser.format_help()
    assert "Inner things:" in text and "Naming:" in text
    assert "{red,blue}" in text
    assert "(default: red)" in text


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [("1", False, True), ("TRUE", False, True), ("no", True, False), ("maybe", True, True)],
)
def test_yes_no_words(text: str, default: bool, expected: bool) -> None:
    assert env_flag(text, default) is expected
