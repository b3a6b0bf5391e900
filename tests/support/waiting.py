"""The one bounded wait the tests use: poll a condition, return what it returned, fail (never hang)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(cond: Callable[[], T], what: str | Callable[[], str] = "condition", timeout: float = 10.0,
               interval: float = 0.05) -> T:
    """Call ``cond`` every ``interval`` seconds (0: spin, for conditions that make progress themselves, such
    as polling a CQ) until it returns something truthy, and return that; fail the test after ``timeout``,
    saying ``what`` it waited for (a callable is asked then, so it can say how far things got)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        if interval:
            time.sleep(interval)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None once ``pid`` is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, T stopped, Z zombie, ...); None once it is gone."""
    fields = proc_stat(pid)
    return fields[0] if fields else None
