"""Stamps of a message's steps through the soft fabric, for finding where its time goes (off by default).

``SOFTVERBS_TRACE=DIR`` in a process's environment (inherited by the daemons and rail workers a test or a
benchmark starts) makes each process append one line a step to a file of its own, ``DIR/trace-<pid>-<random>.txt``
(mapped, zero-filled past its last line): ``CLOCK_MONOTONIC`` nanoseconds (one clock for every process on the
host), the pid and the step. The steps stamped:

- ``post``: a batch post call on a soft QP (`softverbs.soft.batch.post_wr_batch`); ``listed <n>``: its WR
  list of n WRs built; ``locked``: the QP's lock taken to queue them (any post);
  ``pump``: its WRs queued and their transmission starting; ``pumped``: their frames sent (or queued to
  depart); ``posted``: the call returning;
- ``send <kind>``: a frame about to go to its socket (1 a request, 2 a response);
- ``ready``: an idle I/O thread's epoll wait returning, timed before the thread takes the GIL back (until
  ``read``: the wait for the GIL and the loop's Python);
- ``read``: bytes read from a socket; ``frame <kind> <n>``: a frame's n descriptors parsed (its items'
  admission follows); ``copy <pieces>``: a run of copies into device memory issued;
- ``placed``: inbound bytes placed; ``polled``: completions taken by a poll.

A caller adds its own (``fabric_bench --latency --trace`` stamps ``start`` before each write and ``done``
after its QUIET).
`softverbs.soft.trace.summarize` turns the files into each step's median time from ``start``. Off, a step
costs one module-attribute test; on, a line is a store into the mapping (about a microsecond, no system call).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Any

__all__ = ["DIR", "stamp"]

log = logging.getLogger("softverbs.trace")

#: where the trace files go; None: tracing is off
DIR: str | None = os.environ.get("SOFTVERBS_TRACE") or None
#: a process's room for stamps (a sparse file; ~1 M stamps)
FILE_BYTES = 64 << 20
_file: list[Any] = [None, None, 0]  # (pid, DIR) the file was opened for, its mapping, the next free byte
_lock = threading.Lock()


def _after_fork() -> None:
    """A forked child stamps into a file of its own, under a lock of its own: the parent's may have been held
    by a thread that does not exist in the child."""
    global _lock
    _lock = threading.Lock()
    _file[:] = [None, None, 0]


os.register_at_fork(after_in_child=_after_fork)


def stamp(step: str, ns: int | None = None) -> None:
    """Append ``step`` with the time now (or ``ns``, ``time.monotonic_ns``) to this process's trace file (call
    only when ``DIR`` is set). The file is mapped, so a stamp is a store, not a system call: a write would let the
    GIL go, and the thread stamping could come back to it only after another thread's turn, which would then
    show in the trace as the step's own time. A file that cannot be opened, or is full, turns tracing off in
    this process, with a warning: the fabric goes on."""
    global DIR
    directory = DIR
    if directory is None:  # turned off since the caller looked (another thread, or a full file)
        return
    pid = os.getpid()
    line = f"{time.monotonic_ns() if ns is None else ns} {pid} {step}\n".encode()
    key = (pid, directory)
    with _lock:
        try:
            if _file[0] != key:  # first stamp, a forked child, or another DIR: a file of its own
                path = os.path.join(directory, f"trace-{key[0]}-{os.urandom(4).hex()}.txt")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.ftruncate(fd, FILE_BYTES)
                    _file[1] = mmap.mmap(fd, FILE_BYTES)
                finally:
                    os.close(fd)
                _file[0], _file[2] = key, 0
            at = _file[2]
            if at + len(line) > FILE_BYTES:
                raise OSError(f"{FILE_BYTES} bytes of stamps written")
            _file[1][at:at + len(line)] = line
            _file[2] = at + len(line)
        except (OSError, ValueError) as exc:
            log.warning("SOFTVERBS_TRACE=%s: cannot write the trace (%s); tracing is off in this process", DIR, exc)
            DIR = None
