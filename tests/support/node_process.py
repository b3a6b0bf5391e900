"""A test "node" in its own process, spoken to in JSON lines over stdin/stdout (ib and efa multi-process tests)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class NodeProcess:
    """Run ``script`` with ``args``; ``send``/``recv`` one JSON object per line; every wait is bounded."""

    def __init__(self, script: Path, *args: object) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("SOFTVERBS_ADAPTIVE_ROUTING", None)
        self.proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdin=subprocess.PIPE,
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


def run_pair(receiver: NodeProcess, sender: NodeProcess) -> tuple[dict, dict]:
    """The mp_node handshake: each node reports its endpoint; the receiver learns the sender's, connects and
    says so; only then does the sender learn the receiver's (a request that reaches a QP not yet ready to
    receive is dropped, as an HCA drops it, and fails the sender's QP); the transfer runs. Returns (sender's
    report, receiver's report) once both exit."""
    try:
        rinfo = receiver.recv()
        tinfo = sender.recv()
        receiver.send({"endpoint": tinfo["endpoint"]})
        assert receiver.recv() == {"connected": True}
        sender.send(rinfo)
        sent = sender.recv()
        got = receiver.recv()
        sender.send({})
        receiver.send({})
    finally:
        sender.close()
        receiver.close()
    return sent, got
