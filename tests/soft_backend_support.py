"""What the ib and efa backend tests share: the softverbs namespace and a bounded spin."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from transportd import verbs as tverbs


@pytest.fixture(scope="session")
def verbs() -> Any:
    return tverbs.load("soft")


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Spin on ``cond`` (which should make progress itself, e.g. by polling); fail, never hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def wait_for() -> Callable[..., None]:
    return wait_until
