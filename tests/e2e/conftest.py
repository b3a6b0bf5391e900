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
               seed: int = 0) -> list[Rank]:
    """One rank per node, each with a send and a receive buffer, flags and a channel; exchanged."""
    rng = np.random.default_rng(seed)
    world = len(cluster.names)
    ranks = []
    for i, name in enumerate(cluster.names):
        client = gpuclient.connect(cluster.socket(name))
        session = client.join(job, rank=i, world=world)
        send = gpuclient.host_array(nbytes)
        send[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        recv = gpuclient.host_array(nbytes)
        src, dst = session.register(send), session.register(recv)
        session.flags(flags)
        ranks.append(Rank(client, session, send, recv, src, dst, None))  # type: ignore[arg-type]
    for r in ranks:
        r.session.exchange(wait=False)
    for r in ranks:
        r.session.exchange(timeout=30)
        r.channel = r.session.channel(capacity=256)
    return ranks


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
