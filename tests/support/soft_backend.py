"""What the ib and efa backend tests share: the softverbs namespace and a bounded spin."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from tests.support import waiting
from transportd.backends import verbs as tverbs


@pytest.fixture(scope="session")
def verbs() -> Any:
    return tverbs.load("soft")


# the conditions poll CQs themselves: spin
wait_until = functools.partial(waiting.wait_until, interval=0.0)


@pytest.fixture
def wait_for() -> Callable[..., None]:
    return wait_until
