"""The softverbs namespace the ib, efa and ibgda tests share (the ``verbs`` fixture their conftests re-export)."""

from __future__ import annotations

from typing import Any

import pytest

from transportd.backends import verbs as tverbs


@pytest.fixture(scope="session")
def verbs() -> Any:
    return tverbs.load("soft")
