"""A rail-worker stand-in for the worker-link test (module level, so a spawned process can import it)."""

from __future__ import annotations

import time

from transportd.dataplane.worker_link import WorkerEndpoint


class _Handler:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def op_echo(self, value: int) -> dict[str, int]:
        return {"value": value}

    def op_slow(self, value: int) -> dict[str, int]:
        time.sleep(self.delay_s)  # a busy worker: the slowness is what the worker-link tests are about
        return {"value": value}

    def op_stop(self) -> dict[str, bool]:
        return {"drained": True}


def slow_worker(link_endpoint: str, rail: int, delay_s: float) -> None:
    link = WorkerEndpoint(link_endpoint, _Handler(delay_s))
    link.send_ready(rail=rail)
    while not link.serve_pending(100):
        pass
    link.close()
