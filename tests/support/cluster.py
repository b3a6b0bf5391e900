"""Real daemons (``LocalCluster``) and the ranks that join them: one client per rank, buffers, flags, a channel."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

import gpuclient
from transportd_cli.localcluster import LocalCluster


@dataclass
class Rank:
    client: gpuclient.Client
    session: gpuclient.Session
    send: np.ndarray
    recv: np.ndarray
    src: gpuclient.Region
    dst: gpuclient.Region
    channel: gpuclient.ChannelHandle


def join_ranks(cluster: LocalCluster, job: str = "job", nbytes: int = 1 << 20, flags: int = 64,
               seed: int = 0, nodes: list[str] | None = None) -> list[Rank]:
    """One rank per node (or rank i on ``nodes[i]``), each with a send and a receive buffer, flags and a
    channel; exchanged."""
    rng = np.random.default_rng(seed)
    nodes = nodes or cluster.names
    ranks = [join_rank(cluster, node, job, i, len(nodes), nbytes, flags, rng) for i, node in enumerate(nodes)]
    gpuclient.exchange_all(r.session for r in ranks)
    for r in ranks:
        r.channel = r.session.channel(capacity=256)
    return ranks


def join_rank(cluster: LocalCluster, node: str, job: str, rank: int, world: int, nbytes: int = 1 << 20,
              flags: int = 64, rng: np.random.Generator | None = None) -> Rank:
    """Rank ``rank`` joins from a new client on ``node``, registers random send data, a receive buffer and
    flags; not exchanged yet, no channel."""
    rng = rng or np.random.default_rng(rank)
    client = gpuclient.connect(cluster.socket(node))
    session = client.join(job, rank=rank, world=world)
    send = gpuclient.host_array(nbytes)
    send[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    recv = gpuclient.host_array(nbytes)
    src, dst = session.register(send), session.register(recv)
    session.flags(flags)
    return Rank(client, session, send, recv, src, dst, None)  # type: ignore[arg-type]


def close_ranks(ranks: list[Rank]) -> None:
    for r in ranks:
        try:
            r.session.leave()
        finally:
            r.client.close()


@contextmanager
def started_clusters() -> Iterator[Callable[..., LocalCluster]]:
    """``make(nodes=2, **LocalCluster options)`` starts a cluster; every one made is stopped on the way out
    (the ``cluster_factory`` fixtures)."""
    started: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(kwargs.pop("nodes", 2), **kwargs)
        started.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


# A client process to kill: it joins job "victim" and prints "joined"; over ipc it also registers memory,
# opens a channel and keeps its proxy busy (signals to itself, rejected) until killed.
VICTIM_CLIENT = textwrap.dedent("""
    import sys, time, numpy as np, gpuclient
    client = gpuclient.connect(sys.argv[1])
    s = client.join("victim", rank=0, world=1)
    if not sys.argv[1].startswith("ipc://"):  # memory, rings and flags travel by descriptor: ipc clients only
        print("joined", flush=True)
        time.sleep(600)
    s.register(gpuclient.host_array(4096))
    s.flags(4)
    s.exchange(timeout=10)
    ch = s.channel(capacity=64)
    print("joined", flush=True)
    while True:
        ch.signal(peer=0, slot=0, value=1)   # to itself: rejected, but it keeps the proxy busy
        time.sleep(0.001)
""")
