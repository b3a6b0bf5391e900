"""Resources dropped without close(): closed as pyverbs closes them, when their object goes.

pyverbs destroys a QP, deregisters an MR, destroys a CQ, deallocates a PD and closes a context when the
Python object is deallocated (its ``__dealloc__`` calls ``close``). A soft resource does the same from
``__del__`` (`SoftResource`), so a key dropped by its owner stops working here as it does on a NIC.

Where the close runs. Dropped by the last reference on an ordinary thread, the resource is closed there and
then, as ``ibv_dereg_mr`` returns before the caller goes on. Two cases wait for a thread of their own (the
reaper), because the thread that finds the object dead may hold a lock the close takes:
- the cyclic collector found it: a collection runs wherever an allocation triggers it, inside a softverbs
  call that holds a QP's or a connection's lock included;
- a softverbs thread dropped it (the I/O thread, which closing a context would also wait for). softverbs
  starts its threads through `own_thread`, which marks them; a user's thread is never taken for one.
`wait_closed` waits until the reaper has nothing left to close.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from ._base import SoftCM

__all__ = ["SoftResource", "own_thread", "wait_closed"]

_log = logging.getLogger("softverbs")

# the cyclic collector is running (set and cleared by its callback; a drop meanwhile goes to the reaper)
_COLLECTING = [False]


# marks softverbs' own threads (`own_thread`): a resource one of them drops is closed on the reaper
_OWN = threading.local()


def own_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    """A daemon thread of softverbs' own running ``target`` (not started): what it drops goes to the reaper."""

    def run() -> None:
        _OWN.marked = True
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    _COLLECTING[0] = phase == "start"


gc.callbacks.append(_on_collection)


class _Reaper:
    """A thread that closes what could not be closed where it was dropped."""

    def __init__(self) -> None:
        self.pending: queue.Queue[Any] = queue.Queue()
        self.thread = own_thread(self._run, "softverbs-reaper")
        self.thread.start()

    def _run(self) -> None:
        while True:
            obj = self.pending.get()
            try:
                _close(obj)
            finally:
                del obj  # the last reference: the object goes now, not at the next one's arrival
                self.pending.task_done()


_REAPER: list[_Reaper | None] = [None]
_REAPER_LOCK = [threading.Lock()]


def _after_fork() -> None:
    """A forked child has none of its parent's threads, nor a hold on the lock a parent's thread had."""
    _REAPER[0] = None
    _REAPER_LOCK[0] = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _reaper() -> _Reaper:
    with _REAPER_LOCK[0]:
        if _REAPER[0] is None:
            _REAPER[0] = _Reaper()
        return _REAPER[0]


def _close(obj: SoftCM) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 -- a finalizer has no caller to raise to
        _log.exception("closing a dropped %s failed", type(obj).__name__)


def _here_is_safe() -> bool:
    return not _COLLECTING[0] and not getattr(_OWN, "marked", False)


def wait_closed(timeout: float | None = None) -> bool:
    """Wait until every dropped resource handed to the reaper is closed; False if ``timeout`` passed first."""
    reaper = _REAPER[0]
    if reaper is None:
        return True
    pending = reaper.pending
    with pending.all_tasks_done:
        return pending.all_tasks_done.wait_for(lambda: not pending.unfinished_tasks, timeout)


class SoftResource(SoftCM):
    """A resource that closes itself when its object goes without ``close()`` (pyverbs' ``__dealloc__``)."""

    __slots__ = ()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or sys.is_finalizing():  # at exit the process's end frees it all
            return
        if _here_is_safe():
            _close(self)
        else:
            _reaper().pending.put(self)  # kept alive until the reaper closes it; __del__ does not run again
