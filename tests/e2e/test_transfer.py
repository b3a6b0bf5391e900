"""Two daemons, two clients: PUT, PUT_SIGNAL, SIGNAL, FENCE and QUIET move verified data on every transport."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support.cluster import close_ranks, join_ranks
from transportd.errors import ConfigError  # noqa: F401  (documents what a refused start raises)

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

TRANSPORTS = [
    pytest.param("ib", "write", False, id="rc-write"),
    pytest.param("ib", "atomic", False, id="rc-atomic"),
    pytest.param("ib", "fence", False, id="rc-fence"),
    pytest.param("ib", "atomic", True, id="rc-ar-atomic"),
    pytest.param("ib", "fence", True, id="rc-ar-fence"),
    pytest.param("efa", "write", False, id="srd"),
]


@pytest.mark.parametrize(("backend", "mode", "ar"), TRANSPORTS)
def test_every_opcode_moves_verified_data(cluster_factory, backend: str, mode: str, ar: bool) -> None:
    cluster = cluster_factory(backend=backend, overrides={
        "signal": {"mode": mode}, "softverbs": {"adaptive_routing": ar, "reorder_seed": 7}})
    a, b = join_ranks(cluster, nbytes=1 << 20)
    try:
        chunk, chunks = 64 << 10, 12
        # PUT_SIGNAL chunks 0..5, each adding 1 to b's flag 0; b checks each chunk the moment its flag shows.
        for i in range(6):
            a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=i * chunk, src_region=a.src.id,
                                 src_off=i * chunk, nbytes=chunk, slot=0, value=1)
        seen = 0
        while seen < 6:
            value = b.session.wait(slot=0, at_least=seen + 1, timeout=30)
            for i in range(seen, min(value, 6)):
                got, want = b.recv[i * chunk:(i + 1) * chunk], a.send[i * chunk:(i + 1) * chunk]
                assert np.array_equal(got, want), f"chunk {i} not there although flag 0 is {value}"
            seen = value
        # PUT chunks 6..11 without signals, a FENCE, then one SIGNAL (SET) covering all of them.
        for i in range(6, chunks):
            a.channel.put(peer=1, dst_region=b.dst.id, dst_off=i * chunk, src_region=a.src.id, src_off=i * chunk,
                          nbytes=chunk)
        a.channel.fence(peer=1)
        a.channel.signal(peer=1, slot=1, value=77, op="set")
        assert b.session.wait(slot=1, at_least=77, timeout=30) == 77
        assert np.array_equal(b.recv[:chunks * chunk], a.send[:chunks * chunk])
        # QUIET: every command before it has completed locally; the error word stays clean.
        a.channel.quiet(timeout=30)
        assert a.channel.status() == (0, 0, 0)
        # The other direction works at the same time (b -> a), and flags are monotonic counters.
        b.channel.put_signal(peer=0, dst_region=a.dst.id, dst_off=0, src_region=b.src.id, src_off=0,
                             nbytes=4096, slot=5, value=3)
        b.channel.signal(peer=0, slot=5, value=4)
        assert a.session.wait(slot=5, at_least=7, timeout=30) == 7
        assert np.array_equal(a.recv[:4096], b.send[:4096])
    finally:
        close_ranks([a, b])


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_command_posted_now_takes_the_batch_before_it_without_waiting_for_the_window(
        cluster_factory, backend: str) -> None:
    """With the proxy's polling window at its longest (1 s), a lone PUT_SIGNAL waits it out before the daemon
    posts it; a PUT then a PUT_SIGNAL pushed with ``now`` (the record's NO_BATCH) go at once, both."""
    window_s = 1.0
    cluster = cluster_factory(backend=backend, overrides={"proxy": {"poll_window_us": int(window_s * 1e6)}})
    a, b = join_ranks(cluster, nbytes=1 << 16)
    try:
        t0 = time.monotonic()
        a.channel.put(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=4096)
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=4096, src_region=a.src.id, src_off=4096,
                             nbytes=4096, slot=0, value=1, now=True)
        assert b.session.wait(slot=0, at_least=1, timeout=30) == 1
        at_once = time.monotonic() - t0
        assert np.array_equal(b.recv[:8192], a.send[:8192])
        t0 = time.monotonic()
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=8192, src_region=a.src.id, src_off=8192,
                             nbytes=4096, slot=1, value=1)
        assert b.session.wait(slot=1, at_least=1, timeout=30) == 1
        batched = time.monotonic() - t0
        assert batched >= window_s > at_once, (batched, at_once)
        # a hint that is not a bool, or an op that is not add/set, is refused before anything is pushed
        with pytest.raises(TypeError, match="now must be True or False, got 'no'"):
            a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0,
                                 nbytes=64, slot=2, value=1, now="no")
        with pytest.raises(ValueError, match="signal op must be 'add' or 'set'"):
            a.channel.signal(peer=1, slot=2, value=1, op="mul", now=True)
        last = a.channel.signal(peer=1, slot=2, value=5, now=True)
        assert b.session.wait(slot=2, at_least=5, timeout=30) == 5  # only this one reached the flag
        assert last == a.channel.fence(peer=1) - 1  # and the refused calls took no ring slot
    finally:
        close_ranks([a, b])


def test_write_signaling_is_refused_under_adaptive_routing(tmp_path) -> None:
    from transportd.config import load_config

    path = tmp_path / "ar.toml"
    path.write_text('[backend]\nkind = "ib"\n[softverbs]\nadaptive_routing = true\n[signal]\nmode = "write"\n')
    with pytest.raises(ConfigError, match="signal.mode: write signaling is unsafe with adaptive routing"):
        load_config(path)


def test_a_rank_that_announces_before_its_peer_node_has_the_job_is_still_found(cluster_factory) -> None:
    import gpuclient

    cluster = cluster_factory(backend="ib")
    first = gpuclient.connect(cluster.socket("nodea"))
    s0 = first.join("late", rank=0, world=2)
    buf0 = gpuclient.host_array(4096)
    r0 = s0.register(buf0)
    s0.flags(4)
    assert s0.exchange(wait=False)["complete"] is False  # node b has no rank of "late" yet
    second = gpuclient.connect(cluster.socket("nodeb"))
    s1 = second.join("late", rank=1, world=2)
    buf1 = gpuclient.host_array(4096)
    r1 = s1.register(buf1)
    s1.flags(4)
    s1.exchange(wait=False)
    s0.exchange(timeout=20)
    s1.exchange(timeout=20)
    buf0[:] = 7
    ch = s0.channel(capacity=64)
    ch.put_signal(peer=1, dst_region=r1.id, dst_off=0, src_region=r0.id, src_off=0, nbytes=4096, slot=0, value=1)
    assert s1.wait(slot=0, at_least=1, timeout=20) == 1
    assert (buf1 == 7).all()
    for s, c in ((s0, first), (s1, second)):
        s.leave()
        c.close()
