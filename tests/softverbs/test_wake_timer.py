"""The I/O loop's precise wake-up (softverbs._waketimer): a timerfd armed at an absolute time.monotonic() time,
readable once that time passed, re-armed only when the time changes; and the soft device's loop arming it at
its next departure instead of passing epoll a timeout that epoll rounds up to the next millisecond."""

from __future__ import annotations

import selectors
import time
from collections.abc import Iterator

import pytest

from softverbs import _waketimer
from softverbs._waketimer import WakeTimer, open_wake_timer
from tests.softverbs.test_nic_model import _across, _stream
from tests.support.verbs_resources import open_provider


@pytest.fixture
def timer() -> Iterator[WakeTimer]:
    t = open_wake_timer()
    assert t is not None, "Linux has timerfd"
    yield t
    t.close()


def _ready(t: WakeTimer, wait: float = 0.0) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(t, selectors.EVENT_READ)
        return bool(sel.select(wait))


def test_a_time_already_past_fires_at_once_and_clear_consumes_it(timer: WakeTimer) -> None:
    timer.arm(time.monotonic() - 1.0)
    assert _ready(timer, 5.0)
    timer.clear()
    assert not _ready(timer)


def test_a_future_time_has_not_fired_and_disarming_keeps_it_silent(timer: WakeTimer) -> None:
    timer.arm(time.monotonic() + 3600.0)
    assert not _ready(timer)
    timer.arm(None)
    assert not _ready(timer)
    timer.arm(time.monotonic() + 0.002)  # 2 ms ahead: readable once it passed (the selector waits for it)
    assert _ready(timer, 5.0)


def test_arming_the_same_time_again_makes_no_call(timer: WakeTimer, monkeypatch: pytest.MonkeyPatch) -> None:
    at = time.monotonic() + 3600.0
    timer.arm(at)
    calls = []
    monkeypatch.setattr(timer, "_libc", type("L", (), {"timerfd_settime": lambda *a: calls.append(a) or 0})())
    timer.arm(at)
    assert calls == []
    timer.arm(at + 1.0)
    assert len(calls) == 1


def test_a_shaped_device_arms_its_timer_at_each_departure_s_landing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop hands the timerfd the departure queue's earliest landing time, so a write shaped with a 20 µs
    latency is not held to epoll's next millisecond. Shown with 5 ms, which the loop cannot find already due
    when it next looks; the wall-clock effect is a benchmark's to measure."""
    armed: list[float | None] = []
    real = _waketimer.WakeTimer.arm

    def spy(self: WakeTimer, when: float | None) -> None:
        armed.append(when)
        real(self, when)

    monkeypatch.setattr(_waketimer.WakeTimer, "arm", spy)
    provider = open_provider("soft")
    from softverbs import soft

    soft.configure("softib0", nic_latency_s=5e-3)
    try:
        with _across(provider) as pair:
            armed.clear()
            t0 = time.monotonic()
            _stream(pair, 1, 4096)
            lands = [when for when in armed if when is not None and when > t0]
    finally:
        soft.configure("softib0", nic_latency_s=0.0)
    assert lands, "the loop never armed its timer for the departure"
    assert min(lands) >= t0 + 5e-3  # the landing time itself: posted at or after t0, 5 ms of latency
