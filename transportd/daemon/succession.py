"""A restart that starts the next daemon before the running one stops (``transportctl restart``, SIGHUP).

Starting a daemon costs seconds (a Python interpreter per process, its imports, the rail workers, the
devices); a handover costs a fraction of a second (peers quiesce, the rails drain). So a restart request
does not stop the daemon first: it starts its *successor* (the same command line: the config and the
installed code are read anew), which gets everything ready that does not need the daemon's addresses (its
rail workers, their devices) and then says so. Only then does the running daemon hand its jobs over
(docs/restart.md) and exit; the successor, which was waiting for that, binds the control socket, the
descriptor socket and the peer port and serves: the jobs pause for the handover and the re-attach, not
for the start.

A successor that cannot start (a bad config, a missing device) exits before it said it was ready: the
running daemon logs why and goes on serving, nothing was handed over. Under systemd the running daemon
names its successor the service's main process (``MAINPID=``) before it exits, so the unit stays active
(``ExecReload`` sends SIGHUP).

The two talk through a pipe the successor inherits (``TRANSPORTD_PREDECESSOR=<pid>:<fd>``): the successor
writes one line when it is ready; its end closing without that line means it failed.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time

__all__ = ["PREDECESSOR_ENV", "Predecessor", "Successor"]

log = logging.getLogger("transportd")

PREDECESSOR_ENV = "TRANSPORTD_PREDECESSOR"
READY = b"ready\n"
PREPARE_TIMEOUT_S = 120.0  # a successor not ready by then is stopped, and the running daemon serves on
HANDOVER_TIMEOUT_S = 120.0  # a predecessor that does not exit by then: the successor gives up


class Successor:
    """The running daemon's side: the next daemon, started and getting ready (``poll`` says how far)."""

    def __init__(self, process: subprocess.Popen, reader: int) -> None:
        self.process = process
        self._reader = reader
        self._deadline = time.monotonic() + PREPARE_TIMEOUT_S
        self.state = "preparing"  # preparing | ready | failed
        self.error = ""

    @classmethod
    def start(cls) -> Successor:
        """Start this process's command line again, as the successor of this process."""
        reader, writer = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "WATCHDOG_PID"}  # its watchdog is its own
        env[PREDECESSOR_ENV] = f"{os.getpid()}:{writer}"
        try:
            process = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env, pass_fds=(writer,),
                                       stdin=subprocess.DEVNULL)
        except BaseException:
            os.close(reader)
            raise
        finally:
            os.close(writer)
        log.info("restart: successor pid %d started; serving on until it is ready", process.pid)
        return cls(process, reader)

    def poll(self) -> str:
        """``ready`` once the successor said so, ``failed`` if it exited (or took too long) before."""
        if self.state != "preparing":
            return self.state
        if select.select([self._reader], [], [], 0)[0]:
            line = os.read(self._reader, 64)
            if line == READY:
                self.state = "ready"
            else:
                self._fail(f"it exited before it was ready (exit status {self.process.wait(5)})")
        elif time.monotonic() > self._deadline:
            self.process.kill()
            self.process.wait(5)
            self._fail(f"it was not ready within {PREPARE_TIMEOUT_S:.0f}s")
        return self.state

    def _fail(self, why: str) -> None:
        self.state, self.error = "failed", why
        os.close(self._reader)
        log.error("restart refused: the new daemon did not start: %s (its log lines above say why); this "
                  "daemon serves on", why)

    def close(self) -> None:
        if self.state == "ready":
            os.close(self._reader)


class Predecessor:
    """The successor's side: tell the running daemon when ready, then wait for it to hand over and exit."""

    def __init__(self, pid: int, writer: int) -> None:
        self.pid = pid
        self._writer = writer

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Predecessor | None:
        value = (os.environ if env is None else env).pop(PREDECESSOR_ENV, "")
        if not value:
            return None
        pid, _, fd = value.partition(":")
        return cls(int(pid), int(fd))

    def take_over(self, keep_alive: object = None) -> None:
        """Say ready, then wait until the predecessor has exited (its addresses are free then). ``keep_alive``
        is called while waiting (the watchdog)."""
        os.write(self._writer, READY)
        os.close(self._writer)
        log.info("ready to take over: waiting for pid %d to hand its jobs over", self.pid)
        deadline = time.monotonic() + HANDOVER_TIMEOUT_S
        while _alive(self.pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon being restarted (pid {self.pid}) did not exit within "
                                   f"{HANDOVER_TIMEOUT_S:.0f}s")
            if callable(keep_alive):
                keep_alive()
            time.sleep(0.002)

    def abandon(self) -> None:
        """This successor cannot start: close the pipe without a word (the predecessor serves on)."""
        try:
            os.close(self._writer)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has exited: only its reaping is due)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
