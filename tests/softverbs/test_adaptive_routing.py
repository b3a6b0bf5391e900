"""Evidence for docs/design.md, "Flags follow their data": which flag-signaling schemes survive adaptive
routing (AR).

Under AR an RC NIC may place the packets of different writes (and of one write) out of order. softverbs
models that with a seeded reorder; a placement observer records the order in which bytes land at the
receiver, so each trial says exactly whether the flag became visible before all of its data:

- write mode (payload write, then flag write): the flag can land first -> unsafe under AR;
- fence mode (flag write with IBV_SEND_FENCE): fence only waits for earlier reads/atomics, so the same;
- atomic mode (flag by fetch-and-add): an atomic executes after every earlier write is placed -> safe;
- read + fence (payload, a small read, fenced flag write): the read executes after the payload is placed
  and the fenced flag waits for the read -> safe;
- AR off: RC places in order -> every scheme is safe, unless the flag's region is registered with
  IBV_ACCESS_RELAXED_ORDERING (PCIe may then let the flag write pass the data).

Each runs on host memory and on device memory (emulated: tests/support/device_memory.py), where writes are
placed by direct copies (softverbs._direct) packet by packet: the same hazards, and the same safety.
tests/gpu/test_soft_fabric.py runs them on a GPU's memory.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.support.device_memory import ShmDeviceMemory
from tests.support.verbs_resources import RCPair, open_provider, poll

TRIALS = 40
DATA = 4096  # 16 packets of 256 bytes
DATA_OFF, FLAG_OFF, SCRATCH_OFF, WARM_OFF = 0, 65536, 131072, 196608


@pytest.fixture(params=["host", "device"])
def ar_pair(request: pytest.FixtureRequest):
    with ShmDeviceMemory() if request.param == "device" else contextlib.nullcontext() as memory:
        yield from ar_pair_on(memory)


def ar_pair_on(memory: object = None):
    """An RC pair for the trials, its MRs on ``memory`` (None: host memory), and the placement log. With
    device memory, a first write lets the server side open the client's allocation, so that every write
    of the trials goes by direct copy."""
    provider = open_provider("soft")
    soft = provider.v.soft
    soft.configure("softib0", reorder_seed=1234, packet_size=256)
    soft.device_stats("softib0", reset=True)
    with provider.rc_pair(max_send_wr=256, client_memory=memory, server_memory=memory) as pair:
        e = pair.v.enums
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(WARM_OFF, 8),
                                              raddr=pair.server.mr.buf + WARM_OFF))
        assert poll(pair.client.cq)[0].status == e.IBV_WC_SUCCESS
        log: list[tuple[int, int, int]] = []
        soft.set_placement_observer(pair.ctx, lambda qpn, addr, length: log.append((qpn, addr, length)))
        yield pair, log
        soft.set_placement_observer(pair.ctx, None)
        soft.configure("softib0", reorder_seed=None, packet_size=None)
        stats = soft.device_stats("softib0")
        assert (stats["direct_placed"] > 0) == (memory is not None), stats
        assert stats["device_wire_writes"] == (memory is not None), stats  # the first write alone


def _trial(pair: RCPair, mode: str, n: int) -> None:
    e = pair.v.enums
    srv = pair.server.mr.buf
    unsignaled, signaled = 0, int(e.IBV_SEND_SIGNALED)
    head = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(DATA_OFF, DATA), flags=unsignaled,
                        raddr=srv + DATA_OFF)
    tail = head
    if mode == "read+fence":
        tail.next_wr = pair.send_wr(e.IBV_WR_RDMA_READ, pair.client.sge(SCRATCH_OFF, 1), flags=unsignaled,
                                    raddr=srv + DATA_OFF)
        tail = tail.next_wr
    if mode == "atomic":
        tail.next_wr = pair.send_wr(e.IBV_WR_ATOMIC_FETCH_AND_ADD, pair.client.sge(SCRATCH_OFF + 64, 8),
                                    wr_id=n, flags=signaled, raddr=srv + FLAG_OFF, add=1)
    else:
        pair.client.write_buf(FLAG_OFF, (n + 1).to_bytes(8, "little"))
        flags = signaled | (int(e.IBV_SEND_FENCE) if mode in ("fence", "read+fence") else 0)
        tail.next_wr = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(FLAG_OFF, 8), wr_id=n, flags=flags,
                                    raddr=srv + FLAG_OFF)
    pair.client.qp.post_send(head)
    (wc,) = poll(pair.client.cq)
    assert (wc.wr_id, wc.status) == (n, e.IBV_WC_SUCCESS)


def _flag_before_data(pair: RCPair, log: list[tuple[int, int, int]]) -> bool:
    """Did the flag land while some payload byte had not?"""
    srv = pair.server.mr.buf
    data_at = [i for i, (_, addr, _) in enumerate(log) if srv + DATA_OFF <= addr < srv + DATA_OFF + DATA]
    flag_at = [i for i, (_, addr, _) in enumerate(log) if addr == srv + FLAG_OFF]
    assert len(flag_at) == 1 and sum(log[i][2] for i in data_at) == DATA, "every byte lands exactly once"
    return flag_at[0] < max(data_at)


def _hazards(pair: RCPair, log: list, mode: str, adaptive: bool) -> int:
    pair.v.soft.set_adaptive_routing(pair.client.qp, adaptive)
    hazards = 0
    for n in range(TRIALS):
        log.clear()
        _trial(pair, mode, n)
        hazards += _flag_before_data(pair, log)
    return hazards


@pytest.mark.parametrize("mode", ["write", "fence"])
def test_write_and_fence_signaling_can_expose_the_flag_first_under_ar(ar_pair, mode: str) -> None:
    pair, log = ar_pair
    assert _hazards(pair, log, mode, adaptive=True) >= 1


@pytest.mark.parametrize("mode", ["atomic", "read+fence"])
def test_atomic_and_read_fence_signaling_never_do(ar_pair, mode: str) -> None:
    pair, log = ar_pair
    assert _hazards(pair, log, mode, adaptive=True) == 0


@pytest.mark.parametrize("mode", ["write", "fence", "atomic"])
def test_in_order_rc_is_safe_for_every_scheme(ar_pair, mode: str) -> None:
    pair, log = ar_pair
    assert _hazards(pair, log, mode, adaptive=False) == 0


def test_ar_reorders_packets_within_one_write_too(ar_pair) -> None:
    pair, log = ar_pair
    pair.v.soft.set_adaptive_routing(pair.client.qp, True)
    log.clear()
    _trial(pair, "write", 0)
    srv = pair.server.mr.buf
    data_addrs = [addr for _, addr, _ in log if srv + DATA_OFF <= addr < srv + DATA_OFF + DATA]
    assert data_addrs != sorted(data_addrs)
    assert pair.server.read_buf(DATA_OFF, DATA) == pair.client.read_buf(DATA_OFF, DATA)


@pytest.mark.parametrize("relaxed", ["flag", "data"])
def test_relaxed_ordering_on_the_flag_region_breaks_write_signaling(ar_pair, relaxed: str) -> None:
    """AR off, but a region registered with IBV_ACCESS_RELAXED_ORDERING: a write into it may pass earlier
    writes (PCIe relaxed ordering). A relaxed flag region exposes the flag early; relaxed data under a
    strictly ordered flag does not (the flag may not pass the data)."""
    pair, log = ar_pair
    v, e = pair.v, pair.v.enums
    pair.v.soft.set_adaptive_routing(pair.client.qp, False)
    base = int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    ro = base | int(e.IBV_ACCESS_RELAXED_ORDERING)
    data_mr = v.mr.MR(pair.pd, DATA, ro if relaxed == "data" else base)
    flag_mr = v.mr.MR(pair.pd, 8, ro if relaxed == "flag" else base)
    try:
        hazards = 0
        for n in range(TRIALS):
            log.clear()
            head = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(DATA_OFF, DATA), flags=0, rkey=data_mr.rkey,
                                raddr=data_mr.buf)
            pair.client.write_buf(FLAG_OFF, (n + 1).to_bytes(8, "little"))
            head.next_wr = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(FLAG_OFF, 8), wr_id=n,
                                        rkey=flag_mr.rkey, raddr=flag_mr.buf)
            pair.client.qp.post_send(head)
            assert poll(pair.client.cq)[0].status == e.IBV_WC_SUCCESS
            flag_at = [i for i, (_, addr, _) in enumerate(log) if addr == flag_mr.buf]
            data_at = [i for i, (_, addr, _) in enumerate(log) if data_mr.buf <= addr < data_mr.buf + DATA]
            hazards += flag_at[0] < max(data_at)
        if relaxed == "flag":
            assert hazards >= 1
        else:
            assert hazards == 0
    finally:
        data_mr.close()
        flag_mr.close()
