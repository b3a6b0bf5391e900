"""One ib "node" for the multi-process test: a process with its own soft device and an IbBackend.

Run as ``python mp_node.py sender|receiver MODE N [CONNECT_DELAY_S]`` (the receiver's pause before it
connects); speaks JSON lines on stdin/stdout with the test, which relays the endpoint exchange between the
two nodes (as the peer daemons would).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from ib.backend import IbBackend
from tests.support.waiting import wait_until
from transportd.backends import verbs as tverbs
from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp

CONN = 1
CHUNK = 8192


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def hear() -> dict:
    return json.loads(sys.stdin.readline())


def pattern(n: int) -> np.ndarray:
    return (np.arange(n * CHUNK, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)


def receiver(mode: str, n: int, connect_delay_s: float = 0.0) -> None:
    be = IbBackend("softib0", verbs=tverbs.load("soft"), signal_mode=mode)
    dst = np.zeros(n * CHUNK, dtype=np.uint8)
    flags = np.zeros(4, dtype=np.uint64)
    kd = be.register_memory(dst.ctypes.data, dst.nbytes, remote_write=True, remote_atomic=False)
    kf = be.register_memory(flags.ctypes.data, flags.nbytes, remote_write=True, remote_atomic=True)
    say({"endpoint": be.create_endpoint(CONN, "mp"), "dst": [kd.addr, kd.rkey], "flags": [kf.addr, kf.rkey]})
    peer = hear()["endpoint"]
    time.sleep(connect_delay_s)  # a receiver slow to connect (the sender must wait for it)
    be.connect(CONN, peer)
    say({"connected": True})  # ready to receive: only now may the sender post
    wait_until(lambda: int(flags[0]) >= n, f"flag 0 to reach {n}", 30, interval=0.001)  # the NIC writes it
    say({"flag": int(flags[0]), "data_ok": bool(np.array_equal(dst, pattern(n)))})
    hear()  # the sender is done with us
    be.close()


def sender(mode: str, n: int) -> None:
    be = IbBackend("softib0", verbs=tverbs.load("soft"), signal_mode=mode)
    src = pattern(n)
    ks = be.register_memory(src.ctypes.data, src.nbytes, remote_write=False, remote_atomic=False)
    say({"endpoint": be.create_endpoint(CONN, "mp")})
    peer = hear()
    be.connect(CONN, peer["endpoint"])
    (daddr, drkey), (faddr, frkey) = peer["dst"], peer["flags"]
    tokens: list[list[int]] = []

    def collect() -> int:
        comps = be.poll()
        tokens.extend([int(t), int(s)] for t, s in zip(comps["token"], comps["status"], strict=True))
        return len(tokens)

    for k in range(n):
        plan = np.array([
            (PlanOp.WRITE, 0, 0, CHUNK, ks.addr + k * CHUNK, daddr + k * CHUNK, ks.lkey, drkey, 0, 0, k, k + 1),
            (PlanOp.SIGNAL, SignalOp.ADD, 0, 8, 0, faddr, 0, frkey, 1, 0, k, k + 1),
        ], dtype=PLAN_DTYPE)
        be.post(CONN, plan)
        collect()
    wait_until(lambda: collect() >= n, lambda: f"{n} completions (have {len(tokens)})", 30, interval=0)  # spins
    say({"tokens": tokens, "inflight": be.inflight(CONN)})
    hear()
    be.close()


if __name__ == "__main__":
    role, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "receiver":
        receiver(mode, count, float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    else:
        sender(mode, count)
