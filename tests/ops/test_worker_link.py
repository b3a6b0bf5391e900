"""The main process's link to a rail worker stays correct after a call times out (e.g. ``stats`` while the
worker is busy or stopped): the late reply is dropped, never taken for the next call's."""

from __future__ import annotations

import pytest

from tests.ops.worker_target import slow_worker
from transportd.worker_link import WorkerError, WorkerHandle


def test_a_late_reply_is_not_taken_for_the_next_calls() -> None:
    handle = WorkerHandle(0, slow_worker, {"delay_s": 0.5})
    try:
        assert handle.info["rail"] == 0
        with pytest.raises(WorkerError, match="did not answer slow"):
            handle.call("slow", timeout_s=0.05, value=1)
        assert handle.call("echo", value=2) == {"value": 2}  # the slow call's reply arrives first: dropped
        assert handle.call("echo", value=3) == {"value": 3}
    finally:
        handle.stop()
