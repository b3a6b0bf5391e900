"""A child process that must not outlive its parent: ``PR_SET_PDEATHSIG`` plus a check of the parent pid.

The kernel sends the signal when the *thread* that created the child exits (for the daemon, its main
thread, which starts every rail worker, so: when the daemon exits or is killed). A parent that died before
the child asked is caught by the pid check: the child was then already reparented.
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; False elsewhere).

    With ``parent_pid``, a parent that is already gone (this process was reparented before asking) ends
    this process at once with ``sig``, as the kernel would have.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return armed
