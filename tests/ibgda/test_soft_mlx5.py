"""softverbs as an mlx5 device: WQEs built by the IBGDA header's own builders (compiled for the host) are
written into a SoftMlx5Queue's send queue, rung like a GPU rings them, and executed on the soft wire.
Data lands; CQEs come only where asked (plus errors); flags follow data in every signal mode, and under
adaptive routing for atomic and fence; malformed WQEs get the syndrome a ConnectX gives, then flush."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ibgda import mlx5_layout as L
from tests.support.ibgda_link import SOFT_QUEUE_WAIT, FlagJudge, HostPoster, Link
from tests.support.waiting import wait_until


def write(hp: HostPoster, link: Link, off: int, n: int, **kw: bool) -> int:
    return hp.add("write", link.dst.ctypes.data + off, link.mr_dst.rkey, link.src.ctypes.data + off,
                  link.mr_src.lkey, n, **kw)


def flag_addr(link: Link, slot: int) -> int:
    return link.flags.ctypes.data + 8 * slot


def test_write_read_fetch_add_and_nop(make_link, host_lib) -> None:
    link = make_link()
    hp = HostPoster(host_lib, link.a)
    back = np.zeros(4096, dtype=np.uint8)
    mr_back = link.a.register(back.ctypes.data, back.nbytes)
    link.flags[2] = 40
    write(hp, link, 0, 4096, completion=True)
    hp.add("read", link.dst.ctypes.data, link.mr_dst.rkey, back.ctypes.data, mr_back.lkey, 4096, completion=True)
    hp.add("fadd", flag_addr(link, 2), link.mr_flags.rkey, 2, link.scratch.ctypes.data, link.mr_scratch.lkey,
           completion=True)
    hp.add("nop", completion=True)
    hp.ring()
    cqes = hp.wait_cqes(4)
    assert [(c.opcode, c.wqe_counter, c.wqe_opcode, c.qpn) for c in cqes] == [
        (L.CqeOpcode.REQ, i, op, link.a.qpn)
        for i, op in enumerate((L.Opcode.RDMA_WRITE, L.Opcode.RDMA_READ, L.Opcode.ATOMIC_FA, L.Opcode.NOP))]
    assert (cqes[1].byte_cnt, cqes[2].byte_cnt) == (4096, 8)
    assert np.array_equal(link.dst[:4096], link.src[:4096]) and np.array_equal(back, link.src[:4096])
    assert (int(link.flags[2]), int(link.scratch[0])) == (42, 40)
    assert link.a.violations == [] and link.a.errors == []


def test_cqes_only_where_asked(make_link, host_lib) -> None:
    link = make_link()
    hp = HostPoster(host_lib, link.a)
    for i in range(10):
        write(hp, link, 1024 * i, 1024, completion=i % 5 == 4)
    hp.ring()
    cqes = hp.wait_cqes(2)
    assert [c.wqe_counter for c in cqes] == [4, 9]
    wait_until(lambda: link.a.stats["wqes"] == 10 and not link.a.outstanding, "every WQE to complete",
               **SOFT_QUEUE_WAIT)
    assert hp.cq.poll() == [] and link.a.stats["cqes"] == 2
    assert np.array_equal(link.dst[:10240], link.src[:10240])


def test_cq_wraps_with_the_owner_bit(make_link, host_lib) -> None:
    link = make_link(wqe_cnt=16)
    hp = HostPoster(host_lib, link.a)
    total = 0
    for lap in range(5):  # 5 laps of the 16-entry SQ and CQ, every WQE signalled
        for i in range(16):
            write(hp, link, 64 * (16 * lap + i), 64, completion=True)
        hp.ring()
        total += 16
        hp.wait_cqes(total)
    assert [c.wqe_counter for c in hp.cqes] == list(range(total))
    assert [c.owner for c in hp.cqes] == [(i // 16) & 1 for i in range(total)]
    assert np.array_equal(link.dst[:64 * total], link.src[:64 * total])
    assert link.a.violations == []


def post_put_signal(hp: HostPoster, link: Link, mode: str, off: int, n: int, slot: int, value: int) -> None:
    write(hp, link, off, n)
    if mode == "write":
        hp.add("inline8", flag_addr(link, slot), link.mr_flags.rkey, value)
    elif mode == "atomic":
        hp.add("fadd", flag_addr(link, slot), link.mr_flags.rkey, 1, link.scratch.ctypes.data, link.mr_scratch.lkey)
    else:  # fence: zero-length ordering read, then the flag write with the fence bit
        hp.add("read", 0, 0, 0, 0, 0)
        hp.add("inline8", flag_addr(link, slot), link.mr_flags.rkey, value, fence=True)


@pytest.mark.parametrize(("mode", "adaptive_routing"), [
    ("write", False), ("atomic", False), ("fence", False), ("atomic", True), ("fence", True)])
def test_flags_follow_data(make_link, host_lib, mode: str, adaptive_routing: bool) -> None:
    link = make_link(adaptive_routing=adaptive_routing, seed=3, packet_size=1024 if adaptive_routing else None,
                     wqe_cnt=256)
    hp = HostPoster(host_lib, link.a)
    judge = FlagJudge(link)
    link.observe(judge)
    rng = random.Random(5)
    counts = [0] * 4
    writes: list[tuple[int, int]] = []
    off = 0
    for i in range(48):
        n = rng.randint(1, 16) * 1024
        slot = rng.randrange(4)
        writes.append((off, n))
        counts[slot] += 1
        judge.covers.setdefault(slot, []).append(list(writes))
        post_put_signal(hp, link, mode, off, n, slot, counts[slot])
        off += n
        if i % 6 == 5:
            hp.ring()
    hp.add("read", 0, 0, 0, 0, 0, completion=True)  # a completion probe, as tpd::quiet posts
    hp.ring()
    hp.wait_cqes(1)
    assert judge.violations == []
    assert [int(f) for f in link.flags[:4]] == counts
    assert np.array_equal(link.dst[:off], link.src[:off])
    assert link.a.violations == [] and link.a.errors == []


def test_write_signaling_is_unsafe_under_adaptive_routing(make_link, host_lib) -> None:
    """The soft NIC keeps the fabric's rule: an inline flag write can overtake its payload under AR.

    A flag overtakes only when it reaches the responder while its payload's last packets are still in the
    reorder pool, which drains whenever the connection goes idle. So the writes are small (4 KiB, 16 packets
    each): the whole doorbell's requests reach the responder together, where 64 KiB writes crossed the socket in
    pieces and the pool often drained between a payload and its flag (no overtaking in 8 seeds on a loaded
    host). With 4 KiB writes every seed of 40, run four times (once beside two busy loops), showed 3 to 8 of the
    8 flags overtaking; a few seeds are tried, the first that shows it ends the test."""
    size = 4 * 1024
    seen = []
    for seed in range(1, 6):
        link = make_link(adaptive_routing=True, seed=seed, packet_size=256)
        hp = HostPoster(host_lib, link.a)
        judge = FlagJudge(link)
        link.observe(judge)
        for i in range(8):
            judge.covers.setdefault(0, []).append([(0, size * (i + 1))])
            write(hp, link, size * i, size)
            hp.add("inline8", flag_addr(link, 0), link.mr_flags.rkey, i + 1)
        hp.add("read", 0, 0, 0, 0, 0, completion=True)
        hp.ring()
        hp.wait_cqes(1)
        link.observe(None)
        seen += judge.violations
        if seen:
            break
    assert seen, "adaptive routing never let a flag write overtake its payload: the model lost its reordering"


def corrupt(link: Link, index: int, offset: int, data: bytes) -> None:
    slot = (index & (link.a.wqe_cnt - 1)) * L.WQE_BB
    link.a.sq[slot + offset:slot + offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


BAD_WQES = {
    # name: (how to spoil WQE 1 of a write, syndrome, text in the reason)
    "unknown opcode": (lambda link: corrupt(link, 1, 3, b"\x3f"), L.Syndrome.LOCAL_QP_OP_ERR, "opcode"),
    "send opcode": (lambda link: corrupt(link, 1, 3, bytes([L.Opcode.SEND])), L.Syndrome.LOCAL_QP_OP_ERR, "SEND"),
    "two data segments": (lambda link: corrupt(link, 1, 7, b"\x04"), L.Syndrome.LOCAL_QP_OP_ERR, "2 data segments"),
    "ds zero": (lambda link: corrupt(link, 1, 7, b"\x00"), L.Syndrome.LOCAL_QP_OP_ERR, "ds is 0"),
    "stale index": (lambda link: corrupt(link, 1, 1, (1 + 64).to_bytes(2, "big")), L.Syndrome.LOCAL_QP_OP_ERR,
                    "stale"),
    "wrong qpn": (lambda link: corrupt(link, 1, 4, (link.a.qpn + 1).to_bytes(3, "big")), L.Syndrome.LOCAL_QP_OP_ERR,
                  "QPN"),
    "opmod": (lambda link: corrupt(link, 1, 0, b"\x08"), L.Syndrome.LOCAL_QP_OP_ERR, "opmod"),
    "byte_count 0": (lambda link: corrupt(link, 1, 32, bytes(4)), L.Syndrome.LOCAL_LENGTH_ERR, "2^31"),
    "bad lkey": (lambda link: corrupt(link, 1, 36, (link.mr_src.lkey ^ 0x5A5A00).to_bytes(4, "big")),
                 L.Syndrome.LOCAL_PROT_ERR, "ibv_wc_status 4"),
    "bad rkey": (lambda link: corrupt(link, 1, 24, (link.mr_dst.rkey ^ 0x5A5A00).to_bytes(4, "big")),
                 L.Syndrome.REMOTE_ACCESS_ERR, "ibv_wc_status 10"),
    "out of bounds": (lambda link: corrupt(link, 1, 16, (link.dst.ctypes.data + link.dst.nbytes).to_bytes(8, "big")),
                      L.Syndrome.REMOTE_ACCESS_ERR, "ibv_wc_status 10"),
}


@pytest.mark.parametrize("name", list(BAD_WQES))
def test_bad_wqe_gives_an_error_cqe_then_flushes(make_link, host_lib, name: str) -> None:
    spoil, syndrome, why = BAD_WQES[name]
    link = make_link()
    hp = HostPoster(host_lib, link.a)
    write(hp, link, 0, 1024, completion=True)   # 0: fine, and asks for a CQE
    write(hp, link, 1024, 1024)                 # 1: spoiled below (no CQE asked: errors always report)
    write(hp, link, 2048, 1024)                 # 2, 3: flushed
    write(hp, link, 3072, 1024, completion=True)
    spoil(link)
    hp.ring()
    cqes = hp.wait_cqes(4)
    assert (cqes[0].opcode, cqes[0].wqe_counter) == (L.CqeOpcode.REQ, 0)
    assert (cqes[1].opcode, cqes[1].wqe_counter, cqes[1].syndrome) == (L.CqeOpcode.REQ_ERR, 1, syndrome)
    assert [(c.opcode, c.wqe_counter, c.syndrome) for c in cqes[2:]] == [
        (L.CqeOpcode.REQ_ERR, 2, L.Syndrome.WR_FLUSH_ERR), (L.CqeOpcode.REQ_ERR, 3, L.Syndrome.WR_FLUSH_ERR)]
    assert all(c.qpn == link.a.qpn for c in cqes)
    assert len(link.a.errors) == 1 and why in link.a.errors[0], link.a.errors
    assert np.array_equal(link.dst[:1024], link.src[:1024]) and not link.dst[2048:4096].any()
    # the QP stays in error: later WQEs flush too, each with its CQE
    write(hp, link, 4096, 1024)
    hp.ring()
    (late,) = hp.wait_cqes(5)[4:]
    assert (late.opcode, late.wqe_counter, late.syndrome) == (L.CqeOpcode.REQ_ERR, 4, L.Syndrome.WR_FLUSH_ERR)
    assert not link.dst[4096:5120].any()


def test_atomic_needs_an_8_byte_data_segment(make_link, host_lib) -> None:
    link = make_link()
    hp = HostPoster(host_lib, link.a)
    hp.add("fadd", flag_addr(link, 0), link.mr_flags.rkey, 1, link.scratch.ctypes.data, link.mr_scratch.lkey)
    corrupt(link, 0, 48, (4).to_bytes(4, "big"))
    hp.ring()
    (cqe,) = hp.wait_cqes(1)
    assert (cqe.opcode, cqe.syndrome, cqe.wqe_opcode) == (L.CqeOpcode.REQ_ERR, L.Syndrome.LOCAL_LENGTH_ERR,
                                                         L.Opcode.ATOMIC_FA)
    assert int(link.flags[0]) == 0


def test_inline_data_longer_than_the_qp_allows(make_link, host_lib) -> None:
    link = make_link(max_inline=16)
    hp = HostPoster(host_lib, link.a)
    hp.add("inline8", flag_addr(link, 0), link.mr_flags.rkey, 7)
    corrupt(link, 0, 32, (32 | L.INLINE_SEG).to_bytes(4, "big"))
    hp.ring()
    (cqe,) = hp.wait_cqes(1)
    assert (cqe.opcode, cqe.syndrome) == (L.CqeOpcode.REQ_ERR, L.Syndrome.LOCAL_LENGTH_ERR)


def test_doorbell_misuse_is_reported(make_link, host_lib) -> None:
    link = make_link(wqe_cnt=16)
    hp = HostPoster(host_lib, link.a)
    for i in range(3):
        write(hp, link, 64 * i, 64, completion=True)
    word2 = host_lib.tpd_test_doorbell_word(hp.slot(2))
    word0 = host_lib.tpd_test_doorbell_word(hp.slot(0))
    host_lib.tpd_test_ring(hp.addr["dbrec"], hp.addr["bf"], 3, word2)
    link.a.kick()
    hp.wait_cqes(3)
    host_lib.tpd_test_ring(hp.addr["dbrec"], hp.addr["bf"], 3, word0)  # a doorbell that goes backwards
    link.a.kick()
    wait_until(lambda: link.a.violations, "the backwards doorbell to be noticed", **SOFT_QUEUE_WAIT)
    assert "went back" in link.a.violations[0]
    host_lib.tpd_test_ring(hp.addr["dbrec"], hp.addr["bf"], 3 + 17, word2)  # 17 WQEBBs rung on a 16-slot SQ
    link.a.kick()
    wait_until(lambda: any("overrun" in v for v in link.a.violations), "the SQ overrun to be noticed",
               **SOFT_QUEUE_WAIT)
