"""Two efa nodes in two processes (each its own soft EFA device, talking TCP): PUT+SIGNAL end to end."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from tests.support.node_process import NodeProcess, run_pair

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

NODE = Path(__file__).with_name("mp_node.py")
Node = partial(NodeProcess, NODE)


def test_put_signal_between_processes() -> None:
    n = 30
    rx, tx = Node("receiver", n), Node("sender", n)
    sent, got = run_pair(rx, tx)
    assert sorted(t for t, _ in sent["tokens"]) == list(range(1, n + 1))
    assert all(s == 0 for _, s in sent["tokens"])
    assert sent["wrs"] == n * (3 + 1)  # three pieces and one record per PUT+SIGNAL
    assert sent["inflight"] == 0
    assert got == {"flag": n, "data_ok": True, "early": []}
    assert tx.proc.returncode == 0 and rx.proc.returncode == 0
