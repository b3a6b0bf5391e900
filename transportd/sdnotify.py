"""systemd's notify protocol: READY=1, STATUS=..., WATCHDOG=1 and STOPPING=1 datagrams to $NOTIFY_SOCKET.

Without NOTIFY_SOCKET (not under systemd, or Type= is not notify) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier"]


class Notifier:
    """Sends notify messages; ``tick`` pets the watchdog at half of WATCHDOG_USEC."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not pid or pid == str(os.getpid())
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and watchdog_for_us else 0.0
        self._next_watchdog = 0.0
        self._last_status = ""

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError:
            pass  # systemd gone or socket full: never let notification break the daemon

    def ready(self, status: str = "") -> None:
        if status:
            self._last_status = status
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.notify(f"STATUS={text}")

    def stopping(self, status: str = "draining") -> None:
        self._last_status = status
        self.notify("STOPPING=1", f"STATUS={status}")

    def tick(self) -> None:
        if self.watchdog_interval_s and time.monotonic() >= self._next_watchdog:
            self._next_watchdog = time.monotonic() + self.watchdog_interval_s
            self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
