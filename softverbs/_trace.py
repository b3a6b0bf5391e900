"""Stamps of a message's steps through the soft fabric, for finding where its time goes (off by default).

``SOFTVERBS_TRACE=DIR`` in a process's environment (inherited by the daemons and rail workers a test or a
benchmark starts) makes each process append one line a step to ``DIR/trace-<pid>.txt``: ``CLOCK_MONOTONIC``
nanoseconds (one clock for every process on the host), the pid and the step. The steps stamped:

- ``post``: a batch post call on a soft QP (`softverbs.soft.batch.post_wr_batch`); ``listed <n>``: its WR
  list of n WRs built; ``locked``: the QP's lock taken to queue them (any post);
  ``pump``: its WRs queued and their transmission starting; ``posted``: the call returning;
- ``send <kind>``: a frame about to go to its socket (1 a request, 2 a response);
- ``ready``: an idle I/O thread's epoll wait returning, timed before the thread takes the GIL back (until
  ``read``: the wait for the GIL and the loop's Python);
- ``read``: bytes read from a socket; ``copy <pieces>``: a run of copies into device memory issued;
- ``placed``: inbound bytes placed; ``polled``: completions taken by a poll.

A caller adds its own (``fabric_bench --latency --trace`` stamps ``start`` before each write and ``done``
after its QUIET).
`softverbs.soft.trace.summarize` turns the files into each step's median time from ``start``. Off, a step
costs one module-attribute test. A line is one ``write``: a few microseconds a step when on.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

__all__ = ["DIR", "stamp"]

log = logging.getLogger("softverbs.trace")

#: where the trace files go; None: tracing is off
DIR: str | None = os.environ.get("SOFTVERBS_TRACE") or None
_file: list[Any] = [None, -1]  # (pid, DIR) the file was opened for, its descriptor


def stamp(step: str, ns: int | None = None) -> None:
    """Append ``step`` with the time now (or ``ns``, ``time.monotonic_ns``) to this process's trace file (call
    only when ``DIR`` is set). A file that cannot be opened or written turns tracing off in this process, with a
    warning: the fabric goes on."""
    global DIR
    directory = DIR
    if directory is None:  # turned off since the caller looked (another thread, or a failed write)
        return
    key = (os.getpid(), directory)
    try:
        if _file[0] != key:  # first stamp, a forked child, or another DIR: a file of its own
            _file[1] = os.open(os.path.join(directory, f"trace-{key[0]}.txt"),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            _file[0] = key
        os.write(_file[1], f"{time.monotonic_ns() if ns is None else ns} {key[0]} {step}\n".encode())
    except OSError as exc:
        log.warning("SOFTVERBS_TRACE=%s: cannot write the trace (%s); tracing is off in this process", DIR, exc)
        DIR = None
