"""Two nodes with two rails each (issue 8 on CPUs): "GPU" i on node a exchanges chunks with "GPU" i on node b.

Each node runs one daemon with ``[[backend.rails]] device = "softib0", gpu = 0`` and ``device = "softib1",
gpu = 1`` (softefa0/softefa1 for efa): two soft devices, two proxy workers. The job has four ranks, rank
``2 * node + gpu``, each a CPU client joined with ``device=gpu``. Rail-peer routing says GPU i's commands go
out on rail i to rail i of the other node; the tests check that from both ends (the ring's rail, the bytes
per connection, the remote device each connection reached) while both rails stream at once, with every
chunk and flag verified by its receiver.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import gpuclient
from tests.support.waiting import wait_until
from transportd.dataplane.pinning import parse_cpulist
from transportd_cli.ctl import main as ctl_main
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

GPUS = 2
JOB = "two-rails"


def rails(backend: str) -> list[dict[str, Any]]:
    prefix = "softefa" if backend == "efa" else "softib"
    return [{"device": f"{prefix}{i}", "gpu": i} for i in range(GPUS)]


@dataclass
class GpuRank:
    node: int
    gpu: int
    rank: int
    client: gpuclient.Client
    session: gpuclient.Session
    send: np.ndarray
    recv: np.ndarray
    src: gpuclient.Region
    dst: gpuclient.Region
    channel: gpuclient.ChannelHandle | None = None

    @property
    def peer(self) -> int:
        """The same GPU on the other node."""
        return 2 * (1 - self.node) + self.gpu


def join_gpus(cluster: LocalCluster, nbytes: int) -> list[GpuRank]:
    """Rank 2 * node + gpu on each node, joined with device=gpu; every rank's send data is distinct."""
    ranks = []
    for n, name in enumerate(cluster.names):
        for g in range(GPUS):
            rank = 2 * n + g
            client = gpuclient.connect(cluster.socket(name))
            session = client.join(JOB, rank=rank, world=2 * GPUS, device=g)
            assert session.info["rail"] == g, f"GPU {g} joined on rail {session.info['rail']}"
            send = gpuclient.host_array(nbytes)
            send[:] = np.random.default_rng(100 + rank).integers(0, 256, nbytes, dtype=np.uint8)
            recv = gpuclient.host_array(nbytes)
            src, dst = session.register(send), session.register(recv)
            session.flags(8)
            ranks.append(GpuRank(n, g, rank, client, session, send, recv, src, dst))
    for r in ranks:
        r.session.exchange(wait=False)
    for r in ranks:
        r.session.exchange(timeout=60)
        r.channel = r.session.channel(capacity=256)
    return ranks


def close_gpus(ranks: list[GpuRank]) -> None:
    for r in ranks:
        try:
            r.session.leave()
        finally:
            r.client.close()


def run_threads(targets: list[Any]) -> None:
    """Run every target in its own thread at once; re-raise the first failure."""
    errors: list[BaseException] = []

    def guard(fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001  (reported to the test below)
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a sender or receiver is stuck"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_each_gpu_streams_to_its_rail_peer_on_both_rails_at_once(cluster_factory, backend: str) -> None:
    chunk, chunks = 16 << 10, 48
    cluster = cluster_factory(backend=backend, overrides={"backend": {"rails": rails(backend)}})
    ranks = join_gpus(cluster, chunk * chunks)
    by_rank = {r.rank: r for r in ranks}
    try:
        def sender(me: GpuRank) -> Any:
            def run() -> None:
                to = by_rank[me.peer]
                assert me.channel is not None
                for i in range(chunks):  # each chunk adds 1 to flag 0 of the same GPU on the other node
                    me.channel.put_signal(peer=to.rank, dst_region=to.dst.id, dst_off=i * chunk, src_region=me.src.id,
                                          src_off=i * chunk, nbytes=chunk, slot=0, value=1)
                me.channel.signal(peer=to.rank, slot=1, value=1000 + me.rank, op="set")
                me.channel.quiet(timeout=60)
            return run

        def receiver(me: GpuRank) -> Any:
            def run() -> None:
                source = by_rank[me.peer]
                seen = 0
                while seen < chunks:  # verify each chunk the moment its flag covers it
                    value = me.session.wait(slot=0, at_least=seen + 1, timeout=60)
                    assert value <= chunks, f"rank {me.rank}: flag 0 is {value}, more than {chunks} chunks"
                    for i in range(seen, value):
                        got, want = me.recv[i * chunk:(i + 1) * chunk], source.send[i * chunk:(i + 1) * chunk]
                        assert np.array_equal(got, want), f"rank {me.rank}: chunk {i} wrong though flag 0 is {value}"
                    seen = value
                assert me.session.wait(slot=1, at_least=1000 + source.rank, timeout=60) == 1000 + source.rank
            return run

        run_threads([sender(r) for r in ranks] + [receiver(r) for r in ranks])
        for r in ranks:
            assert r.channel is not None and r.channel.status() == (0, 0, 0)
            assert np.array_equal(r.recv, by_rank[r.peer].send)
            assert int(r.session.flag_array.values[0]) == chunks  # type: ignore[union-attr]

        stats = [ranks[0].client.stats(), ranks[2].client.stats()]
        for n, s in enumerate(stats):
            other = cluster.names[1 - n]
            assert [rail["device"] for rail in s["rails"]] == [rr["device"] for rr in rails(backend)]
            for c in s["connections"]:
                if c["node"] == other:
                    # rail-peer routing: rail r of this node reached rail r of the other node, and carried
                    # exactly what GPU r sent
                    assert c["state"] == "up"
                    assert c["peer_gid"] == stats[1 - n]["rails"][c["rail"]]["gid"], c
                    assert c["bytes"] == chunk * chunks, c
                else:
                    assert c["bytes"] == 0, c  # nothing went between the GPUs of one node
            assert sorted(c["rail"] for c in s["connections"] if c["node"] == other) == list(range(GPUS))
            # GPU g's ring is drained by rail g's worker
            rings = sorted((rail["rail"], ring["rank"] - 2 * n) for rail in s["rails"]
                           for ring in rail["queues"]["rings"])
            assert rings == [(g, g) for g in range(GPUS)]
    finally:
        close_gpus(ranks)


def test_transportctl_queues_shows_both_rails_busy(cluster_factory) -> None:
    """Sample ``transportctl queues --json`` on node a while both GPUs stream: both rails' connections move."""
    chunk, window = 4096, 64
    config = rails("ib")
    config[0]["numa_node"] = 0  # rail 0's worker pins itself to node 0's CPUs where the machine has them
    mine = sorted(os.sched_getaffinity(0))
    loop_cpu = mine[-1] if len(mine) > 1 else -1
    config[1]["loop_cpu"] = loop_cpu  # rail 1's loop gets a CPU of its own, its other threads the rest
    cluster = cluster_factory(backend="ib", overrides={"backend": {"rails": config}})
    ranks = join_gpus(cluster, chunk * window)
    by_rank = {r.rank: r for r in ranks}
    senders = [r for r in ranks if r.node == 0]
    stop = threading.Event()
    sent = dict.fromkeys((r.rank for r in senders), 0)
    samples: list[dict[tuple[int, str], int]] = []
    try:
        def sender(me: GpuRank) -> Any:
            def run() -> None:
                to = by_rank[me.peer]
                assert me.channel is not None
                deadline = time.monotonic() + 60
                while not stop.is_set() and time.monotonic() < deadline:
                    # at most `window` commands ahead of the flags, so a destination slot is reused only
                    # after its previous chunk landed
                    if sent[me.rank] - int(to.session.flag_array.values[0]) >= window:  # type: ignore[union-attr]
                        continue
                    off = (sent[me.rank] % window) * chunk
                    me.channel.put_signal(peer=to.rank, dst_region=to.dst.id, dst_off=off, src_region=me.src.id,
                                          src_off=off, nbytes=chunk, slot=0, value=1)
                    sent[me.rank] += 1
                me.channel.quiet(timeout=60)
            return run

        def sampler() -> None:
            runner = CliRunner()

            def sample_shows_both_rails_moving() -> bool:
                result = runner.invoke(ctl_main, ["queues", "--json", "--socket", cluster.socket("nodea")])
                assert result.exit_code == 0, result.output
                doc = json.loads(result.output)
                samples.append({(c["rail"], c["node"]): c["bytes"] for c in doc["connections"]})
                return len(samples) >= 4 and _both_rails_moved(samples[-2], samples[-1])

            try:
                wait_until(sample_shows_both_rails_moving, lambda: f"both rails to move between samples: {samples}", 45)
            finally:
                stop.set()

        run_threads([sender(r) for r in senders] + [sampler])
        assert any(_both_rails_moved(a, b) for a, b in zip(samples, samples[1:], strict=False)), samples
        for me in senders:  # every command sent arrived, once
            to = by_rank[me.peer]
            assert to.session.wait(slot=0, at_least=sent[me.rank], timeout=60) == sent[me.rank]
            assert me.channel is not None and me.channel.status() == (0, 0, 0)
        last = samples[-1]
        assert all(last.get((g, "nodeb"), 0) > 0 for g in range(GPUS)), last
        workers = ranks[0].client.stats()["rails"]
        node0 = Path("/sys/devices/system/node/node0/cpulist")
        if node0.exists():
            want = sorted(set(parse_cpulist(node0.read_text())) & os.sched_getaffinity(0))
            assert workers[0]["cpus"] == want and sorted(os.sched_getaffinity(workers[0]["pid"])) == want
        assert workers[1]["cpus"] is None  # numa_node -1 and a soft NIC: nothing says where it sits
        text = CliRunner().invoke(ctl_main, ["status", "--socket", cluster.socket("nodea")]).output
        assert "ib on softib0" in text and "ib on softib1" in text and "not pinned" in text, text
        if loop_cpu >= 0:  # the loop (the worker's main thread) alone on its CPU, every other thread off it
            pid = workers[1]["pid"]
            assert workers[1]["loop_cpu"] == loop_cpu and f"its loop alone on CPU {loop_cpu}" in text, text
            others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
            # the loop's thread steps off its CPU while it serves a request (the status just asked for, the
            # daemon's own polls), so it is looked for back on it
            wait_until(lambda: os.sched_getaffinity(pid) == {loop_cpu},
                       lambda: f"the loop's thread back on CPU {loop_cpu}: {os.sched_getaffinity(pid)}", 10,
                       interval=0.001)
            assert others and not [t for t in others if loop_cpu in _affinity(t)]
        assert workers[0]["loop_cpu"] is None
    finally:
        stop.set()
        close_gpus(ranks)


def _affinity(tid: int) -> set[int]:
    """A thread's CPUs; none once it has ended (between listing it and asking)."""
    try:
        return os.sched_getaffinity(tid)
    except ProcessLookupError:
        return set()


def _both_rails_moved(before: dict[tuple[int, str], int], after: dict[tuple[int, str], int]) -> bool:
    """Between two samples, each rail's connection to node b carried new bytes."""
    return all(after.get((g, "nodeb"), 0) > before.get((g, "nodeb"), 0) for g in range(GPUS))


def test_a_rail_the_peer_node_lacks_fails_exchange_with_a_clear_error(cluster_factory) -> None:
    from transportd.errors import RequestError

    cluster = cluster_factory(backend="ib", per_node={
        "nodea": {"backend": {"rails": rails("ib")}},
        "nodeb": {"backend": {"rails": rails("ib")[:1]}}})
    clients = [gpuclient.connect(cluster.socket(n)) for n in cluster.names]
    try:
        a = clients[0].join("mismatch", rank=0, world=2, device=1)  # GPU 1 -> rail 1 on node a
        b = clients[1].join("mismatch", rank=1, world=2, device=0)
        for s in (a, b):
            s.register(gpuclient.host_array(4096))
            s.flags(4)
            s.exchange(wait=False)

        def exchanged() -> bool:
            a.exchange(wait=False)  # raises once node b's rails are known
            return False

        with pytest.raises(RequestError, match="node nodeb has 1 rail"):
            wait_until(exchanged, "the exchange to be refused", 20)
    finally:
        for c in clients:
            c.close()
