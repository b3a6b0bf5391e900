"""Two ib nodes in two processes (each its own soft device, talking TCP): PUT+SIGNAL end to end."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from tests.support.node_process import NodeProcess, run_pair

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

NODE = Path(__file__).with_name("mp_node.py")
Node = partial(NodeProcess, NODE)


@pytest.mark.parametrize("mode", ("write", "atomic", "fence"))
def test_put_signal_between_processes(mode: str) -> None:
    n = 40
    rx, tx = Node("receiver", mode, n), Node("sender", mode, n)
    sent, got = run_pair(rx, tx)
    assert sorted(t for t, _ in sent["tokens"]) == list(range(1, n + 1))
    assert all(s == 0 for _, s in sent["tokens"])
    assert sent["inflight"] == 0
    assert got == {"flag": n, "data_ok": True}
    assert tx.proc.returncode == 0 and rx.proc.returncode == 0


def test_a_receiver_slow_to_connect_loses_nothing() -> None:
    """The sender learns the receiver's endpoint only once the receiver has connected: a write that reached
    a QP not yet ready to receive would be dropped and fail the sender's QP (as on an HCA)."""
    n = 8
    rx, tx = Node("receiver", "write", n, 0.5), Node("sender", "write", n)
    sent, got = run_pair(rx, tx)
    assert all(s == 0 for _, s in sent["tokens"]) and got == {"flag": n, "data_ok": True}
