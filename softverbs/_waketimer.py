"""A precise wake-up for a selector loop: a Linux timerfd armed at an absolute ``time.monotonic()`` time.

Python's epoll selector rounds a timeout up to the next millisecond (``epoll_wait`` takes milliseconds), so
a loop that waits 20 µs for a modeled message's landing sleeps 1.1 ms instead, and every message of a
chain of dependent messages pays it. A timerfd in the same selector fires at the time itself (to within the
kernel's timer slack, which the I/O thread sets to 1 µs). libc is reached with ctypes (``os.timerfd_create``
is Python 3.13's); where it cannot be, :func:`open_wake_timer` returns None and the loop keeps the rounded
timeout.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

__all__ = ["WakeTimer", "open_wake_timer", "tighten_timer_slack"]

CLOCK_MONOTONIC = 1  # time.monotonic()'s clock on Linux
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1
PR_SET_TIMERSLACK = 29


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process already runs on (no search: ``find_library`` would run ldconfig)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class WakeTimer:
    """One timerfd: :meth:`arm` at an absolute monotonic time (re-armed only when the time changes), readable
    once it passed; :meth:`clear` after the selector reported it."""

    def __init__(self, libc: ctypes.CDLL, fd: int) -> None:
        self._libc = libc
        self._fd = fd
        self._armed: float | None = None

    def fileno(self) -> int:
        return self._fd

    def arm(self, when: float | None) -> None:
        """Fire at ``when`` (``time.monotonic()`` seconds; a time already past fires at once); None disarms."""
        if when == self._armed:
            return
        spec = _Itimerspec()
        if when is not None:
            sec = int(when)
            nsec = max(1, int((when - sec) * 1e9))  # (0, 0) would disarm
            spec.it_value = _Timespec(sec, min(nsec, 999_999_999))
        if self._libc.timerfd_settime(self._fd, TFD_TIMER_ABSTIME if when is not None else 0, ctypes.byref(spec),
                                      None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")
        self._armed = when

    def clear(self) -> None:
        """Consume the expiration the selector saw; the timer stays disarmed until armed again."""
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        self._armed = None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_wake_timer() -> WakeTimer | None:
    """A timerfd on CLOCK_MONOTONIC, or None where the platform has none."""
    libc = _libc()
    if libc is None or not hasattr(libc, "timerfd_create"):
        return None
    fd = libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
    if fd < 0:
        return None
    timer = WakeTimer(libc, fd)
    try:  # timerfd_settime must take our itimerspec here (the one wake-up this costs the loop is harmless)
        timer.arm(time.monotonic() + 1e-6)
    except OSError:
        timer.close()
        return None
    return timer


def tighten_timer_slack() -> None:
    """Ask the calling thread's timer slack to be 1 µs (default 50 µs): its wake-ups land when asked."""
    libc = _libc()
    if libc is not None and hasattr(libc, "prctl"):
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
