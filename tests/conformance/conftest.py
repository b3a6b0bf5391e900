"""Conformance fixtures: every test runs against softverbs, and against a real NIC under `-m hardware`.

The `provider` fixture is parametrized: "soft" always, "pyverbs" marked `hardware`, which skips (saying
why) where pyverbs cannot be imported or sees no device of the kind the test needs.
"""

from __future__ import annotations

import pytest

from tests.support.verbs_resources import Provider, open_provider


@pytest.fixture(params=["soft", pytest.param("pyverbs", marks=pytest.mark.hardware)])
def provider(request: pytest.FixtureRequest) -> Provider:
    return open_provider(request.param)


@pytest.fixture
def rc(provider: Provider):
    """A connected pair of RC QPs (client -> server) on one device, in this process."""
    with provider.rc_pair() as pair:
        yield pair


@pytest.fixture
def srd(provider: Provider):
    """A pair of SRD QPs (EFA) with unsolicited write-with-imm receive where the device allows it."""
    with provider.srd_pair() as pair:
        yield pair
