"""A daemon restarts while a GPU kernel runs on it (docs/restart.md): two daemons, two GPU rank processes on
one GPU. Rank 0's kernel ships chunk after chunk with put_signal (ADD 1 to the chunk's flag), a few ms
apart, on a ring far smaller than the stream; rank 1's kernel waits for each chunk's flag and verifies it
word by word. Mid-stream one daemon (the sender's, or the receiver's) is stopped gracefully and started
again with the same config: the kernels run on (the sender meets only backpressure), the client re-attaches
by itself, and both kernels finish with every chunk verified, every flag exactly 1 (nothing lost, nothing
written twice) and no error word."""

from __future__ import annotations

import pytest

from tests.support.rank_process import SLOW_START, RankProcess
from tests.support.waiting import wait_until

CHUNK = 16 << 10
NCHUNKS = 600
GAP_US = 5000  # 600 chunks 5 ms apart: the kernel runs about 3 s, a graceful restart takes about 1 s
CAPACITY = 16


@pytest.mark.parametrize("node", ["sender", "receiver"])
@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_graceful_restart_under_a_running_kernel_loses_nothing(cuda_device, cluster_factory, backend: str,
                                                                 node: str) -> None:
    cluster = cluster_factory(backend=backend, overrides={**SLOW_START, "peers": {
        **SLOW_START["peers"], "restart_grace_s": 60.0}})
    a, b = RankProcess(), RankProcess()
    try:
        setup = {"job": "gpurestart", "world": 2, "nbytes": CHUNK * NCHUNKS, "flags": NCHUNKS, "where": "device",
                 "src_kind": "cupy", "dst_kind": "cupy"}
        a.send("setup", socket=cluster.socket(cluster.names[0]), rank=0, **setup)
        b.send("setup", socket=cluster.socket(cluster.names[1]), rank=1, **setup)
        _, rb = a.reply(), b.reply()
        a.send("exchange", capacity=CAPACITY)
        b.send("exchange", capacity=CAPACITY)
        a.reply(), b.reply()
        b.call("recv", chunk=CHUNK, nchunks=NCHUNKS, epoch=1)
        a.call("send_paced", peer=1, dst_region=rb["dst"], chunk=CHUNK, nchunks=NCHUNKS, epoch=1, gap_us=GAP_US)
        wait_until(lambda: a.call("head")["head"] >= NCHUNKS // 5, "the sending kernel to be under way", 60)
        name, rank = (cluster.names[0], a) if node == "sender" else (cluster.names[1], b)
        assert cluster.terminate(name) == 0, cluster.log(name)
        cluster.restart(name)
        wait_until(lambda: rank.call("reattached")["count"] >= 1, f"the {node} to re-attach", 120)
        head_after = a.call("head")["head"]
        assert head_after < NCHUNKS, "the kernel finished before the restart: make it run longer"
        sent = a.call("send_finish")
        assert sent["status"] == 0 and sent["host_status"] == [0, 0, 0], sent
        assert sent["head"] == NCHUNKS + 1  # every put_signal and the QUIET
        done = b.call("finish")
        assert done == {"ok": True, "bad_words": 0, "chunks": NCHUNKS}, done
        values = b.call("flag_values", count=NCHUNKS)["values"]
        assert values == [1] * NCHUNKS  # each chunk's flag counted once: nothing lost, nothing twice
        assert a.call("reattached")["state"] != "gone" and b.call("reattached")["state"] != "gone"
    except BaseException:
        for n in cluster.names:
            print(f"--- {n} log ---\n{cluster.log(n)}")
        raise
    finally:
        a.close()
        b.close()
