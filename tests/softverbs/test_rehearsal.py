"""Rehearsals (``DeviceOptions.rehearse_s``, `softverbs.soft.rehearsal`): an idle device runs writes between two
QPs of its own to keep its Python warm; a busy one does not; its users' traffic is untouched beside them; stopping
closes what they opened."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from softverbs import soft
from softverbs.soft import rehearsal
from tests.softverbs.test_local_sockets import _write_and_check
from tests.support.verbs_resources import RCPair, open_provider


@pytest.fixture
def provider() -> Any:
    return open_provider("soft")


def _until(what: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


@pytest.fixture
def device() -> Iterator[Callable[[str, float], str]]:
    """Makes a fresh soft device of a kind that rehearses every so long once started; stops them after."""
    made: list[str] = []

    def make(kind: str, every_s: float) -> str:
        name = f"soft{kind}-{uuid.uuid4().hex[:6]}"
        soft.add_device(name, kind, rehearse_s=every_s)
        made.append(name)
        return name

    yield make
    for name in made:
        soft.stop_rehearsals(name)


@pytest.mark.parametrize("kind", ["ib", "efa"])
def test_an_idle_device_rehearses_until_stopped_and_then_closes_what_it_opened(device, kind: str) -> None:
    name = device(kind, 0.002)
    dev = soft._device(name)
    assert dev.refs == 0
    soft.start_rehearsals(name)
    soft.start_rehearsals(name)  # a second start is the same rehearsal
    assert rehearsal.running(dev) and dev.refs == 1, "the rehearsal's own context holds the device open"
    _until(lambda: soft.device_stats(name)["rehearsals"] >= 3)
    soft.stop_rehearsals(name)
    assert not rehearsal.running(dev)
    assert dev.refs == 0 and dev.port == 0, "its context closed: nothing else held the device, so it stopped"
    assert not dev.qps, "its QPs went with it"


def test_starting_needs_an_interval(device) -> None:
    name = device("ib", 0.0)
    with pytest.raises(ValueError, match="rehearse_s must be > 0"):
        soft.start_rehearsals(name)
    assert not rehearsal.running(soft._device(name))


def test_a_device_with_recent_events_does_not_rehearse(device) -> None:
    name = device("ib", 1.0)  # its first look comes a second after the start: the event below is in by then
    dev = soft._device(name)
    soft.start_rehearsals(name)
    dev.last_event_ns = time.monotonic_ns() + 3600 * 10**9  # an event "just now", for the next hour
    soft.configure(name, rehearse_s=0.002)
    running = rehearsal._RUNNING[name]
    _until(lambda: running.checks >= 5)
    assert soft.device_stats(name)["rehearsals"] == 0, "five looks at a busy device, no rehearsal"
    dev.last_event_ns = 0
    _until(lambda: soft.device_stats(name)["rehearsals"] >= 1)


def test_users_writes_land_intact_and_complete_beside_rehearsals(provider, device) -> None:
    names = [device("ib", 0.0005), device("ib", 0.0005)]
    for name in names:
        soft.start_rehearsals(name)
    with RCPair(provider, names[0], connect=False) as a, RCPair(provider, names[1], connect=False) as b:
        a.connect(a.client, b.server)
        b.connect(b.server, a.client)
        for size in (256, 4096, 1 << 20) * 5:
            _write_and_check(a, b, size)
            time.sleep(0.002)  # idle spells between the writes: rehearsals come between them
        assert all(soft.device_stats(n)["rehearsals"] > 0 for n in names)


def test_a_rehearsal_configured_off_pauses_and_resumes(device) -> None:
    name = device("ib", 0.002)
    soft.start_rehearsals(name)
    running = rehearsal._RUNNING[name]
    _until(lambda: soft.device_stats(name)["rehearsals"] >= 1)
    soft.configure(name, rehearse_s=0.0)
    looks = running.checks
    ran = soft.device_stats(name)["rehearsals"]
    _until(lambda: running.paused_looks >= 4)
    # at most the look (and rehearsal) that was under way when it was turned off; none since, and no busy loop
    assert running.checks <= looks + 1 and soft.device_stats(name)["rehearsals"] <= ran + 1
    soft.configure(name, rehearse_s=0.002)
    _until(lambda: soft.device_stats(name)["rehearsals"] >= ran + 3)
