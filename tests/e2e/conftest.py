"""Fixtures that start real daemons (``LocalCluster``) and join one client per node."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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


# --- a second uid (tests/e2e/test_identity.py, test_unvouched.py) -----------------------------------------
GROUP, OTHER, OUTSIDER = "tpd-test", "tpd-other", "tpd-outsider"


def _ensure_user(name: str, group: str) -> pwd.struct_passwd:
    try:
        grp.getgrnam(group)
    except KeyError:
        subprocess.run(["groupadd", "--system", group], check=True)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--gid", group, "--shell", "/usr/sbin/nologin",
                        name], check=True)
        return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def users() -> dict[str, pwd.struct_passwd]:
    """A client group's member and a user outside it (created once; CI runs as root)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must run the identity tests as root: they create a second user")
        pytest.skip("needs root: creates a second user to run a client as another uid")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.fail("useradd/groupadd are needed to create the second user (install the passwd package)")
    return {"other": _ensure_user(OTHER, GROUP), "outsider": _ensure_user(OUTSIDER, OUTSIDER)}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A work directory other users may traverse (the control socket inside keeps its own mode and group)."""
    path = Path(tempfile.mkdtemp(prefix="tpd-identity-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
