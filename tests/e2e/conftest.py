"""Fixtures that start real daemons (``LocalCluster``) and join one client per node."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import gpuclient
from transportd.localcluster import LocalCluster


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
    for r in ranks:
        r.session.exchange(wait=False)
    for r in ranks:
        r.session.exchange(timeout=30)
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


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    started: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(kwargs.pop("nodes", 2), **kwargs)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
