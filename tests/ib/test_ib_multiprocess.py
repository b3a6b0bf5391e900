"""Two ib nodes in two processes (each its own soft device, talking TCP): PUT+SIGNAL end to end."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

NODE = Path(__file__).with_name("mp_node.py")
ROOT = Path(__file__).resolve().parents[2]


class Node:
    def __init__(self, role: str, mode: str, n: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("SOFTVERBS_ADAPTIVE_ROUTING", None)
        self.proc = subprocess.Popen([sys.executable, str(NODE), role, mode, str(n)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60.0) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            pytest.fail(f"node said nothing for {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"node exited early with {self.proc.wait(5)}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("node did not exit")


@pytest.mark.parametrize("mode", ("write", "atomic", "fence"))
def test_put_signal_between_processes(mode: str) -> None:
    n = 40
    rx, tx = Node("receiver", mode, n), Node("sender", mode, n)
    try:
        rinfo = rx.recv()
        tinfo = tx.recv()
        rx.send({"endpoint": tinfo["endpoint"]})
        tx.send(rinfo)
        sent = tx.recv()
        got = rx.recv()
        tx.send({})
        rx.send({})
    finally:
        tx.close()
        rx.close()
    assert sorted(t for t, _ in sent["tokens"]) == list(range(1, n + 1))
    assert all(s == 0 for _, s in sent["tokens"])
    assert sent["inflight"] == 0
    assert got == {"flag": n, "data_ok": True}
    assert tx.proc.returncode == 0 and rx.proc.returncode == 0
