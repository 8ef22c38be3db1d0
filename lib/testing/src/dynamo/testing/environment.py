"""Test modules that read configuration from the environment: a clean one per test."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def unset_variables_fixture(*names: str) -> Callable[..., None]:
    """An autouse fixture (assign it to a name in a test module): every test of the module
    runs with the environment variables `names` unset, whatever the shell running pytest
    has set."""

    @pytest.fixture(autouse=True)
    def unset_variables(monkeypatch: pytest.MonkeyPatch) -> None:
        for name in names:
            monkeypatch.delenv(name, raising=False)

    return unset_variables
