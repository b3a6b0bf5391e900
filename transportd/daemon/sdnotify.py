"""systemd's notify protocol: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1 and RELOADING=1 / MAINPID= (a
restart request's handover) datagrams to $NOTIFY_SOCKET.

Without NOTIFY_SOCKET (not under systemd, or Type= is not notify) every call is a no-op.

Sending never holds the daemon's main loop: a datagram socket whose receiver is not reading fills after a
few messages (``net.unix.max_dgram_qlen``, often 10) and a blocking send would then wait forever. STATUS=
and WATCHDOG=1 are sent without waiting (a dropped one is superseded by the next); READY=1 and STOPPING=1
wait at most ``important_wait_s`` for room.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier"]


class Notifier:
    """Sends notify messages; ``tick`` pets the watchdog at half of WATCHDOG_USEC."""

    important_wait_s = 1.0

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not pid or pid == str(os.getpid())
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and watchdog_for_us else 0.0
        self._next_watchdog = 0.0
        self._last_status = ""
        self._stopping = False

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str, wait_s: float = 0.0) -> bool:
        """Send one datagram; False if it could not be sent (no manager, or its queue stayed full)."""
        if self._sock is None:
            return False
        data = "\n".join(lines).encode()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._sock.sendto(data, self._address)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
            except OSError:
                return False  # systemd gone: never let notification break the daemon

    def ready(self, status: str = "") -> None:
        if status:
            self._last_status = status
        self.notify("READY=1", *([f"STATUS={status}"] if status else []), wait_s=self.important_wait_s)

    def status(self, text: str) -> None:
        if text != self._last_status and self.notify(f"STATUS={text}"):
            self._last_status = text  # a dropped status is sent again at the next call

    def stopping(self, status: str = "draining") -> None:
        self._last_status = status
        self._stopping = True  # systemd stops watching now (TimeoutStopSec rules): no WATCHDOG=1 follows
        self.notify("STOPPING=1", f"STATUS={status}", wait_s=self.important_wait_s)

    def reloading(self, status: str = "restarting") -> None:
        """The daemon hands over to its successor, which says READY=1 once it serves (after this daemon named it
        the main process with ``MAINPID=``)."""
        self._last_status = status
        self._stopping = True  # no WATCHDOG=1 until the next image is ready
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                    f"STATUS={status}", wait_s=self.important_wait_s)

    def tick(self) -> None:
        if self.watchdog_interval_s and not self._stopping and time.monotonic() >= self._next_watchdog:
            self._next_watchdog = time.monotonic() + self.watchdog_interval_s
            self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
