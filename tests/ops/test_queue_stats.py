"""``Proxy.queue_stats`` and ``Proxy.drain`` with real rings and the null backend (one process, no daemon):
the numbers ``transportctl queues`` and the metrics show, checked against what was pushed."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from cmd_ring import Command, Opcode, RingFile, RingProducer, records_from_commands
from transportd.backends.null import NullBackend
from transportd.dataplane.proxy import Proxy

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

JOB, WORLD, REGION = "job", 4, 1 << 20


class Rig:
    """Rank 0 of a job with peers 1..3, each on its own connection (id 100 + peer), over the null backend."""

    def __init__(self, capacity: int = 256, **proxy_opts) -> None:
        self.backend = NullBackend()
        self.proxy = Proxy(self.backend, **proxy_opts)
        self.proxy.set_source_region(JOB, 0, 0, 0x10_0000, REGION, 1)
        for peer in range(1, WORLD):
            self.proxy.set_remote_region(JOB, peer, 0, 0x100_0000 * peer, REGION, 10 + peer)
            self.proxy.set_remote_flags(JOB, peer, 0x900_0000 + 0x1000 * peer, 8, 20 + peer)
            self.proxy.bind_peer(JOB, peer, 100 + peer)
        self.ring = RingFile.create(f"tpd-test-queues-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity)
        self.proxy.add_channel(1, self.ring, JOB, 0, WORLD)
        self.producer = RingProducer(self.ring)

    def push(self, commands: list[Command]) -> None:
        assert self.producer.push_records(records_from_commands(commands), block=False)

    def ring_stats(self) -> dict:
        (ring,) = self.proxy.queue_stats()["rings"]
        return ring

    def conns(self) -> dict[int, dict]:
        return {c["conn"]: c for c in self.proxy.queue_stats()["connections"]}

    def close(self) -> None:
        self.ring.close()
        self.ring.unlink()


@pytest.fixture
def rig() -> Iterator:
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _put(peer: int, nbytes: int, signal: bool = False) -> Command:
    op = Opcode.PUT_SIGNAL if signal else Opcode.PUT
    return Command(op, peer=peer, length=nbytes, signal_slot=0, signal_value=1 if signal else 0)


def test_per_connection_batches_and_bytes_add_up_to_the_totals(rig) -> None:
    r = rig(poll_window_us=0)
    rng = np.random.default_rng(5)
    sent = dict.fromkeys((101, 102, 103), 0)
    for _ in range(300):  # more posts than the proxy logs before folding its per-connection counts
        peer = int(rng.integers(1, WORLD))
        n, nbytes = int(rng.integers(1, 13)), int(rng.integers(1, 9)) * 512
        r.push([_put(peer, nbytes, signal=bool(rng.integers(0, 2))) for _ in range(n)])
        sent[100 + peer] += n * nbytes
        r.proxy.run_once()
    while r.proxy.busy():
        r.proxy.run_once()
    totals = r.proxy.stats()
    conns = r.conns()
    assert {c: conns[c]["bytes"] for c in sent} == sent
    assert sum(sent.values()) == totals["bytes"]
    hist = np.sum([conns[c]["batch_hist"] for c in sent], axis=0)
    assert hist.tolist() == totals["batch_hist"]
    assert sum(c["batches_full"] for c in conns.values()) == totals["batches_full"]
    assert sum(c["batches_partial"] for c in conns.values()) == totals["batches_partial"]
    for c in conns.values():
        assert c["batches_full"] == c["batch_hist"][-1] and c["inflight"] == 0 and c["pending"] == 0


def test_depth_credits_and_oldest_age_under_backpressure(rig) -> None:
    r = rig(inflight_cap=8, poll_window_us=0)
    r.backend.paused = True  # the NIC completes nothing: the connection fills its cap
    r.push([_put(1, 4096, signal=True) for _ in range(40)])
    ring = r.ring_stats()
    assert ring["depth"] == 40 and ring["credits"] == 256 - 40 and ring["taken"] == 0
    for _ in range(5):
        r.proxy.run_once()
    first = r.ring_stats()
    later = r.ring_stats()
    taken = first["taken"]
    assert 0 < taken < 40 and first["depth"] == 40 - taken == later["depth"]
    assert first["credits"] == 256 - first["depth"]
    assert later["oldest_age_us"] > first["oldest_age_us"] > 0  # the head has waited since the proxy saw it
    assert r.conns()[101]["inflight"] == 8 and first["outstanding"] == taken
    assert r.proxy.stats()["stalls"] > 0
    r.backend.paused = False
    while r.ring_stats()["depth"] or r.proxy.busy():
        r.proxy.run_once()
    ring = r.ring_stats()
    assert ring["taken"] == 40 and ring["oldest_age_us"] == 0 and ring["outstanding"] == 0
    assert ring["credits"] == 256 and r.conns()[101]["inflight"] == 0


def test_drain_takes_what_was_committed_then_nothing_more(rig) -> None:
    r = rig(inflight_cap=8)
    r.push([_put(2, 1024, signal=True) for _ in range(50)])  # more than the cap lets through at once
    assert r.proxy.drain(timeout_s=30)
    ring = r.ring_stats()
    assert ring["taken"] == 50 and ring["outstanding"] == 0 and not r.proxy.busy()
    assert r.proxy.stats()["commands"] == 50
    r.push([_put(2, 1024)])  # after the drain: left in the ring (the daemon is exiting)
    r.proxy.run_once()
    assert r.ring_stats()["depth"] == 1 and r.proxy.stats()["commands"] == 50
