"""One efa "node" for the multi-process test: a process with its own soft EFA device and an EfaBackend.

Run as ``python mp_node.py sender|receiver N``; speaks JSON lines on stdin/stdout with the test, which
relays the endpoint exchange between the two nodes (as the peer daemons would). The receiver publishes
flags itself (that is the efa design), so it keeps polling its backend until every flag has arrived.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from efa.backend import EfaBackend
from tests.support.waiting import wait_until
from transportd.backends import verbs as tverbs
from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp

CONN = 1
CHUNK = 24 * 1024  # three pieces each: the device below splits at 8 KiB


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def hear() -> dict:
    return json.loads(sys.stdin.readline())


def pattern(n: int) -> np.ndarray:
    return (np.arange(n * CHUNK, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)


def backend() -> EfaBackend:
    v = tverbs.load("soft")
    v.soft.configure("softefa0", max_rdma_size=8192, srd_packet_size=1024)
    return EfaBackend("softefa0", verbs=v)


def receiver(n: int) -> None:
    be = backend()
    dst = np.zeros(n * CHUNK, dtype=np.uint8)
    flags = np.zeros(4, dtype=np.uint64)
    early: list[int] = []
    expect = pattern(n)

    def publish(conn_id: int, rank: int, slot: int, op: SignalOp, value: int) -> None:
        k = int(flags[slot])  # the k-th signal on slot 0 covers chunk k
        if not np.array_equal(dst[k * CHUNK:(k + 1) * CHUNK], expect[k * CHUNK:(k + 1) * CHUNK]):
            early.append(k)
        flags[slot] = value if op == SignalOp.SET else flags[slot] + value

    be.set_flag_publisher(publish)
    kd = be.register_memory(dst.ctypes.data, dst.nbytes, remote_write=True, remote_atomic=False)
    say({"endpoint": be.create_endpoint(CONN, "mp"), "dst": [kd.addr, kd.rkey]})
    be.connect(CONN, hear()["endpoint"])
    say({"connected": True})  # ready to receive: only now may the sender post
    # poll() takes the arrivals and publishes the flags: spin
    wait_until(lambda: be.poll() is not None and int(flags[0]) >= n, f"flag 0 to reach {n}", 30, interval=0)
    say({"flag": int(flags[0]), "data_ok": bool(np.array_equal(dst, expect)), "early": early})
    hear()
    be.close()


def sender(n: int) -> None:
    be = backend()
    src = pattern(n)
    ks = be.register_memory(src.ctypes.data, src.nbytes, remote_write=False, remote_atomic=False)
    say({"endpoint": be.create_endpoint(CONN, "mp")})
    peer = hear()
    be.connect(CONN, peer["endpoint"])
    daddr, drkey = peer["dst"]
    tokens: list[list[int]] = []
    wrs = 0

    def collect() -> int:
        comps = be.poll()
        tokens.extend([int(t), int(s)] for t, s in zip(comps["token"], comps["status"], strict=True))
        return len(tokens)

    for k in range(n):
        plan = np.array([
            (PlanOp.WRITE, 0, 0, CHUNK, ks.addr + k * CHUNK, daddr + k * CHUNK, ks.lkey, drkey, 0, 0, k, k + 1),
            (PlanOp.SIGNAL, SignalOp.ADD, 0, 8, 0, 0, 0, 0, 1, 0, k, k + 1),
        ], dtype=PLAN_DTYPE)
        wrs += be.post(CONN, plan)
        collect()
    wait_until(lambda: collect() >= n, lambda: f"{n} completions (have {len(tokens)})", 30, interval=0)  # spins
    say({"tokens": tokens, "wrs": wrs, "inflight": be.inflight(CONN)})
    hear()
    be.close()


if __name__ == "__main__":
    role, count = sys.argv[1], int(sys.argv[2])
    (receiver if role == "receiver" else sender)(count)
