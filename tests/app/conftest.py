"""The wheel built from this tree, once per test session (the packaging and demo tests both install it)."""

from __future__ import annotations

import pytest

from ..support.wheel import build_wheel


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel"))
